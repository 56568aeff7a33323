"""Registers the fp8 kv path for `jaxsync verify`: per-token rows quantized into an fp8 cache
with per-head k/v scales at slot mappings with padded tokens (vLLM's `reshape_and_cache_flash`
with `kv_cache_dtype="fp8"`), checked bit for bit against the torch reference of vLLM's scaled
conversion (`reference_cache_ops`)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxsync.harness.paths.kv.reference import host_random_cache
from jaxsync.harness.registry import Parity, PathCase, register_path
from jaxsync.kv import KVLayout, KVScales, inject_kv
from jaxsync.testing import fresh_copy


_LAYOUT = KVLayout(kind="separate", num_blocks=13, block_size=4, num_kv_heads=2, head_dim=8,
                   dtype=jnp.float8_e4m3fn)  # fmt: skip
_SLOTS = [
    [51, -1, 5, 13, 14, -1, 22, 3, 1, 11],
    [7, 8, -1, 10, 11, 12, -1, -1, 15],
    list(range(40, 52)),
]


@register_path(
    "kv.inject_kv_fp8",
    "quantize per-token rows into an fp8 cache with per-head k/v scales (padded tokens skipped)",
    checkpoints=False,
)
def _build(checkpoint: str | None) -> PathCase:
    cache = host_random_cache(_LAYOUT, ["l"], seed=0)
    rng = np.random.default_rng(1)
    shape = (16, _LAYOUT.num_kv_heads, _LAYOUT.head_dim)  # one bucket for every slot list
    key, value = (rng.standard_normal(shape).astype(np.float32) * 50 for _ in range(2))
    rows = {"l": (jnp.asarray(key, jnp.bfloat16), jnp.asarray(value, jnp.bfloat16))}
    scales = KVScales(jnp.asarray([0.25, 0.5], jnp.float32), jnp.asarray([1.0, 0.125], jnp.float32))

    def step(cache, rows, slots):
        return inject_kv(fresh_copy(cache), rows, slots, scales=scales)

    def parity() -> Parity:
        from jaxsync.harness.paths.kv.reference import to_numpy
        from jaxsync.harness.paths.kv.reference_cache_ops import torch_reshape_and_cache

        bad = 0
        for slots in _SLOTS:
            out = step(cache, rows, slots)["l"]
            n = len(slots)
            k, v = (np.asarray(x)[:n] for x in rows["l"])
            want = torch_reshape_and_cache(*cache["l"], k, v, slots, scales.k, scales.v)
            for got, ref in zip(out, want, strict=True):
                bad += int(np.sum(np.asarray(got).view(np.uint8) != to_numpy(ref).view(np.uint8)))
        return Parity(bad, 0, "mismatches", "torch reference of vLLM's scaled fp8 conversion")

    return PathCase(step, [(cache, rows, s) for s in _SLOTS], parity)
