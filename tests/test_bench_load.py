"""`tools/bench_load.py` at tiny sizes: the synthetic checkpoint has the released layout, and the
streaming loader reads the tower's bytes from the shards holding them and nothing else."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest


pytest.importorskip("torch")
pytest.importorskip("transformers")

_TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _bench_load():
    spec = importlib.util.spec_from_file_location("bench_load", _TOOLS / "bench_load.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("family", "shard_size", "baseline"), [("voxtral", "97KB", True), ("gemma3n", "7MB", False)]
)
def test_tiny_checkpoint_loads_only_the_tower(tmp_path, family, shard_size, baseline):
    bench = _bench_load()
    facts = bench.build_checkpoint(
        family, tmp_path, size="tiny", lm_layers=1, max_shard_size=shard_size
    )
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert sorted(set(index["weight_map"].values())) == files
    assert facts["shards"] == len(files) >= 2
    assert facts["lm_layers_written"] == 1 < facts["lm_layers_released"]
    assert facts["bytes"] == sum(p.stat().st_size for p in tmp_path.glob("*.safetensors")) - sum(
        _header_bytes(p) for p in tmp_path.glob("*.safetensors")
    )

    m = bench.measure(family, tmp_path, repeats=1)
    read = m["read_mib"] * 2**20
    # Every tower parameter is one bf16 element in the checkpoint, and read exactly once.
    assert m["tower_params"] > 0
    assert read == 2 * m["tower_params"]
    assert read < facts["bytes"] / 4
    assert 1 <= m["shards_opened"] < facts["shards"]
    assert m["seconds"] > 0 and m["peak_mib"] > 0

    if not baseline:
        return
    # The control: reading every shard reads the whole checkpoint.
    whole = bench.measure(family, tmp_path, repeats=1, baseline=True)
    assert whole["read_mib"] * 2**20 == facts["bytes"]
    assert whole["shards_opened"] == facts["shards"]


def test_written_shard_is_plain_safetensors(tmp_path):
    """The streaming writer's files read back through safetensors with the declared layout."""
    from safetensors import safe_open

    sys.path.insert(0, str(_TOOLS))
    from _synth_checkpoint import Tensor, write_shard

    layout = {
        "a.weight": Tensor((3, 5), "BF16"),
        "b": Tensor((7,), "F32"),
        "c": Tensor((2,), "I64"),
    }
    write_shard(tmp_path / "x.safetensors", layout)
    with safe_open(str(tmp_path / "x.safetensors"), framework="numpy") as f:
        assert sorted(f.keys()) == sorted(layout)
        assert f.get_slice("a.weight").get_shape() == [3, 5]
        assert f.get_slice("a.weight").get_dtype() == "BF16"
        b = f.get_tensor("b")
    assert b.shape == (7,) and b.dtype.name == "float32" and b.std() > 0


def _header_bytes(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")
