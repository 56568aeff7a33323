"""fp8 caches with k/v scales: quantizing writes (`reshape_and_cache_flash`,
`concat_and_cache_mla`) and dequantizing reads, bit for bit against torch references of vLLM's
semantics (float32 `x / scale`, saturated, nearest-even cast; `float32(q) * scale` back), per
tensor and per kv head, with padded tokens; scales that never leave the device; copies, swaps and
files that carry the fp8 bytes unchanged; scales that do not fit refused before any upload."""

import functools as ft

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsync
import jaxsync.check
from jaxsync.check import no_recompile, sync_guard
from jaxsync.harness.paths.kv.reference import as_numpy, host_random_cache, to_numpy
from jaxsync.kv import (
    KVLayout,
    KVScales,
    StackedCache,
    concat_and_cache_mla,
    copy_blocks,
    extract_kv,
    host_pool,
    inject_kv,
    load_kv,
    plan_slots,
    read_slots,
    save_kv,
    swap_in,
    swap_out,
    write_slots,
)
from jaxsync.testing import assert_refused, fresh_copy, requires_torch


FP8 = [jnp.float8_e4m3fn, jnp.float8_e5m2]
HEADS, HEAD_SIZE, BLOCK, BLOCKS = 4, 16, 8, 10


def bits(x):
    return np.asarray(x).view(np.uint8)


def fp8_cache(kind, dtype, seed=0, stacked=False, layers=("l",)):
    dims = dict(latent_dim=48) if kind == "mla" else dict(num_kv_heads=HEADS, head_dim=HEAD_SIZE)
    layout = KVLayout(kind=kind, num_blocks=BLOCKS, block_size=BLOCK, dtype=dtype,
                      stacked=stacked, **dims)  # fmt: skip
    if stacked:
        return layout.random(layers, jax.random.key(seed))
    return host_random_cache(layout, layers, seed)


def tokens(n, seed, shape, big=True):
    """vLLM's test rows (normal), a few far beyond the fp8 range (saturation)."""
    x = np.random.default_rng(seed).standard_normal((n, *shape)).astype(np.float32)
    if big:
        x[2] *= 1e5  # a real token (slot 17)
    return x


def scales_of(key, value, per_head, k_range=64):
    """vLLM's test scales: amax / 64, per tensor or per kv head; a larger `k_range` makes k's
    largest rows saturate."""
    axis = (0, 2) if per_head else None
    return KVScales(
        jnp.asarray(np.max(key, axis=axis) / k_range, jnp.float32),
        jnp.asarray(np.max(value, axis=axis) / 64, jnp.float32),
    )


SLOTS = np.array([5, -1, 17, 40, 63, -1, 2, 79, 33], np.int64)  # padded tokens included


@ft.partial(jax.jit, donate_argnums=0)
def write_step(cache, rows, plan, scales):
    return write_slots(cache, rows, plan, scales=scales)


@ft.partial(jax.jit, static_argnums=3)
def read_step(cache, plan, scales, dtype):
    return read_slots(cache, plan, scales=scales, dtype=dtype)


def padded(x, size=16):
    return jnp.asarray(np.pad(x, ((0, size - len(x)),) + ((0, 0),) * (x.ndim - 1)))


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("compute", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("k_range", [64, 1e6], ids=["in_range", "saturating"])
@requires_torch  # its reference is torch
def test_reshape_and_cache_quantizes_as_vllm(fp8, per_head, compute, k_range):
    from jaxsync.harness.paths.kv.reference_cache_ops import torch_gather, torch_reshape_and_cache

    cache = fp8_cache("separate", fp8)
    key = tokens(len(SLOTS), 1, (HEADS, HEAD_SIZE)).astype(compute)
    value = tokens(len(SLOTS), 2, (HEADS, HEAD_SIZE)).astype(compute)
    key32, value32 = np.asarray(key, np.float32), np.asarray(value, np.float32)
    scales = scales_of(key32, value32, per_head, k_range)
    want = torch_reshape_and_cache(*cache["l"], key, value, SLOTS, scales.k, scales.v)
    rows = {"l": (padded(key), padded(value))}
    got = inject_kv(fresh_copy(cache), rows, SLOTS, scales=scales)
    plan = jaxsync.upload_packed(plan_slots(cache, SLOTS))
    in_step = write_step(fresh_copy(cache), rows, plan, scales)
    for out in (got, in_step):
        for leaf, ref in zip(out["l"], want, strict=True):
            np.testing.assert_array_equal(bits(leaf), bits(to_numpy(ref)))
    stored = np.asarray(got["l"][0], np.float32)
    assert np.isfinite(stored).all()  # saturated, never inf / nan
    if k_range > 64:  # control: some rows really hit the fp8 maximum
        assert (np.abs(stored) == float(jnp.finfo(fp8).max)).any()
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):  # the dequantizing read
        rows = extract_kv(got, SLOTS, scales=scales, dtype=dtype)
        again = read_step(got, plan, scales, dtype)
        for i, scale in enumerate((scales.k, scales.v)):
            ref = to_numpy(torch_gather(got["l"][i], SLOTS, scale, _torch_dtype(dtype)))
            np.testing.assert_array_equal(bits(rows["l"][i][: len(SLOTS)]), bits(ref))
            np.testing.assert_array_equal(bits(again["l"][i][: len(SLOTS)]), bits(ref))


def _torch_dtype(dtype):
    import torch

    return {jnp.bfloat16: torch.bfloat16, jnp.float16: torch.float16}.get(dtype, torch.float32)


@pytest.mark.parametrize("per_head", [False, True])
@requires_torch  # its reference is torch
def test_packed_layout_takes_k_and_v_scales_on_its_halves(per_head):
    from jaxsync.harness.paths.kv.reference_cache_ops import torch_reshape_and_cache

    cache = fp8_cache("packed", jnp.float8_e4m3fn)
    key = tokens(len(SLOTS), 3, (HEADS, HEAD_SIZE))
    value = tokens(len(SLOTS), 4, (HEADS, HEAD_SIZE), big=False) * 7
    scales = scales_of(key, value, per_head)
    leaf = np.asarray(cache["l"])
    halves = (leaf[..., :HEAD_SIZE], leaf[..., HEAD_SIZE:])
    want_k, want_v = torch_reshape_and_cache(*halves, key, value, SLOTS, scales.k, scales.v)
    want = np.concatenate([to_numpy(want_k), to_numpy(want_v)], axis=-1)
    got = inject_kv(cache, {"l": padded(np.concatenate([key, value], -1))}, SLOTS, scales=scales)
    np.testing.assert_array_equal(bits(got["l"]), bits(want))


@pytest.mark.parametrize("fp8", FP8)
@requires_torch  # its reference is torch
def test_concat_and_cache_mla_quantizes_with_one_scale(fp8):
    from jaxsync.harness.paths.kv.reference_cache_ops import torch_concat_and_cache_mla

    cache = fp8_cache("mla", fp8)
    kv_c, k_pe = tokens(len(SLOTS), 5, (32,)), tokens(len(SLOTS), 6, (16,), big=False)
    scale = jnp.asarray(0.1, jnp.float32)  # vLLM's test scale
    want = torch_concat_and_cache_mla(cache["l"], kv_c, k_pe, SLOTS, scale)
    plan = jaxsync.upload_packed(plan_slots(cache, SLOTS))
    step = jax.jit(ft.partial(concat_and_cache_mla, scales=KVScales(scale)))
    got = step(fresh_copy(cache), {"l": padded(kv_c)}, {"l": padded(k_pe)}, plan)
    np.testing.assert_array_equal(bits(got["l"]), bits(to_numpy(want)))


def test_scales_stay_on_the_device_and_new_values_do_not_compile():
    cache = fp8_cache("separate", jnp.float8_e4m3fn, stacked=True, layers=("a", "b"))
    plan = jaxsync.upload_packed(plan_slots(cache, [3, 9]))
    rows = read_step(cache, plan, KVScales(jnp.float32(1), jnp.float32(1)), jnp.bfloat16)
    scales = [KVScales(jnp.asarray(s, jnp.float32), jnp.full((HEADS,), s, jnp.float32))
              for s in (0.5, 2.0, 3.0)]  # fmt: skip
    cache = write_step(cache, rows, plan, scales[0])
    read_step(cache, plan, scales[0], jnp.bfloat16)
    jax.block_until_ready(cache)
    with no_recompile(), sync_guard("error"), jax.transfer_guard("disallow"):
        for s in scales[1:]:
            cache = write_step(cache, rows, plan, s)
            read_step(cache, plan, s, jnp.bfloat16)


@pytest.mark.parametrize("kind", ["packed", "separate", "mla"])
def test_copies_swaps_and_files_carry_fp8_bytes_unchanged(kind, tmp_path):
    src, dst = fp8_cache(kind, jnp.float8_e4m3fn, 1), fp8_cache(kind, jnp.float8_e5m2, 2)
    src5 = fp8_cache(kind, jnp.float8_e5m2, 3)
    ids = ([0, 4, 7], [2, 3, 9])
    want = [bits(x)[ids[0]] for x in jax.tree.leaves(src5)]
    pinned = jax.tree.map(
        lambda x: jax.device_put(x, x.sharding.with_memory_kind("pinned_host")), dst
    )
    for out in (copy_blocks(src5, fresh_copy(dst), *ids), copy_blocks(src5, pinned, *ids)):
        for got, w in zip(jax.tree.leaves(out), want, strict=True):
            np.testing.assert_array_equal(bits(as_numpy(got))[ids[1]], w)
    pool = swap_out(src, host_pool(src, 12), *ids)
    back = swap_in(pool, fp8_cache(kind, jnp.float8_e4m3fn, 4), ids[1], ids[0])
    for got, w in zip(jax.tree.leaves(back), jax.tree.leaves(src), strict=True):
        np.testing.assert_array_equal(bits(got)[ids[0]], bits(w)[ids[0]])
    save_kv(tmp_path, src, list(range(17)), [3, 1])
    loaded = load_kv(tmp_path, fresh_copy(src), list(range(17)), [6, 8])
    for got, w in zip(jax.tree.leaves(loaded), jax.tree.leaves(src), strict=True):
        np.testing.assert_array_equal(bits(got)[[6, 8]], bits(w)[[3, 1]])


def test_scales_that_do_not_fit_are_refused_before_any_upload():
    cache = fp8_cache("separate", jnp.float8_e4m3fn)
    mla = fp8_cache("mla", jnp.float8_e4m3fn)
    plain = host_random_cache(KVLayout(kind="mla", num_blocks=4, block_size=4, latent_dim=8,
                                       dtype=jnp.bfloat16), ["l"], 0)  # fmt: skip
    one = jnp.float32(1)
    rows = extract_kv(cache, [1])
    bad = [
        (TypeError, "jax.Array", cache, KVScales(1.0, one)),  # a host value
        (TypeError, "float32", cache, KVScales(jnp.float16(1), one)),
        (ValueError, "shape", cache, KVScales(jnp.ones(HEADS + 1, jnp.float32), one)),
        (ValueError, "one scale", mla, KVScales(one, one)),
        (ValueError, "shape", mla, KVScales(jnp.ones(HEADS, jnp.float32))),
        (ValueError, "fp8 cache", plain, KVScales(one)),
        (ValueError, "scales name layers", cache, {"other": KVScales(one, one)}),
    ]
    for error, match, target, scales in bad:
        assert_refused(error, match, extract_kv, target, [1], scales=scales, keep=target)
    assert_refused(TypeError, "jax.Array", inject_kv, cache, rows, [2], scales=KVScales(1.0, one),
                   keep=cache)  # fmt: skip
    inject_kv(cache, rows, [2], scales=KVScales(one, one))  # control


def test_scaled_entries_are_sync_free_with_one_program_per_bucket():
    cache = fp8_cache("packed", jnp.float8_e5m2)
    scales = KVScales(jnp.float32(0.5), jnp.full((HEADS,), 2.0, jnp.float32))
    slots = SLOTS.tolist()
    more = [(cache, slots[:k]) for k in (10, 12, 16)]
    jaxsync.check.assert_sync_free(
        ft.partial(extract_kv, scales=scales, dtype=jnp.bfloat16), cache, slots, inputs=more
    )
    rows = extract_kv(cache, slots, scales=scales, dtype=jnp.bfloat16)

    def step(cache, rows, slots):  # inject donates the cache: give every call its own copy
        return inject_kv(fresh_copy(cache), rows, slots, scales=scales)

    shifted = [(s + 1) % (BLOCKS * BLOCK) if s >= 0 else -1 for s in slots]
    more = [(cache, rows, shifted[:k]) for k in (10, 12)]
    jaxsync.check.assert_sync_free(step, cache, rows, slots, inputs=more)


def test_concat_and_cache_mla_compiles_once_per_bucket():
    cache = fp8_cache("mla", jnp.float8_e4m3fn, stacked=True, layers=("a", "b"))
    kv_c = StackedCache(jnp.zeros((8, 2, 32), jnp.bfloat16), cache.layers)  # [N, L, Lc]
    k_pe = StackedCache(jnp.ones((8, 2, 16), jnp.bfloat16), cache.layers)  # [N, L, R]

    @ft.partial(jax.jit, donate_argnums=0)
    def write(cache, plan, scale):
        return concat_and_cache_mla(cache, kv_c, k_pe, plan, scales=KVScales(scale))

    cache = write(cache, jaxsync.upload_packed(plan_slots(cache, [1])), jnp.float32(1))
    scales = [jnp.float32(0.5), jnp.float32(4.0)]
    with no_recompile(), sync_guard("error"):
        for slots, scale in (([2, -1, 5], scales[0]), ([9] + [-1] * 7, scales[1])):
            cache = write(cache, jaxsync.upload_packed(plan_slots(cache, slots)), scale)
    row = np.asarray(cache.kv[1, 0, 1], np.float32)  # slot 9: block 1, layer a, offset 1
    np.testing.assert_array_equal(row, np.r_[np.zeros(32), np.full(16, 0.25)])  # 1 / 4
