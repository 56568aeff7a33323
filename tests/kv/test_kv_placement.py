"""Caches placed unlike each other, and cache leaves slots cannot address: refused on the host
(or while tracing, for the pure functions) before anything is uploaded, or copied correctly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxsync
import jaxsync.testing
from jaxsync.kv import (
    KVLayout,
    copy_blocks,
    extract_kv,
    host_pool,
    inject_kv,
    plan_copy,
    read_slots,
    swap_in,
    swap_out,
    write_slots,
)
from jaxsync.testing import assert_refused, fresh_copy, kv_call


LAYERS = ("a", "b")
LAYOUT = KVLayout(kind="packed", num_blocks=9, block_size=4, num_kv_heads=8, head_dim=4,
                  dtype=jnp.float32)  # fmt: skip  # one kv head per simulated device
SRC, DST = [0, 1, 8], [3, 4, 0]


def bits(tree):
    return [np.asarray(x).copy() for x in jax.tree.leaves(tree)]


def caches(auto: bool):
    mesh = jaxsync.testing.device_mesh("h", auto=auto)
    heads = LAYOUT.random(LAYERS, jax.random.key(0), placement=NamedSharding(mesh, P(None, "h")))
    whole = LAYOUT.random(LAYERS, jax.random.key(1), placement=NamedSharding(mesh, P()))
    return heads, whole


@pytest.mark.parametrize("impl", ["xla", "kernel"])
@pytest.mark.parametrize("auto", [False, True], ids=["explicit", "auto"])
def test_differently_sharded_caches_are_refused_before_upload(impl, auto):
    # A block of a heads-sharded cache written into a replicated one (or the reverse): with
    # Explicit mesh axes tracing failed after the ids' upload; with Auto axes the result silently
    # took the source's sharding instead of the destination's (and a pool the cache's).
    heads, whole = caches(auto)
    for src, dst in ((heads, whole), (whole, heads)):
        for s_kind, d_kind in (("device", "device"), ("pinned_host", "device"),
                               ("device", "pinned_host")):  # fmt: skip
            s, d = fresh_copy(src, s_kind), fresh_copy(dst, d_kind)
            assert_refused(
                ValueError,
                "sharded differently",
                kv_call,
                copy_blocks,
                s,
                d,
                SRC,
                DST,
                impl=impl,
                keep=(s, d),
            )
        assert_refused(
            ValueError, "sharded differently", plan_copy, dst, SRC, DST, source=src, keep=()
        )
        pool = host_pool(src, 5)  # placed like `src`, not like `dst`
        d = fresh_copy(dst)
        assert_refused(
            ValueError, "not placed like", swap_out, d, pool, SRC, [0, 1, 2], keep=(d, pool.blocks)
        )
        assert_refused(ValueError, 
            "not placed like", kv_call, swap_in, pool, d, [0, 1, 2], DST, impl=impl,
            keep=(d, pool.blocks),
        )  # fmt: skip
    pool = host_pool(heads, 5)
    mixed = {"a": heads["a"], "b": whole["b"]}
    assert_refused(
        ValueError, "layers", swap_out, mixed, pool, SRC, [0, 1, 2], keep=(mixed, pool.blocks)
    )
    # Caches placed alike still copy, and keep their sharding.
    out = kv_call(copy_blocks, heads, fresh_copy(heads), SRC, DST, impl=impl)
    for o, x in zip(jax.tree.leaves(out), jax.tree.leaves(heads), strict=True):
        assert o.sharding.is_equivalent_to(x.sharding, x.ndim)
        np.testing.assert_array_equal(np.asarray(o)[DST], np.asarray(x)[SRC])


@pytest.mark.parametrize("auto", [False, True], ids=["explicit", "auto"])
def test_inject_refuses_rows_sharded_unlike_the_cache(auto):
    # Heads-sharded rows into a replicated cache: tracing failed after the upload (Explicit
    # axes), or the cache silently came back heads-sharded (Auto axes).
    heads, whole = caches(auto)
    slots = [1, 5, 35]
    rows = extract_kv(heads, slots)  # sharded over heads, as row_sharding cuts them
    dst = fresh_copy(whole)
    assert_refused(ValueError, "do not fit", inject_kv, dst, rows, slots, keep=(dst, rows))
    # Replicated rows fit any cache; rows cut from a cache fit its like. Both keep its sharding.
    target = jax.device_put(whole, jax.tree.map(lambda x: x.sharding, heads))
    replicated = jax.device_put(rows, NamedSharding(rows["a"].sharding.mesh, P()))
    for r in (replicated, rows):
        out = inject_kv(fresh_copy(target), r, slots)
        for o, x in zip(jax.tree.leaves(out), jax.tree.leaves(heads), strict=True):
            assert o.sharding.is_equivalent_to(x.sharding, x.ndim)
        got = np.asarray(out["a"])
        np.testing.assert_array_equal(got[[0, 1, 8], :, [1, 1, 3]], np.asarray(rows["a"])[:3])
        np.testing.assert_array_equal(got[2:8], np.asarray(whole["a"])[2:8])


def test_pure_slot_functions_refuse_leaves_without_a_token_axis():
    # A [P, X] leaf has no token axis second to last: slots would address the wrong rows.
    flat = {"a": jnp.arange(15, dtype=jnp.float32).reshape(5, 3)}
    slots = jnp.array([0, 4, 7], jnp.int32)
    with pytest.raises(ValueError, match="slot gathers need"):
        jax.jit(read_slots)(flat, slots)
    with pytest.raises(ValueError, match="slot gathers need"):
        jax.jit(write_slots)(flat, {"a": jnp.zeros((3, 3), jnp.float32)}, slots)
