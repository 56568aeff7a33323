"""The loader streams: a module that is a small part of a sharded checkpoint opens only its shards,
reads only its bytes and peaks in host memory far below the checkpoint size. Each measurement has
its negative control, a load that selects everything, which does see the big numbers."""

import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxsync import weights
from jaxsync.weights import Rule


BIG = {  # unrelated tensors, 316 MiB in all: key -> (shard, shape)
    "lm.embed": ("s1", (1024, 4096)),  # 16 MiB next to the module's own tensors
    "lm.layers.0": ("s2", (25, 1024, 1024)),
    "lm.layers.1": ("s3", (25, 1024, 1024)),
    "lm.layers.2": ("s4", (25, 1024, 1024)),
}
BIG_BYTES = sum(4 * int(np.prod(shape)) for _, shape in BIG.values())


class _Tiny(nnx.Module):
    """The module being loaded: 5 -> 7 -> 3, a few hundred bytes."""

    def __init__(self):
        rngs = nnx.Rngs(0)
        self.fc1 = nnx.Linear(5, 7, rngs=rngs)
        self.fc2 = nnx.Linear(7, 3, rngs=rngs)


class _Everything(nnx.Module):
    """The negative control: a module owning every tensor of the checkpoint."""

    def __init__(self):
        self.model = _Tiny()
        self.lm = nnx.Dict({k.split(".", 1)[1].replace(".", "_"): _param(k) for k in BIG})


def _param(key):
    return nnx.Param(jnp.zeros(BIG[key][1], jnp.float32))


TINY_RULES = [
    Rule(r"(fc[12])\.weight", r"\1.kernel", weights.linear),
    Rule(r"(fc[12])\.bias", r"\1.bias"),
]
ALL_RULES = [
    Rule(r"model\.(fc[12])\.weight", r"model.\1.kernel", weights.linear),
    Rule(r"model\.(fc[12])\.bias", r"model.\1.bias"),
    Rule(r"lm\.embed", "lm.embed"),
    Rule(r"lm\.layers\.(\d)", r"lm.layers_\1"),
]


def load(kind: str, checkpoint: Path) -> nnx.Module:
    """`tiny` selects the small module's keys; `all` loads every tensor."""
    if kind == "tiny":
        return weights.load_weights(
            _Tiny, checkpoint, TINY_RULES, select=r"model\.", strip="model."
        )
    return weights.load_weights(_Everything, checkpoint, ALL_RULES)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    rng = np.random.default_rng(0)
    tiny = {
        "model.fc1.weight": (7, 5),
        "model.fc1.bias": (7,),
        "model.fc2.weight": (3, 7),
        "model.fc2.bias": (3,),
    }
    shards = {"s1": {k: rng.standard_normal(s).astype(np.float32) for k, s in tiny.items()}}
    for key, (shard, shape) in BIG.items():
        shards.setdefault(shard, {})[key] = np.ones(shape, np.float32)
    weight_map = {}
    for shard, tensors in shards.items():
        save_file(tensors, root / f"{shard}.safetensors")
        weight_map.update({k: f"{shard}.safetensors" for k in tensors})
        tensors.clear()  # one shard in memory at a time
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return root


class _CountingOpen:
    """Wraps `safe_open` (headers) and the reader's plain `open` (tensor data): records the
    shard files opened and the tensor bytes read."""

    def __init__(self):
        self.opened, self.bytes = [], 0

    def __call__(self, file, framework):
        self.opened.append(Path(file).name)
        return _CountingHandle(safe_open(file, framework=framework), self)

    def open(self, file, mode="r", **kwargs):
        real = open(file, mode, **kwargs)
        if "b" not in mode or Path(file).suffix != ".safetensors":
            return real
        self.opened.append(Path(file).name)
        return _CountingFile(real, self)


class _CountingFile:
    """A binary file whose `readinto` (the tensor reader) counts the bytes it reads."""

    def __init__(self, real, log):
        self.real, self.log = real, log

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.real.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self.real, name)

    def readinto(self, buffer):
        n = self.real.readinto(buffer)
        self.log.bytes += n or 0
        return n


class _CountingHandle:
    def __init__(self, real, log):
        self.real, self.log = real, log

    def __enter__(self):
        self.handle = self.real.__enter__()
        return self

    def __exit__(self, *exc):
        return self.real.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def get_slice(self, key):
        return _CountingSlice(self.handle.get_slice(key), self.log)

    def get_tensor(self, key):
        tensor = self.handle.get_tensor(key)
        self.log.bytes += tensor.nbytes
        return tensor


class _CountingSlice:
    def __init__(self, real, log):
        self.real, self.log = real, log

    def get_shape(self):
        return self.real.get_shape()

    def get_dtype(self):
        return self.real.get_dtype()

    def __getitem__(self, index):
        tensor = self.real[index]
        self.log.bytes += tensor.nbytes
        return tensor


@pytest.mark.parametrize("kind", ["tiny", "all"])
def test_opens_only_needed_shards_and_reads_only_needed_bytes(checkpoint, monkeypatch, kind):
    counter = _CountingOpen()
    monkeypatch.setattr("jaxsync.weights._checkpoint.safe_open", counter)
    monkeypatch.setattr("jaxsync.weights._checkpoint.open", counter.open, raising=False)
    net = load(kind, checkpoint)
    tiny_bytes = sum(a.nbytes for a in weights.to_numpy_state(net).values() if a.size < 100)
    if kind == "tiny":
        assert set(counter.opened) == {"s1.safetensors"}  # s2..s4 hold none of its keys
        assert counter.bytes == tiny_bytes  # not even the 16 MiB neighbour in s1
    else:  # the control: the same counters see the whole checkpoint
        assert set(counter.opened) == {f"s{i}.safetensors" for i in range(1, 5)}
        assert counter.bytes == BIG_BYTES + tiny_bytes
    fc1 = net.model.fc1 if kind == "all" else net.fc1
    with safe_open(checkpoint / "s1.safetensors", framework="numpy") as f:
        want = f.get_tensor("model.fc1.weight").T
    np.testing.assert_array_equal(np.asarray(fc1.kernel[...]), want)  # and the values are right


# The peak is the process's own VmHWM: Linux carries ru_maxrss over fork + exec, so a child's
# ru_maxrss starts at the (large) RSS of this pytest process.
_MEASURE = """
import re, sys, importlib.util
import jax, jax.numpy as jnp
spec = importlib.util.spec_from_file_location("case", sys.argv[1])
case = importlib.util.module_from_spec(spec)
spec.loader.exec_module(case)
(jnp.zeros(3) + 1).block_until_ready()  # the baseline runs the runtime up (~45 MiB) too
if sys.argv[2] != "baseline":
    case.load(sys.argv[2], case.Path(sys.argv[3]))
status = open("/proc/self/status").read()
print(int(re.search(r"VmHWM:\\s*(\\d+) kB", status).group(1)) * 1024)
"""


def _peak_rss(kind, checkpoint):
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, __file__, kind, str(checkpoint)],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.split()[-1])


def test_peak_host_memory_far_below_checkpoint(checkpoint):
    if not Path("/proc/self/status").exists():
        pytest.skip("needs Linux /proc for the peak resident set (VmHWM)")
    baseline = _peak_rss("baseline", checkpoint)
    tiny = _peak_rss("tiny", checkpoint) - baseline
    everything = _peak_rss("all", checkpoint) - baseline
    assert tiny < 0.1 * BIG_BYTES, (tiny, baseline)
    assert everything > 0.9 * BIG_BYTES, (everything, baseline)  # the measurement can see it


def test_progress_bar_only_for_slow_loads(checkpoint, monkeypatch, capsys):
    ticks = iter(range(0, 1000, 3))  # every clock reading is 3 s later
    monkeypatch.setattr("jaxsync.weights._progress.clock", lambda: next(ticks))
    load("tiny", checkpoint / "model.safetensors.index.json")
    assert capsys.readouterr().err == ""  # stderr is no terminal here: silent by default
    weights.load_weights(
        _Tiny, checkpoint, TINY_RULES, select=r"model\.", strip="model.", progress=True
    )
    err = capsys.readouterr().err
    assert err.startswith("\rloading weights [") and err.endswith("\n"), err
    assert "100%" in err.splitlines()[-1] and "4 tensors" in err
    monkeypatch.setattr("jaxsync.weights._progress.clock", lambda: 0.0)  # a fast load
    weights.load_weights(
        _Tiny, checkpoint, TINY_RULES, select=r"model\.", strip="model.", progress=True
    )
    assert capsys.readouterr().err == ""
