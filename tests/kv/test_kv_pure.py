"""The pure kv functions a server calls inside its own jitted step (`write_slots`, `read_slots`,
`copy_pairs`, planned on the host by `plan_slots` / `plan_copy`): bit-exact with the entry
points, donated in place, one program per bucket, no transfer but the plan's one upload, and
jit arguments of a stacked-layout step independent of the layer count."""

import functools as ft
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsync
import jaxsync.testing
from jaxsync.check import RecompileError, SyncError, no_recompile, sync_guard
from jaxsync.kv import (
    KVLayout,
    copy_blocks,
    copy_pairs,
    extract_kv,
    inject_kv,
    plan_copy,
    plan_slots,
    read_slots,
    write_slots,
)
from jaxsync.testing import count_dispatch, fresh_copy, main_arg_count


KINDS = {
    "packed": dict(kind="packed", num_kv_heads=2, head_dim=3, dtype=jnp.bfloat16),
    "separate": dict(kind="separate", num_kv_heads=3, head_dim=4, dtype=jnp.float32),
    "mla": dict(kind="mla", latent_dim=5, dtype=jnp.float16),
}
LAYERS = ("l0", "l1", "l2")
NUM_BLOCKS, BLOCK = 13, 5  # primes: 65 slots


def cache(kind, stacked, seed, layers=LAYERS, num_blocks=NUM_BLOCKS):
    layout = KVLayout(num_blocks=num_blocks, block_size=BLOCK, stacked=stacked, **KINDS[kind])
    return layout.random(layers, jax.random.key(seed))


def bits(tree):
    return [np.asarray(x).view(np.uint8) for x in jax.tree.leaves(tree)]


def assert_bit_exact(got, want):
    for a, b in zip(bits(got), bits(want), strict=True):
        np.testing.assert_array_equal(a, b)


# A server's steps: the cache is donated, the ids come from the step's one packed upload.
@ft.partial(jax.jit, donate_argnums=0)
def write_step(kv_cache, rows, plan):
    return write_slots(kv_cache, rows, plan["slots"])


@jax.jit
def read_step(kv_cache, plan):
    return read_slots(kv_cache, plan["slots"])


@ft.partial(jax.jit, donate_argnums=0)
def copy_step(kv_cache, plan):
    return copy_pairs(kv_cache, plan["src"], plan["dst"])


@ft.partial(jax.jit, donate_argnums=1)
def copy_from_step(source, kv_cache, plan):
    return copy_pairs(kv_cache, plan["src"], plan["dst"], source=source)


def slots_of(count, seed):
    return np.random.default_rng(seed).choice(NUM_BLOCKS * BLOCK, count, replace=False)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("count", [1, 7, 13])  # buckets 8, 8, 16: padded rows in each
def test_slots_equal_the_entries(kind, stacked, count):
    src, dst = cache(kind, stacked, 0), cache(kind, stacked, 1)
    slots = slots_of(count, count)
    plan = jaxsync.upload_packed(plan_slots(src, slots, write=False))
    rows = read_step(src, plan)
    assert_bit_exact(rows, extract_kv(src, slots))
    before = fresh_copy(dst)
    want = inject_kv(fresh_copy(dst), rows, slots)
    plan = jaxsync.upload_packed(plan_slots(dst, slots))
    assert_bit_exact(write_step(dst, rows, plan), want)
    with pytest.raises(AssertionError):  # control: the comparison sees the written rows
        assert_bit_exact(before, want)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("pairs", [([3], [3]), ([3, 0, 12, 4, 7], [7, 2, 0, 3, 11])])
def test_copies_equal_the_entries(kind, stacked, pairs):
    # within one cache (blocks 3 / 7 / 0 both read and written: old contents copied out) and
    # from another cache
    src_ids, dst_ids = pairs
    kv_cache = cache(kind, stacked, 2)
    want = copy_blocks(*[fresh_copy(kv_cache)] * 2, src_ids, dst_ids)  # the entry's within-copy
    plan = jaxsync.upload_packed(plan_copy(kv_cache, src_ids, dst_ids))
    before = fresh_copy(kv_cache)
    assert_bit_exact(copy_step(kv_cache, plan), want)
    if src_ids != dst_ids:  # control: the comparison sees the copied blocks
        with pytest.raises(AssertionError):
            assert_bit_exact(before, want)
    source, dst = cache(kind, stacked, 3, num_blocks=17), cache(kind, stacked, 4)
    want = copy_blocks(source, fresh_copy(dst), src_ids, dst_ids, impl="xla")
    plan = jaxsync.upload_packed(plan_copy(dst, src_ids, dst_ids, source=source))
    assert_bit_exact(copy_from_step(source, dst, plan), want)


@pytest.mark.parametrize("stacked", [False, True])
def test_the_step_updates_the_donated_cache_in_place(stacked):
    kv_cache = cache("separate", stacked, 0)
    rows = read_step(kv_cache, jaxsync.upload_packed(plan_slots(kv_cache, [4, 9], write=False)))
    plan = jaxsync.upload_packed(plan_slots(kv_cache, [30, 31]))
    kept = fresh_copy(kv_cache)
    jax.jit(lambda c, r, p: write_slots(c, r, p["slots"]))(kept, rows, plan)
    assert not any(x.is_deleted() for x in jax.tree.leaves(kept))  # control: without donation
    out = write_step(kv_cache, rows, plan)
    assert all(x.is_deleted() for x in jax.tree.leaves(kv_cache))
    assert not any(x.is_deleted() for x in jax.tree.leaves(out))
    plan = jaxsync.upload_packed(plan_copy(out, [0], [1]))
    copy_step(out, plan)
    assert all(x.is_deleted() for x in jax.tree.leaves(out))


def test_one_program_per_bucket():
    kv_cache = cache("packed", True, 0)
    rows = read_step(kv_cache, jaxsync.upload_packed(plan_slots(kv_cache, [0], write=False)))
    kv_cache = write_step(kv_cache, rows, jaxsync.upload_packed(plan_slots(kv_cache, [1])))
    kv_cache = copy_step(kv_cache, jaxsync.upload_packed(plan_copy(kv_cache, [1], [2])))
    with no_recompile():
        for count in (2, 5, 8):  # every length of bucket 8
            slots = slots_of(count, count)
            kv_cache = write_step(
                kv_cache, rows, jaxsync.upload_packed(plan_slots(kv_cache, slots))
            )
            plan = plan_copy(kv_cache, list(range(count)), list(range(13 - count, 13)))
            kv_cache = copy_step(kv_cache, jaxsync.upload_packed(plan))
            read_step(kv_cache, jaxsync.upload_packed(plan_slots(kv_cache, slots, write=False)))
    with pytest.raises(RecompileError), no_recompile():  # control: a new bucket compiles
        read_step(kv_cache, jaxsync.upload_packed(plan_slots(kv_cache, range(40), write=False)))


def test_no_transfer_but_the_plans_one_upload():
    kv_cache = cache("mla", False, 0)
    rows = read_step(kv_cache, jaxsync.upload_packed(plan_slots(kv_cache, [0], write=False)))
    jax.block_until_ready(rows)

    def step(kv_cache, slots, src, dst):  # one request: write its rows, then a copy-on-write
        fields = {**plan_slots(kv_cache, slots), **plan_copy(kv_cache, src, dst)}
        plan = jaxsync.upload_packed(fields)
        with sync_guard("error"), jax.transfer_guard("disallow_explicit"):
            return copy_step(write_step(kv_cache, rows, plan), plan)

    kv_cache = step(kv_cache, [3, 7], [0], [1])
    with count_dispatch() as seen:
        kv_cache = step(kv_cache, [11, 2, 40], [1, 2], [5, 6])
    assert (seen.uploads, seen.compiles) == (1, 0)
    plan = jaxsync.upload_packed(plan_slots(kv_cache, [9]))
    with pytest.raises(Exception, match="host-to-device"), jax.transfer_guard("disallow"):
        write_step(kv_cache, rows, {"slots": plan_slots(kv_cache, [9])["slots"]})  # control
    slots = plan["slots"]
    with pytest.raises(SyncError), sync_guard("error"):  # control: a server reading ids back
        slots.tolist()


def _step_args(num_layers: int, stacked: bool) -> int:
    names = tuple(f"layer{i:02d}" for i in range(num_layers))
    kv_cache = cache("separate", stacked, 0, layers=names)
    slots = plan_slots(kv_cache, [1, 2, 3])
    plan = jaxsync.upload_packed({**slots, **plan_copy(kv_cache, [1], [4])})
    rows = read_step(kv_cache, plan)

    def step(kv_cache, rows, plan):  # write, copy and read back in one program
        kv_cache = write_slots(kv_cache, rows, plan["slots"])
        kv_cache = copy_pairs(kv_cache, plan["src"], plan["dst"])
        return kv_cache, read_slots(kv_cache, plan["slots"])

    return main_arg_count(jax.jit(step, donate_argnums=0).lower(kv_cache, rows, plan))


def test_stacked_step_arguments_do_not_grow_with_layers():
    counts = {(n, s): _step_args(n, s) for n in (4, 32) for s in (False, True)}
    assert counts[(4, True)] == counts[(32, True)] == 5, counts  # (k, v), rows (k, v), plan
    assert counts[(32, False)] > counts[(4, False)], counts  # control: per-layer grows


def test_bad_plans_are_refused_on_the_host_before_any_upload():
    kv_cache = cache("packed", False, 0)
    bad = [
        (lambda: plan_slots(kv_cache, [1.0, 2.0]), TypeError),
        (lambda: plan_slots(kv_cache, [True]), TypeError),
        (lambda: plan_slots(kv_cache, [65]), ValueError),  # P*S = 65
        (lambda: plan_slots(kv_cache, [-2]), ValueError),  # -1 alone is padding
        (lambda: plan_slots(kv_cache, [4, 4]), ValueError),  # a write repeats a slot
        (lambda: plan_copy(kv_cache, [1, 2], [3]), ValueError),
        (lambda: plan_copy(kv_cache, [1], [13]), ValueError),
        (lambda: plan_copy(kv_cache, [1, 2], [3, 3]), ValueError),
        (lambda: plan_copy(kv_cache, [np.float32(1)], [3]), TypeError),
        (lambda: plan_copy(kv_cache, [1], [2], source=cache("mla", False, 1)), ValueError),
    ]
    for call, error in bad:
        with count_dispatch() as seen, pytest.raises(error):
            call()
        assert (seen.uploads, seen.compiles) == (0, 0)
    plan_slots(kv_cache, [4, 4], write=False)  # control: reads may repeat a slot


def test_mismatched_rows_fail_while_tracing():
    kv_cache = cache("packed", False, 0)
    plan = jaxsync.upload_packed(plan_slots(kv_cache, [1, 2]))
    rows = read_step(kv_cache, plan)
    short = jax.tree.map(lambda r: r[:4], rows)
    with pytest.raises(ValueError, match=r"kv rows must be \(8, 2, 6\)"):
        write_step(kv_cache, short, plan)
    with pytest.raises(ValueError, match="kv rows must be"):
        write_step(kv_cache, jax.tree.map(lambda r: r.astype(jnp.float32), rows), plan)
    with pytest.raises(TypeError, match="integer"):
        jax.jit(write_slots)(kv_cache, rows, jnp.zeros(8))
    assert not any(x.is_deleted() for x in jax.tree.leaves(kv_cache))
    write_step(kv_cache, rows, plan)  # control: the right rows go in


def test_caches_sharded_over_kv_heads_stay_sharded():
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jaxsync.testing.device_mesh("h")
    heads = KVLayout(kind="packed", num_blocks=NUM_BLOCKS, block_size=BLOCK, num_kv_heads=8,
                     head_dim=4, dtype=jnp.float32, stacked=True)  # fmt: skip
    kv_cache = heads.random(LAYERS, jax.random.key(0), placement=NamedSharding(mesh, P(None, "h")))
    sharding = kv_cache.kv.sharding
    assert sharding.spec[2] == "h"  # [P, L, K, S, X]: split over kv heads
    near = jaxsync.replicated_near(kv_cache.kv)  # the plan goes where the cache is
    # control for the collective scan below: a program that needs every head on each device
    gathered = jax.jit(lambda c: c.kv, out_shardings=NamedSharding(mesh, P()))
    slots = [3, 60, 17, 22, 41]
    rows = read_step(kv_cache, jaxsync.upload_packed(plan_slots(kv_cache, slots), placement=near))
    assert_bit_exact(rows, extract_kv(kv_cache, slots))
    want = inject_kv(fresh_copy(kv_cache), rows, [0, 1, 2, 3, 4])
    plan = plan_slots(kv_cache, [0, 1, 2, 3, 4])
    plan = jaxsync.upload_packed(plan, placement=near)
    got = write_step(kv_cache, rows, plan)
    assert got.kv.sharding.is_equivalent_to(sharding, 5)
    assert_bit_exact(got, want)
    pairs = jaxsync.upload_packed(plan_copy(got, [0, 5], [5, 9]), placement=near)
    steps = ((read_step, (got, plan)), (write_step, (got, rows, plan)), (copy_step, (got, pairs)))
    for step, args in steps:
        hlo = step.lower(*args).compile().as_text()
        assert not re.search(r"all-gather|all-reduce|all-to-all|collective-permute", hlo)
    assert re.search("all-gather", gathered.lower(got).compile().as_text())  # control
    want = copy_blocks(*[fresh_copy(got)] * 2, [0, 5], [5, 9])
    got = copy_step(got, pairs)
    assert got.kv.sharding.is_equivalent_to(sharding, 5)
    assert_bit_exact(got, want)
