"""HostPool swap_out / swap_in: torch parity, round trips, donation, bad input, sharding."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxsync.check
import jaxsync.testing
from jaxsync.harness.paths.kv.reference import as_numpy, host_random_cache
from jaxsync.kv import HostPool, KVLayout, host_pool, swap_in, swap_out
from jaxsync.kv._pool import _swap_in, _swap_out
from jaxsync.testing import block_id_pairs, donation_copy, fresh_copy, requires_torch


LAYERS = ("l0", "l1", "l2")
DEV = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
KINDS = {
    "packed": dict(kind="packed", num_kv_heads=2, head_dim=3),
    "separate": dict(kind="separate", num_kv_heads=2, head_dim=3),
    "mla": dict(kind="mla", latent_dim=5),
}
DTYPES = {"fp32": np.float32, "bf16": jnp.bfloat16, "fp16": np.float16, "int8": np.int8}


def make(kind="packed", num_blocks=13, dtype=np.float32, seed=0):
    layout = KVLayout(num_blocks=num_blocks, block_size=4, dtype=dtype, **KINDS[kind])
    return host_random_cache(layout, LAYERS, seed, DEV)


def leaves_np(cache):
    return [as_numpy(x) for x in jax.tree.leaves(cache)]


def bits(a):
    return np.asarray(a).view(np.uint8)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@requires_torch  # its reference is torch
def test_parity_with_torch_index_select(kind, dtype):
    import torch

    from jaxsync.harness.paths.kv.reference import to_torch

    cache = make(kind, 13, DTYPES[dtype], 0)
    src_ids, pool_ids, back_ids = [12, 0, 5, 5, 7], [3, 10, 0, 4, 9], [1, 2, 6, 8, 11]
    pool = swap_out(cache, host_pool(cache, 11), src_ids, pool_ids)
    got = as_numpy(pool.blocks)  # [11, L, ...]
    idx = torch.tensor(src_ids)
    for i, leaf in enumerate(jax.tree.leaves(cache)):
        want = to_torch(leaf).index_select(0, idx).float().numpy()
        np.testing.assert_array_equal(got[pool_ids, i].astype(np.float32), want)
    other = make(kind, 13, DTYPES[dtype], 1)
    before = leaves_np(other)
    out = swap_in(pool, other, pool_ids, back_ids)
    for i, (o, b) in enumerate(zip(leaves_np(out), before, strict=True)):
        want = b.copy()
        want[back_ids] = got[pool_ids, i]
        assert np.array_equal(bits(o), bits(want))
        assert jax.tree.leaves(out)[i].sharding.memory_kind == "device"
    assert pool.blocks.sharding.memory_kind == "pinned_host"


def test_donation_consumes_pool_and_cache_without_warning():
    cache = make()
    pool = host_pool(cache, 9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Some donated buffers were not usable" would raise
        new_pool = swap_out(cache, pool, [1, 2], [3, 4])
        other = make(seed=1)
        out = swap_in(new_pool, other, [3, 4], [0, 1])
    jax.block_until_ready(out)
    assert pool.blocks.is_deleted() and not new_pool.blocks.is_deleted()
    assert all(x.is_deleted() for x in jax.tree.leaves(other))
    assert not any(x.is_deleted() for x in jax.tree.leaves(cache))


def test_empty_ids_are_no_ops():
    cache = make()
    pool = host_pool(cache, 9)
    assert swap_out(cache, pool, [], []) is pool
    assert swap_in(pool, cache, [], []) is cache


BAD = [
    (dict(src_ids=[13], dst_ids=[0]), "src_ids must lie in"),  # pool 9 and cache 13 blocks
    (dict(src_ids=[0], dst_ids=[13]), "dst_ids must lie in"),
    (dict(src_ids=[-1], dst_ids=[0]), "src_ids must lie in"),
    (dict(src_ids=[0, 1], dst_ids=[2, 2]), "dst_ids must be unique"),
    (dict(src_ids=[0, 1], dst_ids=[2]), "has 2 ids but dst_ids has 1"),
    (dict(src_ids=[0.5], dst_ids=[1]), "src_ids must hold ints"),
    (dict(src_ids=[[0]], dst_ids=[[1]]), "1-D list of ints"),
]


@pytest.mark.parametrize("case", BAD, ids=[m for _, m in BAD])
def test_bad_ids_raise_before_dispatch(case):
    kwargs, message = case
    cache = make()
    pool = swap_out(cache, host_pool(cache, 9), [1, 2, 3], [0, 1, 2])
    before = leaves_np(cache), as_numpy(pool.blocks)
    error = TypeError if "must hold ints" in message else ValueError
    with pytest.raises(error, match=re.escape(message)):
        swap_out(cache, pool, **kwargs)
    with pytest.raises(error, match=re.escape(message)):
        swap_in(pool, cache, **kwargs)
    assert not pool.blocks.is_deleted()
    assert not any(x.is_deleted() for x in jax.tree.leaves(cache))
    assert all(
        np.array_equal(bits(a), bits(b)) for a, b in zip(leaves_np(cache), before[0], strict=True)
    )
    assert np.array_equal(bits(as_numpy(pool.blocks)), bits(before[1]))


def test_mismatched_pool_and_cache_raise():
    cache = make()
    pool = host_pool(cache, 9)
    with pytest.raises(ValueError, match="layers"):
        swap_out({"l0": cache["l0"], "l1": cache["l1"]}, pool, [0], [0])
    with pytest.raises(ValueError, match="differ from the cache"):
        swap_in(pool, make(dtype=np.float16), [0], [0])
    with pytest.raises(ValueError, match="one block shape and dtype"):
        host_pool(cache | {"l2": make("mla")["l2"]}, 9)
    with pytest.raises(ValueError, match="pinned host"):
        swap_out(cache, HostPool(jnp.zeros_like(pool.blocks, device=DEV), pool.treedef), [0], [0])
    host_cache = jax.device_put(cache, DEV.with_memory_kind("pinned_host"))
    with pytest.raises(ValueError, match="device memory"):
        swap_in(pool, host_cache, [0], [0])
    with pytest.raises(TypeError, match="HostPool"):
        swap_in(pool.blocks, cache, [0], [0])
    with pytest.raises(TypeError, match="host data"):
        swap_out(cache, pool, jnp.array([0]), [1])
    with pytest.raises(ValueError, match="positive"):
        host_pool(cache, 0)


def test_padded_equals_unpadded():
    cache = make()
    exact = swap_out(cache, host_pool(cache, 9), [4, 2, 9], [0, 7, 8], buckets=(3,))
    padded = swap_out(cache, host_pool(cache, 9), [4, 2, 9], [0, 7, 8])
    assert np.array_equal(bits(as_numpy(exact.blocks)), bits(as_numpy(padded.blocks)))
    a = swap_in(exact, make(seed=1), [0, 7, 8], [5, 6, 12], buckets=(3,))
    b = swap_in(exact, make(seed=1), [0, 7, 8], [5, 6, 12])
    assert all(
        np.array_equal(bits(x), bits(y)) for x, y in zip(leaves_np(a), leaves_np(b), strict=True)
    )


def test_sync_free_and_one_program_per_bucket():
    cache = make()
    pool = swap_out(cache, host_pool(cache, 13), list(range(13)), list(range(13)))
    master = HostPool(jax.device_put(pool.blocks, DEV), pool.treedef)  # on the device

    def out_step(cache, pool, s, d):  # swap_out donates the pool: a fresh copy per call
        return swap_out(cache, donation_copy(pool, master, "pinned_host"), s, d)

    def in_step(pool, cache, s, d):
        return swap_in(pool, fresh_copy(cache), s, d)

    counts = (2, 5, 8)
    jaxsync.check.assert_sync_free(
        out_step, cache, pool, [0], [1],
        inputs=[(cache, pool, list(range(k)), list(range(12, 12 - k, -1))) for k in counts],
    )  # fmt: skip
    jaxsync.check.assert_sync_free(
        in_step, pool, cache, [0], [1],
        inputs=[(pool, cache, list(range(k)), list(range(12, 12 - k, -1))) for k in counts],
    )  # fmt: skip


COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")


@pytest.mark.parametrize("auto", [False, True], ids=["explicit", "auto"])
def test_sharded_over_heads_keeps_sharding_without_collectives(auto):
    mesh = jaxsync.testing.device_mesh("h", auto=auto)
    layout = KVLayout(kind="packed", num_blocks=12, block_size=4, num_kv_heads=8, head_dim=2,
                      dtype=jnp.float32)  # fmt: skip
    shard = NamedSharding(mesh, P(None, "h"))
    cache = layout.random(LAYERS, jax.random.key(0), placement=shard)
    pool = host_pool(cache, 10)
    want = NamedSharding(mesh, P(None, None, "h"), memory_kind="pinned_host")
    assert pool.blocks.sharding.is_equivalent_to(want, 5)
    ids = jaxsync.upload_packed(
        {"src": np.zeros(8, np.int32), "dst": np.arange(8, dtype=np.int32)},
        placement=NamedSharding(mesh, P()),
    )
    leaves = jax.tree.leaves(cache)
    for fn, args in (
        (_swap_out, (leaves, pool.blocks, ids)),
        (_swap_in, (pool.blocks, leaves, ids)),
    ):
        hlo = fn.lower(*args).compile().as_text()
        assert not [c for c in COLLECTIVES if c in hlo], fn
    pool = swap_out(cache, pool, [1, 2, 3], [9, 0, 4])
    target = layout.random(LAYERS, jax.random.key(1), placement=shard)
    out = swap_in(pool, target, [9, 0, 4], [5, 6, 7])
    for name in LAYERS:
        assert out[name].sharding.is_equivalent_to(shard, 4)
        np.testing.assert_array_equal(np.asarray(out[name])[5:8], np.asarray(cache[name])[1:4])


# --- properties: one layout per dtype, buckets 8 and 16, many id sets ---

PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(
    ids=block_id_pairs(unique_src=True),
    dtype=st.sampled_from(sorted(DTYPES)),
    seed=st.integers(0, 2**16),
)
def test_property_round_trip_and_untouched_blocks(ids, dtype, seed):
    cache_ids, pool_ids = ids
    cache = make("separate", 13, DTYPES[dtype], seed)
    pool = swap_out(
        make("separate", 13, DTYPES[dtype], seed + 1),
        host_pool(cache, 13),
        list(range(13)),
        list(range(13)),
    )  # fmt: skip  (a pool of other blocks)
    pool_before = as_numpy(pool.blocks)
    pool = swap_out(cache, pool, cache_ids, pool_ids)
    pool_after = as_numpy(pool.blocks)
    untouched = np.setdiff1d(np.arange(13), pool_ids)
    assert np.array_equal(bits(pool_after[untouched]), bits(pool_before[untouched]))
    target = make("separate", 13, DTYPES[dtype], seed + 2)
    target_before = leaves_np(target)
    back = leaves_np(swap_in(pool, target, pool_ids, cache_ids))
    rest = np.setdiff1d(np.arange(13), cache_ids)
    for got, want, old in zip(back, leaves_np(cache), target_before, strict=True):
        assert np.array_equal(bits(got[cache_ids]), bits(want[cache_ids]))
        assert np.array_equal(bits(got[rest]), bits(old[rest]))


def test_fresh_copy_places_device_masters_and_refuses_pinned_sources():
    cache = make()
    host = fresh_copy(cache, "pinned_host")
    assert all(x.sharding.memory_kind == "pinned_host" for x in jax.tree.leaves(host))
    assert all(
        np.array_equal(bits(a), bits(b))
        for a, b in zip(leaves_np(host), leaves_np(cache), strict=True)
    )
    with pytest.raises(ValueError, match="from device memory only"):
        fresh_copy(host)
    with pytest.raises(ValueError, match="memory_kind must be"):
        fresh_copy(cache, "unpinned_host")


@pytest.mark.parametrize("size", [True, 2.0, np.float32(3), "4"])
def test_sizes_must_be_ints(size):
    # A bool would otherwise pass as a size of 1 (a 1-block pool or cache), a float fail late.
    cache = make()
    with pytest.raises(TypeError, match="num_blocks must be an int"):
        host_pool(cache, size)
    for field in ("num_blocks", "block_size", "head_dim"):
        with pytest.raises(TypeError, match=f"{field} must be an int"):
            KVLayout(**{"num_blocks": 5, "block_size": 4, **KINDS["packed"], field: size})
    assert host_pool(cache, np.int64(3)).num_blocks == 3
    assert (
        type(KVLayout(num_blocks=np.int32(5), block_size=4, latent_dim=2, kind="mla").num_blocks)
        is int
    )
