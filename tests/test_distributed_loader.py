"""The loader's block reading, in one process: how a block index maps through each transform,
and a load forced through the block path (as a process holding part of a sharding takes it)
equal, bit for bit, to the whole-tensor load. tests/test_distributed.py runs it in 2 processes."""

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import jaxsync
from jaxsync.weights import (
    Rule,
    Transform,
    _loader,
    compose,
    conv,
    linear,
    load_weights,
    reshape,
    transpose,
)
from jaxsync.weights._sliced import permutation, stored_index


@pytest.mark.parametrize(
    ("transform", "stored", "param", "perm"),
    [
        (None, (4, 6), (4, 6), (0, 1)),
        (linear, (6, 4), (4, 6), (1, 0)),
        (conv(1), (8, 4, 3), (3, 4, 8), (2, 1, 0)),
        (conv(2), (8, 4, 3, 5), (3, 5, 4, 8), (2, 3, 1, 0)),
        (transpose(3, 2, 1, 0), (8, 4, 3, 5), (5, 3, 4, 8), (3, 2, 1, 0)),
        (transpose(2, 0, 1), (2, 3, 5), (5, 2, 3), (2, 0, 1)),
        (compose(linear, linear), (4, 6), (4, 6), (0, 1)),
        (lambda w: w.T, (6, 4), (4, 6), (1, 0)),  # a plain callable is probed the same way
    ],
    ids=str,
)
def test_axis_permutations_map_a_block_index(transform, stored, param, perm):
    assert permutation(transform, stored, param) == perm
    rng = np.random.default_rng(0)
    w = rng.standard_normal(stored).astype(np.float32)
    full = np.asarray(w if transform is None else transform(w))
    index = tuple(slice(n // 3, n - n // 4) for n in param)  # an uneven block of every axis
    block = w[stored_index(index, perm)]
    np.testing.assert_array_equal(block if transform is None else transform(block), full[index])


@pytest.mark.parametrize(
    ("transform", "stored", "param"),
    [
        (reshape(4, 6, stored=(24,)), (24,), (4, 6)),  # a reshape maps no block index
        (compose(linear, reshape(2, 2, 6, stored=(4, 6))), (6, 4), (2, 2, 6)),
        (lambda w: w.T * 2, (6, 4), (4, 6)),  # arithmetic on the values shows on the probe
        (lambda w: w - w.min(), (4, 6), (4, 6)),  # not elementwise: a block's min differs
        (lambda w: w[::-1], (4, 6), (4, 6)),  # a flip is not an axis permutation
        (None, (6, 4), (4, 6)),  # shapes that disagree
    ],
    ids=str,
)
def test_other_transforms_are_read_whole(transform, stored, param):
    assert permutation(transform, stored, param) is None


class _Block(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(12, 12, rngs=rngs)


class _Tiny(nnx.Module):
    def __init__(self, rngs):
        self.proj = nnx.Linear(8, 12, rngs=rngs)
        self.blocks = jaxsync.LayerStack(_Block, 3, rngs=rngs)
        self.conv = nnx.Conv(4, 8, kernel_size=(3,), rngs=rngs)
        self.scaled = nnx.Linear(12, 4, use_bias=False, rngs=rngs)


_SCALED = Transform(lambda w: w.T * 2, lambda t: (t[1], t[0]), "scaled")
RULES = (
    Rule(r"(proj|blocks\.\d+\.fc)\.weight", r"\1.kernel", linear),
    Rule(r"(proj|blocks\.\d+\.fc|conv)\.bias", r"\1.bias"),
    Rule(r"conv\.weight", "conv.kernel", conv(1)),
    Rule(r"scaled\.weight", "scaled.kernel", _SCALED),
)
PARTITION_RULES = (
    (r"proj\.kernel", (None, "model")),  # stored [O, I]: the block index maps to stored axis 0
    (r"proj\.bias", ("model",)),
    (r"blocks\.layer\.fc\.kernel", ("model", "data")),  # stacked, both axes split
    (r"conv\.kernel", (None, "data", "model")),  # stored [O, I, k]
    (r"scaled\.kernel", (None, "model")),  # not a permutation: read whole, then sliced
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    rng = np.random.default_rng(1)
    shapes = {"proj.weight": (12, 8), "proj.bias": (12,), "conv.weight": (8, 4, 3)}
    shapes |= {"conv.bias": (8,), "scaled.weight": (4, 12)}
    for i in range(3):
        shapes |= {f"blocks.{i}.fc.weight": (12, 12), f"blocks.{i}.fc.bias": (12,)}
    tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    path = tmp_path_factory.mktemp("sliced") / "model.safetensors"
    save_file(tensors, str(path))
    return str(path), tensors


def _load(checkpoint):
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])
    module = load_weights(
        lambda: _Tiny(nnx.Rngs(0)), checkpoint, RULES, mesh=mesh, partition_rules=PARTITION_RULES
    )
    return nnx.to_flat_state(nnx.state(module)), _loader.last_load_stats()


def test_the_block_path_loads_what_the_whole_tensor_path_loads(checkpoint, monkeypatch):
    checkpoint, tensors = checkpoint
    whole, whole_stats = _load(checkpoint)
    assert whole_stats.bytes_read == whole_stats.selected_bytes and not whole_stats.sliced
    # What a process holding part of each sharding runs; here every block is local.
    monkeypatch.setattr(_loader, "splits_reading", lambda p: isinstance(p, jax.sharding.Sharding))
    blocks, stats = _load(checkpoint)
    assert stats.whole == ["scaled.kernel"]
    assert "blocks.layer.fc.kernel" in stats.sliced and "conv.kernel" in stats.sliced
    # The distinct blocks of 8 devices cover each tensor once: every byte, none twice.
    assert stats.bytes_read == stats.selected_bytes
    assert [p for p, _ in whole] == [p for p, _ in blocks]
    for (path, a), (_, b) in zip(whole, blocks, strict=True):
        a, b = a.get_value(), b.get_value()
        assert a.sharding == b.sharding, path
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))
    loaded = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in blocks}
    np.testing.assert_array_equal(loaded["scaled.kernel"], tensors["scaled.weight"].T * 2)
    np.testing.assert_array_equal(
        loaded["blocks.layer.fc.kernel"][2], tensors["blocks.2.fc.weight"].T
    )
