"""The loader's block reading: how a block index maps through each transform (axis
permutations, gathers such as head-major qkv and GLU pairs, and the value-changing transforms
read whole), a load forced through the block path in one process (as a process holding part of a
sharding takes it) equal, bit for bit, to the whole-tensor load, and the same load in 2
processes, each reading half of every split weight except the one read whole, counted."""

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import jaxsync
import jaxsync.testing
from jaxsync.weights import (
    Rule,
    Transform,
    _loader,
    _stream,
    compose,
    conv,
    linear,
    load_weights,
    reshape,
    transpose,
)
from jaxsync.weights._sliced import gather_map, permutation, stored_index


def _head_major(bias):
    from jaxsync.models.glm4v._config import Glm4vVisionConfig
    from jaxsync.models.glm4v._weights import _head_major_qkv

    cfg = Glm4vVisionConfig(depth=1, hidden_size=16, num_heads=4, out_hidden_size=8,
                            intermediate_size=8)  # fmt: skip  # head_dim 4
    return _head_major_qkv(cfg, bias=bias)


def _glu_pairs():
    from jaxsync.models.gemma3n._weights import GLU_PAIRS

    return GLU_PAIRS


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


@pytest.mark.parametrize(
    ("transform", "stored", "param", "index", "reads"),
    [  # GLM-4.1V's fused qkv [3*N*H, D] -> [D, N*3*H]: heads 1 and 2 take 3 runs of 8 rows
        (_head_major(False), (48, 16), (16, 48), (slice(None), slice(12, 36)), 3),
        (_head_major(True), (48,), (48,), (slice(12, 36),), 3),
        (_glu_pairs(), (12, 6), (6, 12), (slice(1, 5), slice(4, 8)), 2),  # value and gate rows
        (lambda w: w[::-1], (4, 6), (4, 6), (slice(1, 3), slice(2, 5)), 1),  # a flip
        (compose(linear, lambda w: w[:, ::-1]), (6, 4), (4, 6), (slice(0, 3), slice(4, 6)), 1),
    ],
    ids=["head_major_qkv", "head_major_qkv_bias", "glu_pairs", "flip", "linear_flip"],
)
def test_reordering_transforms_read_only_the_rows_a_block_takes(
    transform, stored, param, index, reads
):
    gather = gather_map(transform, stored, param)
    assert gather is not None
    w = np.random.default_rng(0).standard_normal(stored).astype(np.float32)
    want = np.asarray(transform(w))[index]
    read = []
    block = gather.read(lambda i: read.append(w[i]) or w[i], index)
    np.testing.assert_array_equal(block, want)
    assert len(read) == reads
    assert sum(r.nbytes for r in read) == want.nbytes  # the block's own elements, no more


@pytest.mark.parametrize(
    ("transform", "stored", "param"),
    [
        (lambda w: w.T * 2, (6, 4), (4, 6)),
        (lambda w: w - w.min(), (4, 6), (4, 6)),  # the indices are offset: the min shows
        (lambda w: np.abs(w), (4, 6), (4, 6)),  # the negated indices show
        (lambda w: w.astype(np.float32), (4, 6), (4, 6)),
        (lambda w: w.reshape(6, 4), (4, 6), (6, 4)),  # moves elements, not separably per axis
        (lambda w: np.sort(w, axis=None).reshape(w.shape), (4, 6), (4, 6)),
        (None, (4, 6), (4, 6)),  # no transform: the permutation path's
    ],
    ids=["scaled", "minus_min", "abs", "cast", "reshape", "sort", "none"],
)
def test_value_changing_transforms_are_no_gather(transform, stored, param):
    assert gather_map(transform, stored, param) is None


class _Block(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(12, 12, rngs=rngs)


class _Tiny(nnx.Module):
    def __init__(self, rngs):
        self.proj = nnx.Linear(8, 12, rngs=rngs)
        self.blocks = jaxsync.LayerStack(_Block, 3, rngs=rngs)
        self.conv = nnx.Conv(4, 8, kernel_size=(3,), rngs=rngs)
        self.scaled = nnx.Linear(12, 4, use_bias=False, rngs=rngs)
        self.glu = nnx.Linear(6, 12, use_bias=False, rngs=rngs)


_SCALED = Transform(lambda w: w.T * 2, lambda t: (t[1], t[0]), "scaled")
RULES = (
    Rule(r"(proj|blocks\.\d+\.fc)\.weight", r"\1.kernel", linear),
    Rule(r"(proj|blocks\.\d+\.fc|conv)\.bias", r"\1.bias"),
    Rule(r"conv\.weight", "conv.kernel", conv(1)),
    Rule(r"scaled\.weight", "scaled.kernel", _SCALED),
    Rule(r"glu\.weight", "glu.kernel", _glu_pairs()),
)
PARTITION_RULES = (
    (r"proj\.kernel", (None, "model")),  # stored [O, I]: the block index maps to stored axis 0
    (r"proj\.bias", ("model",)),
    (r"blocks\.layer\.fc\.kernel", ("model", "data")),  # stacked, both axes split
    (r"conv\.kernel", (None, "data", "model")),  # stored [O, I, k]
    (r"scaled\.kernel", (None, "model")),  # not a permutation: read whole, then sliced
    (r"glu\.kernel", (None, "model")),  # a gather: each block's rows of value and gate
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    rng = np.random.default_rng(1)
    shapes = {"proj.weight": (12, 8), "proj.bias": (12,), "conv.weight": (8, 4, 3)}
    shapes |= {"conv.bias": (8,), "scaled.weight": (4, 12), "glu.weight": (12, 6)}
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
    monkeypatch.setattr(_stream, "splits_reading", lambda p: isinstance(p, jax.sharding.Sharding))
    blocks, stats = _load(checkpoint)
    assert stats.whole == ["scaled.kernel"]
    assert "blocks.layer.fc.kernel" in stats.sliced and "conv.kernel" in stats.sliced
    assert "glu.kernel" in stats.sliced
    # The distinct blocks of 8 devices cover each tensor once: every byte, none twice.
    assert stats.bytes_read == stats.selected_bytes
    assert [p for p, _ in whole] == [p for p, _ in blocks]
    for (path, a), (_, b) in zip(whole, blocks, strict=True):
        a, b = a.get_value(), b.get_value()
        assert a.sharding == b.sharding, path
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))
    loaded = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in blocks}
    np.testing.assert_array_equal(loaded["scaled.kernel"], tensors["scaled.weight"].T * 2)
    np.testing.assert_array_equal(loaded["glu.kernel"], _glu_pairs()(tensors["glu.weight"]))
    np.testing.assert_array_equal(
        loaded["blocks.layer.fc.kernel"][2], tensors["blocks.2.fc.weight"].T
    )


# ---------------------------------------------------------------- in 2 processes

distributed = jaxsync.testing.distributed_fixture(scope="module", timeout=240)


def _tiny_worker(ctx, path):
    module = load_weights(
        lambda: _Tiny(nnx.Rngs(0)), path, RULES, mesh=ctx.mesh, partition_rules=PARTITION_RULES
    )
    stats = _loader.last_load_stats()
    params = {}
    for p, var in nnx.to_flat_state(nnx.state(module)):
        x = var.get_value()
        params[".".join(map(str, p))] = (x.nbytes, x.sharding.is_fully_replicated, ctx.gather(x))
    return dict(params=params, bytes_read=stats.bytes_read, whole=stats.whole, sliced=stats.sliced)


def test_in_two_processes_each_reads_half_of_each_split_weight(checkpoint, distributed):
    """The gather (glu) and permutation (linear, conv) weights split over processes are read by
    halves; `scaled` (arithmetic) is read whole in each process: its fallback, counted."""
    path, tensors = checkpoint
    whole, _ = _load(path)
    want = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in whole}
    results = distributed(_tiny_worker, path)
    params = results[0]["params"]
    split = {p for p, (_, rep, _) in params.items() if not rep}
    assert {"glu.kernel", "proj.kernel", "conv.kernel", "scaled.kernel"} <= split
    replicated = sum(n for n, rep, _ in params.values() if rep)
    halved = sum(params[p][0] for p in split - {"scaled.kernel"})
    for got in results:
        assert got["whole"] == ["scaled.kernel"] and "glu.kernel" in got["sliced"]
        assert got["bytes_read"] == replicated + halved // 2 + params["scaled.kernel"][0]
        for p, (_, _, value) in got["params"].items():
            np.testing.assert_array_equal(value, want[p], err_msg=p)
