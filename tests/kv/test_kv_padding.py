"""vLLM's padded tokens (slot -1): they write nothing and read zeros in every slot path, bit for
bit against torch references of `reshape_and_cache_flash` / `concat_and_cache_mla` (vLLM's kernel
test cases with padding added); any other negative slot, or one past the cache, is refused on the
host."""

import functools as ft
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsync
from jaxsync.check import no_recompile
from jaxsync.harness.paths.kv.reference import host_random_cache, to_numpy
from jaxsync.kv import (
    KVLayout,
    extract_kv,
    inject_kv,
    load_kv,
    plan_slots,
    read_slots,
    save_kv,
    slot_mapping_for,
    write_slots,
)
from jaxsync.testing import assert_refused, fresh_copy, requires_torch


LAYERS = ("l0", "l1")


def padded_mapping(num_slots: int, num_tokens: int, seed: int) -> np.ndarray:
    """vLLM's test mapping (distinct random slots), every third token and the tail padded."""
    rng = random.Random(seed)
    slots = np.array(rng.sample(range(num_slots), num_tokens), np.int64)
    slots[::3] = -1
    slots[-2:] = -1
    return slots


def bits(x):
    return np.asarray(x).view(np.uint8)


@ft.partial(jax.jit, donate_argnums=0)
def write_step(cache, rows, plan):
    return write_slots(cache, rows, plan)


@jax.jit
def read_step(cache, plan):
    return read_slots(cache, plan)


# vLLM's parameter grid, shrunk for CPU: heads, head sizes, block sizes, dtypes
@pytest.mark.parametrize("num_heads", [1, 8])
@pytest.mark.parametrize("head_size", [64, 80])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@requires_torch  # its reference is torch
def test_reshape_and_cache_with_padding_matches_torch(num_heads, head_size, block_size, dtype):
    from jaxsync.harness.paths.kv.reference_cache_ops import torch_gather, torch_reshape_and_cache

    layout = KVLayout(kind="separate", num_blocks=12, block_size=block_size,
                      num_kv_heads=num_heads, head_dim=head_size, dtype=dtype)  # fmt: skip
    cache = host_random_cache(layout, ["l"], seed=0)
    slots = padded_mapping(12 * block_size, 21, seed=block_size)
    rng = np.random.default_rng(1)
    shape = (len(slots), num_heads, head_size)
    key, value = (rng.standard_normal(shape).astype(np.float32).astype(dtype) for _ in range(2))
    want_k, want_v = torch_reshape_and_cache(*cache["l"], key, value, slots)
    size = jaxsync.bucket(len(slots))
    rows = {"l": tuple(jnp.pad(x, ((0, size - len(slots)), (0, 0), (0, 0))) for x in (key, value))}
    # the entry, and the pure function with the plan and with the raw -1 mapping on the device
    got = inject_kv(fresh_copy(cache), rows, slots)
    plan = jaxsync.upload_packed(plan_slots(cache, slots))
    in_step = write_step(fresh_copy(cache), rows, plan)
    raw = jnp.asarray(np.pad(slots, (0, size - len(slots)), constant_values=-1), jnp.int32)
    on_device = jax.jit(write_slots)(fresh_copy(cache), rows, raw)
    for out in (got, in_step, on_device):
        np.testing.assert_array_equal(bits(out["l"][0]), bits(to_numpy(want_k)))
        np.testing.assert_array_equal(bits(out["l"][1]), bits(to_numpy(want_v)))
    for i, leaf in enumerate(got["l"]):  # reads: zeros for padded tokens, as the torch gather
        want = to_numpy(torch_gather(leaf, slots))
        np.testing.assert_array_equal(
            bits(extract_kv(got, slots)["l"][i][: len(slots)]), bits(want)
        )
        np.testing.assert_array_equal(bits(read_step(got, plan)["l"][i][: len(slots)]), bits(want))
        assert not np.asarray(want)[slots < 0].any()  # control: padded rows really are zeros


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@requires_torch  # its reference is torch
def test_concat_and_cache_mla_with_padding_matches_torch(dtype):
    from jaxsync.harness.paths.kv.reference_cache_ops import torch_concat_and_cache_mla

    lora, rope = 64, 16
    layout = KVLayout(kind="mla", num_blocks=8, block_size=16, latent_dim=lora + rope, dtype=dtype)
    cache = host_random_cache(layout, ["m"], seed=2)
    slots = padded_mapping(8 * 16, 21, seed=3)
    rng = np.random.default_rng(4)
    kv_c = rng.standard_normal((len(slots), lora)).astype(np.float32).astype(dtype)
    k_pe = rng.standard_normal((len(slots), rope)).astype(np.float32).astype(dtype)
    want = torch_concat_and_cache_mla(cache["m"], kv_c, k_pe, slots)
    rows = np.concatenate([kv_c, k_pe], axis=1)
    rows = {"m": jnp.asarray(np.pad(rows, ((0, 32 - len(slots)), (0, 0))))}
    got = inject_kv(fresh_copy(cache), rows, slots)
    np.testing.assert_array_equal(bits(got["m"]), bits(to_numpy(want)))


def test_padding_repeats_and_writes_nothing_anywhere():
    layout = KVLayout(kind="packed", num_blocks=5, block_size=4, num_kv_heads=2, head_dim=3,
                      dtype=jnp.float32)  # fmt: skip
    cache = host_random_cache(layout, LAYERS, seed=5)
    before = [np.asarray(x).copy() for x in jax.tree.leaves(cache)]
    rows = extract_kv(host_random_cache(layout, LAYERS, seed=6), [0] * 8)
    out = inject_kv(fresh_copy(cache), rows, [-1, -1, -1])  # padding may repeat
    for a, b in zip(jax.tree.leaves(out), before, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    out = inject_kv(fresh_copy(cache), rows, [-1, 19, -1])  # one real slot: the last of block 4
    changed = np.argwhere(np.asarray(out["l0"]) != before[0])
    assert set(map(tuple, changed[:, [0, 2]])) == {(4, 3)}  # control: a real slot is written


def test_bad_slots_are_refused_before_any_upload():
    layout = KVLayout(kind="mla", num_blocks=5, block_size=4, latent_dim=6, dtype=jnp.float32)
    cache = host_random_cache(layout, LAYERS, seed=7)
    rows = extract_kv(cache, [0])
    for slots in ([-2], [3, -5], [20], [-1, 3, 3]):
        assert_refused(ValueError, "must lie in|unique", inject_kv, cache, rows, slots, keep=cache)
        assert_refused(ValueError, "must lie in|unique", plan_slots, cache, slots, keep=cache)
    for slots in ([-2], [20]):
        assert_refused(ValueError, "must lie in", extract_kv, cache, slots, keep=cache)
    for block_ids in ([-2, 1], [5]):
        assert_refused(ValueError, "must lie in", save_kv, "/nonexistent", cache,
                       list(range(9)), block_ids, keep=cache)  # fmt: skip


def test_one_program_with_and_without_padding():
    layout = KVLayout(kind="packed", num_blocks=5, block_size=4, num_kv_heads=2, head_dim=3,
                      dtype=jnp.float32, stacked=True)  # fmt: skip
    cache = layout.random(LAYERS, jax.random.key(0))
    rows = read_step(cache, jaxsync.upload_packed(plan_slots(cache, [1])))
    cache = write_step(cache, rows, jaxsync.upload_packed(plan_slots(cache, [2])))
    with no_recompile():
        for slots in ([-1, 3], [-1] * 8, [4, 5, -1, 6]):
            plan = jaxsync.upload_packed(plan_slots(cache, slots))
            cache = write_step(cache, rows, plan)
            read_step(cache, plan)


def test_save_and_load_skip_padded_blocks(tmp_path):
    layout = KVLayout(kind="packed", num_blocks=6, block_size=4, num_kv_heads=2, head_dim=3,
                      dtype=jnp.float32)  # fmt: skip
    cache = host_random_cache(layout, LAYERS, seed=8)
    tokens = list(range(13))  # keeps 12 tokens: 3 blocks
    folder = save_kv(tmp_path, cache, tokens, [2, -1, 4])
    assert folder is not None
    target = host_random_cache(layout, LAYERS, seed=9)
    before = np.asarray(target["l0"]).copy()
    out = load_kv(tmp_path, fresh_copy(target), tokens, [0, -1, 3])
    got, src = np.asarray(out["l0"]), np.asarray(cache["l0"])
    np.testing.assert_array_equal(got[0], src[2])
    np.testing.assert_array_equal(got[3], src[4])
    np.testing.assert_array_equal(got[1:3], before[1:3])  # padded tokens are not loaded
    assert slot_mapping_for([2, -1, 4], 4, 13)[4:8].tolist() == [-1] * 4
