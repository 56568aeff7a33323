"""copy_blocks: torch parity, properties, donation, bad input, buckets, sharding, sync-freedom."""

import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxsync.check
import jaxsync.testing
from jaxsync.harness.paths.kv.reference import (
    as_numpy,
    host_random_cache,
    to_numpy,
    torch_copy_blocks,
)
from jaxsync.kv import KVLayout, copy_blocks
from jaxsync.kv._copy import _copy_same_memory
from jaxsync.testing import block_id_pairs, donation_copy, fresh_copy, requires_torch


LAYERS = ("l0", "l1", "l2")
DEV = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
HOST = DEV.with_memory_kind("pinned_host")
KINDS = {
    "packed": dict(kind="packed", num_kv_heads=2, head_dim=3),
    "separate": dict(kind="separate", num_kv_heads=2, head_dim=3),
    "mla": dict(kind="mla", latent_dim=5),
}
PLACE = {"d2d": (DEV, DEV), "d2h": (DEV, HOST), "h2d": (HOST, DEV)}
DTYPES = {
    "fp32": np.float32,
    "bf16": ml_dtypes.bfloat16,
    "fp16": np.float16,
    "int8": np.int8,
}


def make(kind, num_blocks, dtype, seed, placement):
    layout = KVLayout(num_blocks=num_blocks, block_size=4, dtype=dtype, **KINDS[kind])
    return host_random_cache(layout, LAYERS, seed, placement)


def snapshot(cache):
    return jax.tree.map(as_numpy, cache)


def assert_bits_equal(actual, expected):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape and a.dtype == e.dtype
        assert np.array_equal(a.view(np.uint8), e.view(np.uint8))


@pytest.mark.parametrize("direction", ["d2d", "d2h", "h2d"])
@pytest.mark.parametrize("kind", ["packed", "separate", "mla"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@requires_torch  # its reference is torch
def test_parity_with_torch(kind, direction, dtype):
    s_place, d_place = PLACE[direction]
    src = make(kind, 13, DTYPES[dtype], 0, s_place)
    dst = make(kind, 11, DTYPES[dtype], 1, d_place)  # the two sides may differ in block count
    src_ids, dst_ids = [12, 0, 5, 5, 7], [3, 10, 0, 4, 9]  # a source block may be read twice
    expected = jax.tree.map(to_numpy, torch_copy_blocks(src, dst, src_ids, dst_ids))
    out = copy_blocks(src, dst, src_ids, dst_ids, direction=direction)
    for leaf in jax.tree.leaves(out):
        assert leaf.sharding.memory_kind == d_place.memory_kind
    assert_bits_equal(snapshot(out), expected)


def test_donation_consumes_dst_without_warning():
    for direction in ("d2d", "d2h", "h2d"):
        s_place, d_place = PLACE[direction]
        src = make("packed", 13, np.float32, 0, s_place)
        dst = make("packed", 13, np.float32, 1, d_place)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "Some donated buffers were not usable" would raise
            out = copy_blocks(src, dst, [1, 2], [3, 4])
        jax.block_until_ready(out)
        assert all(leaf.is_deleted() for leaf in jax.tree.leaves(dst)), direction
        assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(src)), direction


def test_empty_ids_is_a_no_op():
    src, dst = make("mla", 13, np.float32, 0, DEV), make("mla", 13, np.float32, 1, DEV)
    assert copy_blocks(src, dst, [], []) is dst


BAD = [
    ("out of range", dict(src_ids=[13], dst_ids=[0]), "src_ids must lie in"),
    ("dst out of range", dict(src_ids=[0], dst_ids=[13]), "dst_ids must lie in"),
    ("negative", dict(src_ids=[-1], dst_ids=[0]), "src_ids must lie in"),
    ("negative dst", dict(src_ids=[0], dst_ids=[-2]), "dst_ids must lie in"),
    ("duplicate dst", dict(src_ids=[0, 1], dst_ids=[2, 2]), "dst_ids must be unique"),
    ("length mismatch", dict(src_ids=[0, 1], dst_ids=[2]), "has 2 ids but dst_ids has 1"),
    ("2-D ids", dict(src_ids=[[0]], dst_ids=[[1]]), "1-D list of ints"),
    ("float ids", dict(src_ids=[0.5], dst_ids=[1]), "src_ids must hold ints"),
    ("bool ids", dict(src_ids=[True], dst_ids=[1]), "src_ids must hold ints"),
    ("unknown direction", dict(direction="h2h"), "unknown direction"),
    ("wrong direction", dict(direction="d2h"), "caches' memory kinds say 'd2d'"),
]


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_before_dispatch(case):
    name, kwargs, message = case
    src, dst = make("packed", 13, np.float32, 0, DEV), make("packed", 13, np.float32, 1, DEV)
    before = snapshot(dst), snapshot(src)
    args = dict(src_ids=[0], dst_ids=[1]) | kwargs
    error = TypeError if name in ("float ids", "bool ids") else ValueError
    with pytest.raises(error, match=re.escape(message)):
        copy_blocks(src, dst, **args)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves((src, dst)))
    assert_bits_equal((snapshot(dst), snapshot(src)), before)


def test_mismatched_caches_raise():
    src = make("packed", 13, np.float32, 0, DEV)
    dst = make("packed", 13, np.float32, 1, DEV)
    other_layers = {"l0": dst["l0"], "l1": dst["l1"], "x": dst["l2"]}
    with pytest.raises(ValueError, match=r"different layers: only in src: \['l2'\]"):
        copy_blocks(src, other_layers, [0], [1])
    with pytest.raises(ValueError, match="block shape/dtype"):
        copy_blocks(src, make("packed", 13, np.float16, 1, DEV), [0], [1])
    with pytest.raises(ValueError, match="block shape/dtype"):
        copy_blocks(src, make("mla", 13, np.float32, 1, DEV), [0], [1])
    with pytest.raises(ValueError, match="structure"):
        copy_blocks(make("separate", 13, np.float32, 0, DEV), dst, [0], [1])
    ragged = dict(dst, l2=dst["l2"][:5])
    with pytest.raises(ValueError, match="disagree on the number of blocks"):
        copy_blocks(src, ragged, [0], [1])
    with pytest.raises(TypeError, match="host data"):
        copy_blocks(src, dst, jnp.array([0]), [1])
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves((src, dst)))


@pytest.mark.parametrize("direction", ["d2d", "d2h"])
def test_padded_equals_unpadded(direction):
    s_place, d_place = PLACE[direction]
    src = make("packed", 13, np.float32, 0, s_place)
    src_ids, dst_ids = [4, 2, 9], [0, 7, 12]
    exact = copy_blocks(src, make("packed", 13, np.float32, 1, d_place), src_ids, dst_ids,
                        buckets=(3,))  # fmt: skip
    padded = copy_blocks(src, make("packed", 13, np.float32, 1, d_place), src_ids, dst_ids)
    assert_bits_equal(snapshot(exact), snapshot(padded))


@pytest.mark.parametrize("direction", ["d2d", "d2h", "h2d"])
def test_sync_free_and_one_program_per_bucket(direction):
    # copy_blocks donates dst and the checker calls it several times with the same arguments:
    # each call gets its own (asynchronous) copy of a device-resident master.
    s_place, d_place = PLACE[direction]
    src = make("packed", 13, np.float32, 0, s_place)
    master = make("packed", 13, np.float32, 1, DEV)
    dst = fresh_copy(master, d_place.memory_kind)

    def step(src, dst, src_ids, dst_ids):
        return copy_blocks(src, donation_copy(dst, master, d_place.memory_kind), src_ids, dst_ids)

    inputs = [(src, dst, list(range(k)), list(range(12, 12 - k, -1))) for k in (2, 5, 8)]
    jaxsync.check.assert_sync_free(step, src, dst, [0], [1], inputs=inputs)


def test_in_place_update_scales_with_blocks_not_cache():
    # Structural proof: the compiled copy aliases dst to the output and needs temporaries of the
    # bucket's size only (no full-cache copy), so device time follows the copied block count.
    src = make("packed", 64, np.float32, 0, DEV)
    dst = make("packed", 64, np.float32, 1, DEV)
    ids = jaxsync.upload_packed(
        {
            "src": np.zeros(8, np.int32),
            "dst": np.arange(8, dtype=np.int32),
        }  # fmt: skip
    )
    compiled = _copy_same_memory.lower(src, dst, ids).compile()
    mem = compiled.memory_analysis()
    cache_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(dst))
    block_bytes = 8 * dst["l0"][0].nbytes * len(LAYERS)
    assert mem.alias_size_in_bytes == cache_bytes
    assert mem.temp_size_in_bytes <= 4 * block_bytes < cache_bytes


@pytest.fixture(scope="module", params=[False, True], ids=["explicit", "auto"])
def mesh(request):
    return jaxsync.testing.device_mesh("h", auto=request.param)


COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")


@requires_torch  # its reference is torch
def test_sharded_over_heads_keeps_sharding_without_collectives(mesh):
    layout = KVLayout(kind="packed", num_blocks=12, block_size=4, num_kv_heads=8, head_dim=2,
                      dtype=jnp.float32)  # fmt: skip
    shard = NamedSharding(mesh, P(None, "h"))
    src = layout.random(LAYERS, jax.random.key(0), placement=shard)
    dst = layout.random(LAYERS, jax.random.key(1), placement=shard)
    expected = jax.tree.map(to_numpy, torch_copy_blocks(src, dst, [1, 2, 3], [9, 0, 4]))
    ids = jaxsync.upload_packed(
        {
            "src": np.zeros(8, np.int32),
            "dst": np.arange(12, 20, dtype=np.int32),
        },  # fmt: skip
        placement=NamedSharding(mesh, P()),
    )
    hlo = _copy_same_memory.lower(src, dst, ids).compile().as_text()
    assert not [c for c in COLLECTIVES if c in hlo]
    out = copy_blocks(src, dst, [1, 2, 3], [9, 0, 4])
    for leaf in jax.tree.leaves(out):
        assert leaf.sharding.is_equivalent_to(shard, leaf.ndim)
    assert_bits_equal(snapshot(out), expected)


# --- properties: few compiled shapes (one layout per dtype, buckets 8 and 16), many id sets ---

PROPS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(
    ids=block_id_pairs(),
    dtype=st.sampled_from(sorted(DTYPES)),
    seed=st.integers(0, 2**16),
)
def test_property_untouched_blocks_are_bit_identical(ids, dtype, seed):
    src_ids, dst_ids = ids
    src = make("packed", 13, DTYPES[dtype], seed, DEV)
    dst = make("packed", 13, DTYPES[dtype], seed + 1, DEV)
    before, src_host = snapshot(dst), snapshot(src)
    out = snapshot(copy_blocks(src, dst, src_ids, dst_ids))
    untouched = np.setdiff1d(np.arange(13), dst_ids)
    for name in LAYERS:
        assert_bits_equal(out[name][untouched], before[name][untouched])
        assert_bits_equal(out[name][dst_ids], src_host[name][src_ids])


@PROPS
@given(
    ids=block_id_pairs(),
    dtype=st.sampled_from(["bf16", "int8"]),
    seed=st.integers(0, 2**16),
)
def test_property_swap_out_and_back_restores(ids, dtype, seed):
    # device -> pinned host -> device: the blocks come back bit-identical.
    src_ids, host_ids = ids
    src_ids = list(dict.fromkeys(src_ids))  # the way back scatters into them: unique
    host_ids = host_ids[: len(src_ids)]
    src = make("mla", 13, DTYPES[dtype], seed, DEV)
    host = make("mla", 13, DTYPES[dtype], seed + 1, HOST)
    empty = make("mla", 13, DTYPES[dtype], seed + 2, DEV)
    expected = snapshot(src)
    host = copy_blocks(src, host, src_ids, host_ids)
    back = snapshot(copy_blocks(host, empty, host_ids, src_ids))
    for name in LAYERS:
        assert_bits_equal(back[name][src_ids], expected[name][src_ids])


@PROPS
@given(ids=block_id_pairs(), seed=st.integers(0, 2**16))
def test_property_copy_there_and_back_restores(ids, seed):
    src_ids, dst_ids = ids
    src_ids = list(dict.fromkeys(src_ids))
    dst_ids = dst_ids[: len(src_ids)]
    src = make("separate", 13, np.float16, seed, DEV)
    expected = snapshot(src)
    dst = copy_blocks(src, make("separate", 13, np.float16, seed + 1, DEV), src_ids, dst_ids)
    back = copy_blocks(dst, src, dst_ids, src_ids)  # overwrite the originals with their copies
    assert_bits_equal(snapshot(back), expected)
