"""`jaxsync verify`, the registry, doctests of the public core, and the pytest plugin."""

import doctest
import importlib
import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxsync import _cli, registry
from jaxsync.testing import torch_available


def test_verify_demo_path_json(capsys):
    rc = _cli.main(["verify", "--paths", "core.table_gather", "--json"])
    out = json.loads(capsys.readouterr().out)
    (row,) = out["paths"]
    assert rc == 0 and row["ok"], row
    assert row["parity"]["status"] == ("pass" if torch_available() else "skipped")
    assert {c["check"]: c["ok"] for c in row["checks"]} == {
        "jaxpr: no host callback": True,
        "hlo: no host transfer": True,
        "runtime: sync_guard": True,
        "no recompile": True,
        "dispatch probe": True,
    }


def test_verify_fails_on_a_bad_path(capsys):
    import jax

    @jax.jit
    def f(x):
        return x + 1

    def reads(x):
        return f(x) * float(x[0])

    import jax.numpy as jnp

    @registry.register_path("test.reads_back", "negative control")
    def _build(checkpoint):
        return registry.PathCase(reads, [(jnp.ones(3),), (jnp.zeros(3),)])

    try:
        rc = _cli.main(["verify", "--paths", "test.reads_back", "--no-probe"])
        out = capsys.readouterr().out
        assert rc == 1 and "NO" in out and "device->host read" in out
    finally:
        registry._paths.pop("test.reads_back")


def test_unknown_path_and_usage(capsys):
    with pytest.raises(ValueError, match="unknown path"):
        registry.paths(["nope"])
    assert _cli.main([]) == 2


def test_every_registered_path_builds_and_lists():
    specs = registry.paths()
    assert any(s.name == "core.table_gather" for s in specs)
    assert len({s.name for s in specs}) == len(specs)


PUBLIC_MODULES = [
    "jaxsync._device_cache",
    "jaxsync._transfer",
    "jaxsync._jit",
    "jaxsync.check._static",
    "jaxsync.check._guard",
    "jaxsync.check._recompile",
    "jaxsync.check._probe",
    "jaxsync.check._report",
    "jaxsync.testing",
    "jaxsync.hfconfig",
    "jaxsync._placement",
    "jaxsync._packing",
    "jaxsync.kv._slots",
    "jaxsync.kv._storage",
]


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE | doctest.IGNORE_EXCEPTION_DETAIL
    result = doctest.testmod(module, optionflags=flags)
    assert result.failed == 0


PLUGIN_TEST = """
import jax, jax.numpy as jnp, pytest

f = jax.jit(lambda x: x * 2)
x = jnp.ones(4)
f(x)

@pytest.mark.sync_free
def test_clean():
    f(x)

@pytest.mark.sync_free
def test_reads():
    int(f(x)[0])

@pytest.mark.sync_free
def test_recompiles():
    f(jnp.ones(5))

def test_fixture(sync_free):
    with sync_free():
        f(x)

@pytest.mark.gpu
def test_needs_gpu():  # skipped on a CPU-only machine, run (and passing) on a GPU/TPU
    assert jax.default_backend() != "cpu"
"""


def test_pytest_plugin(tmp_path):
    (tmp_path / "test_user.py").write_text(PLUGIN_TEST)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    out = proc.stdout
    want = (
        "2 failed, 2 passed, 1 skipped" if jax.default_backend() == "cpu" else "2 failed, 3 passed"
    )
    assert want in out, out
    assert "test_reads" in out and "test_recompiles" in out


def test_precompile_then_mixed_stream_does_not_recompile(capsys):
    import jaxsync
    from jaxsync.paths.demo import table_gather
    from jaxsync.check import no_recompile

    done = jaxsync.precompile(["core.table_gather"], buckets=[8, 16, 32, 64])
    assert [c.bucket for c in done] == [8, 16, 32, 64]
    assert "precompile [" in capsys.readouterr().err
    rng = np.random.default_rng(0)
    with no_recompile():
        for n in rng.integers(1, 64, size=40):
            table_gather(rng.integers(0, 97, size=int(n)).tolist())


def test_without_precompile_a_new_bucket_recompiles():
    from jaxsync.paths.demo import table_gather
    from jaxsync.check import RecompileError, no_recompile

    with pytest.raises(RecompileError), no_recompile():
        table_gather(list(range(90)))  # bucket 128 was never compiled


def test_bench_refuses_without_accelerator(capsys):
    import jax

    if jax.default_backend() != "cpu":
        pytest.skip("an accelerator is present")
    assert _cli.main(["bench"]) == 2
    reason = "numbers would mean nothing" if torch_available() else "torch is not importable"
    assert reason in capsys.readouterr().out


def test_bench_markdown_and_chart(tmp_path):
    from jaxsync.bench._render import markdown, render

    m = {"device_ms": 1.0, "blocked_ms": 0.01, "first_call_ms": 100.0}
    result = {
        "environment": {
            "date": "d",
            "device": "X",
            "jax": "j",
            "torch": "t",
            "transformers": "h",
            "python": "3",
        },
        "copy_ceiling_gbps": {"jax": 4000.0, "torch": 4100.0},
        "rows": [
            {
                "family": "kv",
                "size": "tiny",
                "name": "copy 64",
                "bytes_moved": 10,
                "jaxsync": dict(m, gbps=3500.0),
                "vllm_post_pr": dict(m, device_ms=4.0, kernels=3),
            },
            {
                "family": "kv",
                "size": "tiny",
                "name": "swap 64 [pool]",
                "bytes_moved": 10,
                "jaxsync": dict(m, gbps=40.0),
                "torch_pinned_ceiling": dict(m, gbps=50.0),
            },
        ],
    }
    text = markdown(result)
    assert "| copy 64 | jaxsync | 1.000 | 0.010 | 100 |  | 3500 (88%) |" in text
    # a host<->device row is measured against its own pinned transfer, not the device copy
    assert "| swap 64 [pool] | jaxsync | 1.000 | 0.010 | 100 |  | 40 (80%) |" in text
    render(result, tmp_path)
    assert (tmp_path / "bench.md").exists()


def test_every_path_builds_without_torch(monkeypatch):
    # `jaxsync verify` on a torch-free install must still run every check (parity says skipped).
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "transformers", None)
    for spec in registry.paths():
        case = spec.build(None)
        assert len(case.inputs) >= 2, spec.name


def test_jax_dispatch_count_from_profiler_trace():
    import jax
    import jax.numpy as jnp

    from jaxsync.bench._timing import jax_executions_per_call

    f = jax.jit(lambda v: v * 2)
    g = jax.jit(lambda v: v + 1)
    x = jnp.ones(8)
    assert jax_executions_per_call(lambda: f(x)) == 1
    assert jax_executions_per_call(lambda: g(f(x))) == 2


def test_execution_count_takes_one_nesting_level():
    from jaxsync.bench._timing import count_executions

    def ev(name):
        return {"ph": "X", "name": name}

    nested = ["PjRtCApiLoadedExecutable::Execute", "PjRtStreamExecutorLoadedExecutable::Execute",
              "PjRtStreamExecutorLoadedExecutable::ExecuteHelper"]  # fmt: skip
    assert count_executions([ev(n) for n in nested * 2]) == 2  # two programs, three events each
    inner = "CommonPjRtLoadedExecutable::ExecuteHelperOnSingleDevice"  # XLA:CPU's one level
    assert count_executions([ev(inner), ev(inner), ev("ThunkExecutor::Execute")]) == 2
    assert count_executions([ev("something else"), {"ph": "i", "name": nested[0]}]) is None


def test_precompile_a_servers_own_instance():
    # Compiled programs belong to the instance: precompile the PathCase of the object you serve.
    import jaxsync
    from jaxsync.check import no_recompile

    (spec,) = registry.paths(["glm4v.vision_tower"])
    case = spec.build(None)
    enc = case.fn
    done = jaxsync.precompile([jaxsync.Target("tower", case)], buckets=[24, 32, 48], progress=False)
    assert [(c.path, c.bucket) for c in done] == [("tower", 24), ("tower", 32), ("tower", 48)]
    from jaxsync.models.glm4v import _reference as ref

    grids = [[[1, 6, 14]], [[1, 8, 12]], [[1, 10, 14]], [[1, 4, 20]], [[2, 6, 8]], [[1, 8, 24]]]
    inputs = [(ref.pixels(g, enc.cfg, seed=i), g) for i, g in enumerate(grids)]  # 21..48 tokens
    with no_recompile():
        for px, g in inputs:
            enc(px, g)
