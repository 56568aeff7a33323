"""kv entry points with their ids staged in pinned host memory (`_layout.ID_STAGING`): the same
bits as the default device upload, and still sync-free."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsync.check
from jaxsync.kv import (
    KVLayout,
    _layout,
    copy_blocks,
    extract_kv,
    host_pool,
    inject_kv,
    swap_in,
    swap_out,
)
from jaxsync.kv._layout import fresh_copy
from jaxsync.kv._reference import as_numpy, host_random_cache


LAYERS = ("l0", "l1")
DEV = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
HOST = DEV.with_memory_kind("pinned_host")
LAYOUT = KVLayout(kind="packed", num_blocks=13, block_size=4, num_kv_heads=2, head_dim=4,
                  dtype=jnp.bfloat16)  # fmt: skip


def bits(tree):
    return [np.asarray(as_numpy(x)).view(np.uint8) for x in jax.tree.leaves(tree)]


def run_all():
    """Every kv entry point that uploads ids, on fixed inputs; their outputs' bits."""
    src = host_random_cache(LAYOUT, LAYERS, 0, DEV)
    out = []
    for impl in ("xla", "pallas_interpret"):
        dst = host_random_cache(LAYOUT, LAYERS, 1, DEV)
        out += bits(copy_blocks(src, dst, [3, 0, 12], [7, 2, 0], impl=impl))
    out += bits(copy_blocks(src, fresh_copy(src, "pinned_host"), [1, 4], [5, 6]))  # d2h
    host_src = fresh_copy(host_random_cache(LAYOUT, LAYERS, 2, DEV), "pinned_host")
    out += bits(copy_blocks(host_src, host_random_cache(LAYOUT, LAYERS, 3, DEV), [9], [4]))  # h2d
    pool = swap_out(src, host_pool(src, 11), [2, 5, 7], [10, 0, 3])
    for impl in ("xla", "pallas_interpret"):
        out += bits(swap_in(pool, host_random_cache(LAYOUT, LAYERS, 4, DEV), [10, 0], [1, 2],
                            impl=impl))  # fmt: skip
    slots = [5, 0, 17, 30]
    rows = extract_kv(src, slots)
    out += bits(rows)
    out += bits(inject_kv(host_random_cache(LAYOUT, LAYERS, 5, DEV), rows, [1, 2, 40, 51]))
    return out


def test_pinned_id_staging_gives_the_same_bits(monkeypatch):
    want = run_all()
    monkeypatch.setattr(_layout, "ID_STAGING", "pinned_host")
    got = run_all()
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert np.array_equal(a, b)


def test_pinned_id_staging_is_sync_free_in_one_program_per_bucket(monkeypatch):
    monkeypatch.setattr(_layout, "ID_STAGING", "pinned_host")
    src = host_random_cache(LAYOUT, LAYERS, 0, DEV)
    master = host_random_cache(LAYOUT, LAYERS, 1, DEV)

    def step(src, dst, src_ids, dst_ids):  # copy_blocks donates dst: a fresh copy per call
        return copy_blocks(src, fresh_copy(dst), src_ids, dst_ids)

    inputs = [(src, master, list(range(k)), list(range(12, 12 - k, -1))) for k in (2, 5, 8)]
    jaxsync.check.assert_sync_free(step, src, master, [0], [1], inputs=inputs)


def test_unknown_staging_raises_before_dispatch(monkeypatch):
    monkeypatch.setattr(_layout, "ID_STAGING", "unpinned_host")
    src = host_random_cache(LAYOUT, LAYERS, 0, DEV)
    dst = host_random_cache(LAYOUT, LAYERS, 1, DEV)
    with pytest.raises(ValueError, match="staging"):
        copy_blocks(src, dst, [0], [1])
    assert not any(x.is_deleted() for x in jax.tree.leaves(dst))
