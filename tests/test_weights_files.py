"""Broken checkpoint files are a WeightError naming the file, never a raw SafetensorError, OSError
or KeyError."""

import json
import re

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jaxsync import weights
from jaxsync.weights import Rule, WeightError


class _Pair(nnx.Module):
    def __init__(self):
        self.a = nnx.Param(np.zeros((3, 5), np.float32))
        self.b = nnx.Param(np.zeros((7,), np.float32))


RULES = [Rule("a", "a"), Rule("b", "b")]


def _sharded(tmp_path):
    rng = np.random.default_rng(0)
    save_file({"a": rng.standard_normal((3, 5)).astype(np.float32)}, tmp_path / "s1.safetensors")
    save_file({"b": rng.standard_normal(7).astype(np.float32)}, tmp_path / "s2.safetensors")
    index = {"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return tmp_path


def _truncate(file):
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 5])


def _garbage_header(file):
    data = file.read_bytes()
    file.write_bytes(data[:8] + b"\x00garbage!" + data[17:])


def _header_length_too_big(file):
    data = file.read_bytes()
    file.write_bytes((2**40).to_bytes(8, "little") + data[8:])


def _drop_shard(tmp_path):
    (tmp_path / "s2.safetensors").unlink()


def _key_not_in_shard(tmp_path):
    save_file({"c": np.zeros(7, np.float32)}, tmp_path / "s2.safetensors")


@pytest.mark.parametrize(
    "breaks, file",
    [
        (lambda d: _truncate(d / "s2.safetensors"), "s2.safetensors"),
        (lambda d: _garbage_header(d / "s1.safetensors"), "s1.safetensors"),
        (lambda d: _header_length_too_big(d / "s2.safetensors"), "s2.safetensors"),
        (_drop_shard, "s2.safetensors"),
        (_key_not_in_shard, "s2.safetensors"),
        (lambda d: (d / "model.safetensors.index.json").write_text("{"), "index.json"),
        (lambda d: (d / "model.safetensors.index.json").write_text("{}"), "index.json"),
    ],
    ids=["truncated", "garbage-header", "header-length", "missing-shard", "key-absent",
         "index-json", "index-no-weight-map"],
)  # fmt: skip
def test_broken_files_name_the_file(tmp_path, breaks, file):
    breaks(_sharded(tmp_path))
    for call in (
        lambda: weights.load_weights(_Pair, tmp_path, RULES),
        lambda: weights.checkpoint_dtype(tmp_path),
        lambda: dict(weights.read_checkpoint(tmp_path)),
    ):
        with pytest.raises(WeightError, match=re.escape(file)):
            call()


def test_intact_files_load(tmp_path):
    # The positive control of the fixture above: unbroken, the same checkpoint loads.
    net = weights.load_weights(_Pair, _sharded(tmp_path), RULES)
    assert net.a[...].shape == (3, 5)
    assert weights.checkpoint_dtype(tmp_path) == np.float32
    assert sorted(k for k, _ in weights.read_checkpoint(tmp_path)) == ["a", "b"]


def test_single_truncated_file(tmp_path):
    save_file({"a": np.zeros((3, 5), np.float32), "b": np.zeros(7, np.float32)}, tmp_path / "m.st")
    _truncate(tmp_path / "m.st")
    with pytest.raises(WeightError, match=r"unreadable safetensors file .*m\.st"):
        weights.load_weights(_Pair, tmp_path / "m.st", RULES)
