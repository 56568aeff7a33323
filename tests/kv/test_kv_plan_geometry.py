"""Plans carry the cache geometry they were made for: `write_slots` / `read_slots` / `copy_pairs`
given the uploaded plan refuse, while tracing, a cache of another block count, block size or
source, and a read plan used for a write. A plan's padding (-1) is no block of any cache, so even
its bare id arrays never write padding into a larger cache."""

import functools as ft

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsync
from jaxsync.check import SyncError, count_compiles, no_recompile, sync_guard
from jaxsync.kv import (
    KVLayout,
    PlanGeometryError,
    copy_pairs,
    plan_copy,
    plan_slots,
    read_slots,
    write_slots,
)


LAYERS = ("l0", "l1")


def cache(num_blocks, block_size=5, seed=0, stacked=False):
    layout = KVLayout(kind="packed", num_blocks=num_blocks, block_size=block_size,
                      num_kv_heads=2, head_dim=3, dtype=jnp.float32, stacked=stacked)  # fmt: skip
    return layout.random(LAYERS, jax.random.key(seed))


def host(tree):
    return [np.asarray(x).copy() for x in jax.tree.leaves(tree)]


@ft.partial(jax.jit, donate_argnums=0)
def copy_step(kv_cache, plan):
    return copy_pairs(kv_cache, plan)


@ft.partial(jax.jit, donate_argnums=1)
def copy_from_step(source, kv_cache, plan):
    return copy_pairs(kv_cache, plan, source=source)


@ft.partial(jax.jit, donate_argnums=0)
def write_step(kv_cache, rows, plan):
    return write_slots(kv_cache, rows, plan)


@jax.jit
def read_step(kv_cache, plan):
    return read_slots(kv_cache, plan)


def assert_refused_while_tracing(step, *args, match):
    """`step(*args)` raises PlanGeometryError before anything compiles; nothing is donated."""
    leaves = jax.tree.leaves(args)
    with count_compiles() as log, pytest.raises(PlanGeometryError, match=match):
        step(*args)
    assert (len(log.lowerings), len(log.compiles)) == (0, 0)  # refused while tracing
    assert not any(x.is_deleted() for x in leaves)


def test_a_copy_plan_for_8_blocks_is_refused_on_16():
    small, big = cache(8), cache(16, seed=1)
    plan = jaxsync.upload_packed(plan_copy(small, [0, 1, 2], [3, 4, 5]))
    assert_refused_while_tracing(copy_step, big, plan, match="blocks 8.*used with blocks 16")
    before = host(big)
    out = jax.jit(copy_pairs)(big, plan["src"], plan["dst"])  # bare ids: no check possible ...
    for got, old in zip(host(out), before, strict=True):  # ... but padding writes nothing
        np.testing.assert_array_equal(got[6:], old[6:])  # blocks 10-15 kept (not block 0)
        np.testing.assert_array_equal(got[3:6], old[0:3])
    copy_step(small, plan)  # control: the cache it was planned for


def test_a_copy_plan_for_another_source_is_refused():
    source, dst = cache(17, seed=2), cache(13, seed=3)
    plan = jaxsync.upload_packed(plan_copy(dst, [16], [3], source=source))
    assert_refused_while_tracing(copy_from_step, cache(13, seed=4), dst, plan, match="source")
    assert_refused_while_tracing(copy_step, dst, plan, match="source blocks 17")
    copy_from_step(source, dst, plan)  # control


def test_a_slot_plan_for_8_blocks_is_refused_on_16():
    small, big = cache(8), cache(16, seed=1)
    plan = jaxsync.upload_packed(plan_slots(small, [1, 2, 3]))
    rows = read_step(small, plan)
    assert_refused_while_tracing(write_step, big, rows, plan, match="blocks 8.*blocks 16")
    assert_refused_while_tracing(read_step, big, plan, match="blocks 8")
    before = host(big)
    out = jax.jit(write_slots)(big, rows, plan["slots"])  # bare: padding writes nothing
    for got, old in zip(host(out), before, strict=True):
        np.testing.assert_array_equal(got[1:], old[1:])  # slots 35-39 (block 7) kept
    write_step(small, rows, plan)  # control


def test_a_slot_plan_for_16_blocks_is_refused_on_8():
    small, big = cache(8), cache(16, seed=1)
    plan = jaxsync.upload_packed(plan_slots(big, [41, 70], write=False))  # past 8 blocks
    assert_refused_while_tracing(read_step, small, plan, match="blocks 16.*blocks 8")
    rows = read_step(big, plan)
    assert np.asarray(rows["l0"][:2]).any()  # control: real rows, not the zeros of padding


def test_another_block_size_and_a_read_plan_for_a_write_are_refused():
    kv_cache, wide = cache(8), cache(8, block_size=4, seed=1)
    plan = jaxsync.upload_packed(plan_slots(kv_cache, [1, 2]))
    rows = read_step(kv_cache, plan)
    assert_refused_while_tracing(read_step, wide, plan, match="block size 5.*block size 4")
    reads = jaxsync.upload_packed(plan_slots(kv_cache, [1, 1], write=False))
    assert_refused_while_tracing(write_step, kv_cache, rows, reads, match="unique slots")
    read_step(kv_cache, reads)  # control: a read plan reads; a write plan reads too
    read_step(kv_cache, plan)


def test_an_upload_without_geometry_is_refused():
    kv_cache = cache(8)
    fields = plan_slots(kv_cache, [1])
    bare = jaxsync.upload_packed({"slots": fields["slots"]})
    assert_refused_while_tracing(read_step, kv_cache, bare, match="no 'slots.geometry'")
    with pytest.raises(TypeError, match="plan alone"):
        copy_pairs(kv_cache, jaxsync.upload_packed(plan_copy(kv_cache, [1], [2])), jnp.zeros(8))


def test_plans_passed_whole_keep_the_proofs():
    kv_cache = cache(8, stacked=True)
    fields = {**plan_slots(kv_cache, [1, 2]), **plan_copy(kv_cache, [1], [4])}
    plan = jaxsync.upload_packed(fields)
    rows = read_step(kv_cache, plan)
    kv_cache = copy_step(write_step(kv_cache, rows, plan), plan)
    jax.block_until_ready(kv_cache)
    with no_recompile(), sync_guard("error"):
        for count in (3, 8):  # one bucket
            fields = {**plan_slots(kv_cache, range(count)), **plan_copy(kv_cache, [2], [count - 1])}
            plan = jaxsync.upload_packed(fields)
            kv_cache = copy_step(write_step(kv_cache, rows, plan), plan)
            read_step(kv_cache, plan)
    with pytest.raises(SyncError), sync_guard("error"):  # control: a readback is caught
        np.asarray(plan["slots"])
