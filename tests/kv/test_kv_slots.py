"""slot_mapping_for / extract_kv / inject_kv: upstream semantics, torch parity, properties."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxsync
import jaxsync.check
import jaxsync.testing
from jaxsync.harness.paths.kv.reference import (
    as_numpy,
    host_random_cache,
    to_numpy,
    torch_extract,
    torch_inject,
)
from jaxsync.kv import KVLayout, extract_kv, inject_kv, slot_mapping_for
from jaxsync.kv._slots import _extract, _inject
from jaxsync.testing import fresh_copy, requires_torch


LAYERS = ("a", "b")
KINDS = {
    "packed": dict(kind="packed", num_kv_heads=2, head_dim=3),
    "separate": dict(kind="separate", num_kv_heads=2, head_dim=3),
    "mla": dict(kind="mla", latent_dim=5),
}
NUM_BLOCKS, BS = 7, 4  # 28 slots


def make(kind, dtype, seed, placement=None):
    layout = KVLayout(num_blocks=NUM_BLOCKS, block_size=BS, dtype=dtype, **KINDS[kind])
    return host_random_cache(layout, LAYERS, seed, placement)


def bits(x):
    x = np.asarray(x)
    return x.view(np.uint8)


# --- slot_mapping_for -------------------------------------------------------------------------


def upstream_slot_mapping(block_ids, bs, n):
    """vLLM ReqMeta.make_meta, transcribed from vLLM's torch code."""
    import torch

    valid = (n - 1) // bs * bs
    ids = torch.tensor(block_ids)
    return (ids[:, None] * bs + torch.arange(bs)[None]).flatten()[:valid].numpy()


@pytest.mark.parametrize("n", [1, 3, 4, 5, 8, 9, 11, 12])
@requires_torch  # its reference is torch
def test_slot_mapping_matches_upstream(n):
    got = slot_mapping_for([5, 2, 6], BS, n)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, upstream_slot_mapping([5, 2, 6], BS, n))


@requires_torch  # its reference is torch
def test_slot_mapping_edge_cases():
    assert slot_mapping_for([5, 2], BS, 4).size == 0  # one full block keeps nothing
    assert slot_mapping_for([5, 2], BS, 8).tolist() == [20, 21, 22, 23]  # k*S keeps k-1 blocks
    # upstream gives valid = -S for n = 0: a negative slice end, i.e. garbage slots; we keep none
    assert upstream_slot_mapping([5, 2], BS, 0).tolist() == [20, 21, 22, 23]
    assert slot_mapping_for([5, 2], BS, 0).size == 0
    with pytest.raises(ValueError, match="keep 2 blocks but only 1"):
        slot_mapping_for([5], BS, 9)
    with pytest.raises(ValueError, match="must lie in"):
        slot_mapping_for([-2, 2], BS, 9)
    # a padded block-table entry gives padded tokens (vLLM's -1 slots)
    assert slot_mapping_for([-1, 2], BS, 9).tolist() == [-1] * BS + [8, 9, 10, 11]
    with pytest.raises(ValueError, match="block_size must be positive"):
        slot_mapping_for([1], 0, 9)
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        slot_mapping_for([1], BS, -1)


# --- extract / inject -------------------------------------------------------------------------

SLOTS = [27, 0, 5, 13, 14, 9, 22, 3, 1, 11]  # 10 slots -> bucket 16


@pytest.mark.parametrize("kind", ["packed", "separate", "mla"])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@requires_torch  # its reference is torch
def test_extract_and_inject_match_torch(kind, dtype):
    cache = make(kind, dtype, 0)
    rows = extract_kv(cache, SLOTS)
    for leaf, got in zip(jax.tree.leaves(cache), jax.tree.leaves(rows), strict=True):
        assert got.shape[0] == 16
        np.testing.assert_array_equal(bits(got[:10]), bits(to_numpy(torch_extract(leaf, SLOTS))))
        assert not np.asarray(as_numpy(got[10:]).astype(np.float32)).any()  # zero padding

    new_rows = extract_kv(make(kind, dtype, 1), SLOTS)
    expected = [
        to_numpy(torch_inject(leaf, as_numpy(r)[:10], SLOTS))
        for leaf, r in zip(jax.tree.leaves(cache), jax.tree.leaves(new_rows), strict=True)
    ]
    out = inject_kv(cache, new_rows, SLOTS)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(cache))
    for got, want in zip(jax.tree.leaves(out), expected, strict=True):
        np.testing.assert_array_equal(bits(got), bits(want))


def test_padded_equals_unpadded():
    cache = make("packed", np.float32, 0)
    exact, padded = extract_kv(cache, SLOTS, buckets=(10,)), extract_kv(cache, SLOTS)
    for e, p in zip(jax.tree.leaves(exact), jax.tree.leaves(padded), strict=True):
        np.testing.assert_array_equal(bits(e), bits(p[:10]))
    rows = extract_kv(make("packed", np.float32, 1), SLOTS, buckets=(10,))
    a = inject_kv(make("packed", np.float32, 0), rows, SLOTS, buckets=(10,))
    rows16 = jax.tree.map(lambda r: jnp.pad(r, ((0, 6), (0, 0), (0, 0)), constant_values=7.0), rows)
    b = inject_kv(make("packed", np.float32, 0), rows16, SLOTS)  # padding rows are dropped
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(bits(x), bits(y))


def test_bad_input_raises_before_dispatch():
    cache = make("packed", np.float32, 0)
    before = jax.tree.map(as_numpy, cache)
    rows = extract_kv(cache, SLOTS)
    for slots, msg in [([28], "must lie in"), ([-2], "must lie in"), ([[1]], "1-D list")]:
        with pytest.raises(ValueError, match=msg):
            extract_kv(cache, slots)
    cases = [
        (rows, SLOTS[:3] + [SLOTS[0]], "must be unique"),
        (rows, [28] + SLOTS[1:], "must lie in"),
        (jax.tree.map(lambda r: r[:10], rows), SLOTS, r"kv rows must be \(16, 2, 6\)"),
        (jax.tree.map(lambda r: r.astype(jnp.bfloat16), rows), SLOTS, "float32"),
        ({"a": rows["a"]}, SLOTS, "structure"),
    ]
    for kv, slots, msg in cases:
        with pytest.raises(ValueError, match=msg):
            inject_kv(cache, kv, slots)
    with pytest.raises(TypeError, match="jax.Arrays"):
        inject_kv(cache, jax.tree.map(as_numpy, rows), SLOTS)
    with pytest.raises(ValueError, match="attention"):
        extract_kv({"a": jnp.zeros((4, 4))}, [0])
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(cache))
    for x, y in zip(jax.tree.leaves(cache), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(bits(x), bits(y))


def test_sync_free_and_one_program_per_bucket():
    cache = make("packed", np.float32, 0)
    rows = extract_kv(cache, SLOTS)
    more = [(cache, SLOTS[:k]) for k in (9, 12, 16)]
    jaxsync.check.assert_sync_free(extract_kv, cache, SLOTS, inputs=more)

    def step(cache, rows, slots):  # inject donates the cache: give every call its own copy
        return inject_kv(fresh_copy(cache), rows, slots)

    more = [(cache, rows, SLOTS[:k]) for k in (9, 12)]
    jaxsync.check.assert_sync_free(step, cache, rows, SLOTS, inputs=more)


COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")


@pytest.mark.parametrize("kind", ["packed", "mla"])
@requires_torch  # its reference is torch
def test_sharded_keeps_sharding_without_collectives(kind):
    mesh = jaxsync.testing.device_mesh("h")
    dims = (
        dict(kind="packed", num_kv_heads=8, head_dim=2)
        if kind == "packed"
        else dict(kind="mla", latent_dim=8)
    )
    layout = KVLayout(num_blocks=NUM_BLOCKS, block_size=BS, dtype=jnp.float32, **dims)
    spec = P(None, "h") if kind == "packed" else P(None, None, "h")
    shard = NamedSharding(mesh, spec)
    cache = layout.random(LAYERS, jax.random.key(0), placement=shard)
    ids = jaxsync.upload_packed(
        {"slots": np.arange(16, dtype=np.int32)}, placement=NamedSharding(mesh, P())
    )
    rows = extract_kv(cache, SLOTS)
    for lowered in (_extract.lower(cache, ids), _inject.lower(cache, rows, ids)):
        hlo = lowered.compile().as_text()
        assert not [c for c in COLLECTIVES if c in hlo]
    want = P(None, "h") if kind == "packed" else P(None, "h")
    for leaf in jax.tree.leaves(rows):
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, want), leaf.ndim)
    expected = [to_numpy(torch_extract(leaf, SLOTS)) for leaf in jax.tree.leaves(cache)]
    out = inject_kv(cache, jax.tree.map(jnp.zeros_like, rows), SLOTS)
    for leaf, got_rows, want_rows in zip(
        jax.tree.leaves(out), jax.tree.leaves(rows), expected, strict=True
    ):
        assert leaf.sharding.is_equivalent_to(shard, leaf.ndim)
        np.testing.assert_array_equal(as_numpy(got_rows)[:10], want_rows)
        assert not to_numpy(torch_extract(leaf, SLOTS)).any()


# --- properties (fixed layouts and buckets 8/16; ids, dtypes and values vary) -----------------

PROPS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16, np.int8]


@PROPS
@given(
    slots=st.lists(st.integers(0, NUM_BLOCKS * BS - 1), min_size=1, max_size=16, unique=True),
    kind=st.sampled_from(["packed", "mla"]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_property_inject_then_extract_round_trips(slots, kind, dtype, seed):
    cache = make(kind, dtype, seed)
    before = as_numpy(cache["a"])
    rows = extract_kv(make(kind, dtype, seed + 1), slots)
    out = inject_kv(cache, rows, slots)
    back = extract_kv(out, slots)
    n = len(slots)
    for r, b in zip(jax.tree.leaves(rows), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(bits(as_numpy(r)[:n]), bits(as_numpy(b)[:n]))
    flat_before = (
        before.reshape(NUM_BLOCKS, -1, BS, before.shape[-1])
        if kind == "packed"
        else (before[:, None])
    )
    after = as_numpy(out["a"])
    flat_after = after.reshape(flat_before.shape)
    keep = np.ones((NUM_BLOCKS, BS), bool)
    keep[np.array(slots) // BS, np.array(slots) % BS] = False
    blocks, offsets = np.nonzero(keep)
    np.testing.assert_array_equal(  # slots not injected are bit-identical
        bits(flat_after[blocks, :, offsets]), bits(flat_before[blocks, :, offsets])
    )
