"""Registers the kv paths for `jaxsync verify` (and, through `bench`, for `jaxsync bench`).

Every case uses a tiny random cache built in-process (no checkpoint). The entry points donate their
destination cache, while `verify` calls a path several times with the same arguments, so each
registered callable first makes its own (asynchronous, device-side) copy of the destination.
Parity compares bit patterns with the PyTorch reference in `reference` (metric "mismatches").
"""

from __future__ import annotations

import functools
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import jaxsync.harness.paths.kv.bench  # noqa: F401  (registers the "kv" bench family)
from jaxsync.harness.registry import Parity, PathCase, register_path
from jaxsync.kv import (
    HostPool,
    KVLayout,
    copy_blocks,
    extract_kv,
    host_pool,
    inject_kv,
    load_kv,
    save_kv,
    slot_mapping_for,
    swap_in,
    swap_out,
)
from jaxsync.testing import donation_copy, fresh_copy


_LAYERS = ("l0", "l1", "l2")
_LAYOUT = KVLayout(kind="packed", num_blocks=13, block_size=4, num_kv_heads=2, head_dim=3,
                   dtype=jnp.bfloat16)  # fmt: skip
# Power-of-two block dims for the copy and HostPool paths: on a GPU their defaults are Pallas
# kernels (d2d copy; h2d reading the pinned caches or pool directly), and verify must prove
# what runs. The odd shapes (head_dim 3) stay for the slot paths and in the tests.
_KERNEL_LAYOUT = KVLayout(kind="packed", num_blocks=13, block_size=4, num_kv_heads=2, head_dim=4,
                        dtype=jnp.bfloat16)  # fmt: skip
_MLA = KVLayout(kind="mla", num_blocks=13, block_size=4, latent_dim=7, dtype=jnp.bfloat16)
_IDS = [([12, 0, 5], [3, 10, 0]), ([1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5, 6, 7]), ([9], [9])]
_SLOTS = [
    [51, 0, 5, 13, 14, 9, 22, 3, 1, 11],
    [7, 8, 9, 10, 11, 12, 13, 14, 15],
    list(range(40, 52)),
]


def _placement(kind: str) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)


def _mismatches(actual, expected) -> int:
    from jaxsync.harness.paths.kv.reference import as_numpy, to_numpy

    bad = 0
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = as_numpy(a), to_numpy(e) if not isinstance(e, np.ndarray) else e
        bad += int(np.sum(a.view(np.uint16) != e.view(np.uint16)))
    return bad


def _copy_case(src_kind: str, dst_kind: str) -> PathCase:
    src = _KERNEL_LAYOUT.random(_LAYERS, jax.random.key(0), placement=_placement(src_kind))
    # Each call gets a fresh destination copied from a device-resident master (see
    # `fresh_copy` for why not from the pinned-host array).
    master = _KERNEL_LAYOUT.random(_LAYERS, jax.random.key(1), placement=_placement("device"))
    dst = fresh_copy(master, dst_kind)

    def step(src, dst, src_ids, dst_ids):
        return copy_blocks(src, donation_copy(dst, master, dst_kind), src_ids, dst_ids)

    def parity() -> Parity:
        from jaxsync.harness.paths.kv.reference import torch_copy_blocks

        bad = 0
        for s_ids, d_ids in _IDS:
            expected = torch_copy_blocks(src, dst, s_ids, d_ids)
            bad += _mismatches(step(src, dst, s_ids, d_ids), expected)
        return Parity(bad, 0, "mismatches", "torch index_select + index_copy_, 3 id sets")

    def make_inputs(bucket: int):  # `bucket` ids (capped at the cache size, still in the bucket)
        n = min(bucket, _KERNEL_LAYOUT.num_blocks)
        return (src, dst, list(range(n)), list(range(n))[::-1])

    return PathCase(
        step, [(src, dst, s, d) for s, d in _IDS], parity, make_inputs=make_inputs, buckets=(8, 16)
    )


@register_path(
    "kv.copy_blocks",
    "paged KV block copy, device -> device, all layers in one call",
    checkpoints=False,
)
def _build_copy(checkpoint: str | None) -> PathCase:
    return _copy_case("device", "device")


@register_path("kv.swap_out", "paged KV block copy, device -> pinned host", checkpoints=False)
def _build_swap_out(checkpoint: str | None) -> PathCase:
    return _copy_case("device", "pinned_host")


@register_path("kv.swap_in", "paged KV block copy, pinned host -> device", checkpoints=False)
def _build_swap_in(checkpoint: str | None) -> PathCase:
    return _copy_case("pinned_host", "device")


def _pool_parity(step, leaf_of, layout_name: str) -> Parity:
    """Bit mismatches of `step(ids)` against torch index_select per leaf (`leaf_of` picks the
    checked blocks of leaf i out of the result)."""
    import torch

    from jaxsync.harness.paths.kv.reference import to_torch

    bad = 0
    for s_ids, d_ids in _IDS:
        out = step(s_ids, d_ids)
        for i, leaf in enumerate(jax.tree.leaves(_pool_src())):
            want = to_torch(leaf).index_select(0, torch.tensor(s_ids)).float().numpy()
            got = np.asarray(leaf_of(out, i, d_ids)).astype(np.float32)
            bad += int(np.sum(got.view(np.uint32) != want.view(np.uint32)))
    return Parity(bad, 0, "mismatches", f"torch index_select per layer, {layout_name}")


@functools.cache
def _pool_src():
    return _KERNEL_LAYOUT.random(_LAYERS, jax.random.key(4), placement=_placement("device"))


@register_path(
    "kv.swap_out_pool", "device cache -> block-major pinned-host HostPool", checkpoints=False
)
def _build_pool_out(checkpoint: str | None) -> PathCase:
    from jaxsync.harness.paths.kv.reference import as_numpy

    src = _pool_src()
    pool = host_pool(src, 13)
    master = HostPool(jax.device_put(pool.blocks, _placement("device")), pool.treedef)

    def step(cache, pool, src_ids, dst_ids):  # the pool is donated: a fresh copy per call
        return swap_out(cache, donation_copy(pool, master, "pinned_host"), src_ids, dst_ids)

    def parity() -> Parity:
        return _pool_parity(
            lambda s, d: step(src, pool, s, d),
            lambda out, i, d: as_numpy(out.blocks)[d, i],
            "3 id sets",
        )

    return PathCase(step, [(src, pool, s, d) for s, d in _IDS], parity, buckets=(8, 16),
                    make_inputs=lambda b: (src, pool, list(range(min(b, 13))),
                                           list(range(min(b, 13)))[::-1]))  # fmt: skip


@register_path(
    "kv.swap_in_pool", "block-major pinned-host HostPool -> device cache", checkpoints=False
)
def _build_pool_in(checkpoint: str | None) -> PathCase:
    n = _KERNEL_LAYOUT.num_blocks
    src = _pool_src()
    pool = swap_out(src, host_pool(src, n), list(range(n)), list(range(n)))
    target = _KERNEL_LAYOUT.random(_LAYERS, jax.random.key(5), placement=_placement("device"))

    def step(pool, cache, src_ids, dst_ids):
        return swap_in(pool, fresh_copy(cache), src_ids, dst_ids)

    def parity() -> Parity:
        return _pool_parity(
            lambda s, d: step(pool, target, s, d),
            lambda out, i, d: jax.tree.leaves(out)[i][np.asarray(d)],
            "pool holds block b of every layer at b",
        )

    return PathCase(step, [(pool, target, s, d) for s, d in _IDS], parity, buckets=(8, 16),
                    make_inputs=lambda b: (pool, target, list(range(min(b, n))),
                                           list(range(min(b, n)))[::-1]))  # fmt: skip


@register_path(
    "kv.extract_kv", "per-token KV rows at a slot mapping (packed + MLA layers)", checkpoints=False
)
def _build_extract(checkpoint: str | None) -> PathCase:
    cache = _LAYOUT.random(_LAYERS, jax.random.key(0)) | {
        "mla": _MLA.random(["m"], jax.random.key(1))["m"]
    }

    def parity() -> Parity:
        from jaxsync.harness.paths.kv.reference import torch_extract

        bad = 0
        for slots in _SLOTS:
            rows = extract_kv(cache, slots)
            for name in cache:
                got = rows[name][: len(slots)]
                bad += _mismatches(got, torch_extract(cache[name], slots))
        return Parity(bad, 0, "mismatches", "torch advanced indexing (ExampleConnector)")

    return PathCase(extract_kv, [(cache, s) for s in _SLOTS], parity)


@register_path(
    "kv.inject_kv",
    "write per-token KV rows at a slot mapping (packed + MLA layers)",
    checkpoints=False,
)
def _build_inject(checkpoint: str | None) -> PathCase:
    cache = _LAYOUT.random(_LAYERS, jax.random.key(0)) | {
        "mla": _MLA.random(["m"], jax.random.key(1))["m"]
    }
    donor = _LAYOUT.random(_LAYERS, jax.random.key(2)) | {
        "mla": _MLA.random(["m"], jax.random.key(3))["m"]
    }
    rows = extract_kv(donor, _SLOTS[0])  # bucket 16, shared by all three slot lists

    def step(cache, rows, slots):
        return inject_kv(fresh_copy(cache), rows, slots)

    def parity() -> Parity:
        from jaxsync.harness.paths.kv.reference import as_numpy, torch_inject

        bad = 0
        for slots in _SLOTS:
            out = step(cache, rows, slots)
            for name in cache:
                want = torch_inject(cache[name], as_numpy(rows[name])[: len(slots)], slots)
                bad += _mismatches(out[name], want)
        return Parity(bad, 0, "mismatches", "torch advanced-index assignment (ExampleConnector)")

    return PathCase(step, [(cache, rows, s) for s in _SLOTS], parity)


@register_path(
    "kv.load_kv", "safetensors per layer -> cache's own placement, no wait", checkpoints=False
)
def _build_load(checkpoint: str | None) -> PathCase:
    root = tempfile.mkdtemp(prefix="jaxsync-kv-")
    cache = _LAYOUT.random(_LAYERS, jax.random.key(0))
    target = _LAYOUT.random(_LAYERS, jax.random.key(1))
    requests = [(list(range(100, 111)), [6, 2, 8]), (list(range(7, 17)), [3, 4, 7])]
    for tokens, blocks in requests:
        save_kv(root, cache, tokens, blocks)

    def step(root, caches, tokens, blocks):
        return load_kv(root, fresh_copy(caches), tokens, blocks)

    def parity() -> Parity:
        from jaxsync.harness.paths.kv.reference import torch_extract

        bad = 0
        for (tokens, saved_blocks), new_blocks in zip(
            requests, ([0, 5, 1], [9, 10, 11]), strict=True
        ):
            out = step(root, target, tokens, new_blocks)
            new_slots = slot_mapping_for(new_blocks, 4, len(tokens))
            old_slots = slot_mapping_for(saved_blocks, 4, len(tokens))
            for name in cache:
                got = extract_kv(out, new_slots)[name][: new_slots.size]
                bad += _mismatches(got, torch_extract(cache[name], old_slots))
        return Parity(bad, 0, "mismatches", "save -> load at other blocks vs torch gather")

    inputs = [(root, target, tokens, [0, 5, 1]) for tokens, _ in requests]
    return PathCase(step, inputs, parity)
