"""PyTorch references of vLLM's cache kernels, from the semantics its own kernel tests check:
`reshape_and_cache_flash` (per-token rows into a paged cache at a slot mapping),
`concat_and_cache_mla` (MLA's two parts as one cache row), fp8 quantization with k/v scales and
the dequantizing read (`convert_fp8`, gather with dequant).

Semantics, in vLLM's terms:

* token i goes to block `slot // S`, offset `slot % S`; a negative slot (vLLM pads with -1) is
  a padded token: the kernel returns without writing, and a read of it here gives zeros;
* an fp8 cache stores `x / scale` computed in float32, saturated to the fp8 type's finite
  range, then cast with round-to-nearest-even; the scale is per tensor (`[]`) or per kv head
  (`[K]`); a read gives `float32(q) * scale` cast to the compute dtype;
* MLA rows are `concat(kv_c, k_pe)` quantized with one scale.

Written per token, as the kernel tests' loops are, so that they share nothing with the
vectorized jax code they check. torch is imported lazily: a test dependency only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxsync.harness.paths.kv.reference import to_torch


def torch_quantize(x, scale, cache_dtype):
    """vLLM's scaled fp8 conversion of `x` `[..., K, H]` (or `[..., L]`) into `cache_dtype`:
    float32 `x / scale` saturated to the finite range, cast to nearest even. `scale`: None (a
    plain cast, no quantization), a float32 scalar tensor, or per head `[K]`."""
    import torch

    if scale is None:
        return x.to(cache_dtype)
    if scale.ndim == 1:  # per kv head: broadcast over the head dim
        scale = scale.view(-1, 1)
    y = x.float() / scale
    top = torch.finfo(cache_dtype).max
    return y.clamp(-top, top).to(cache_dtype)


def torch_dequantize(q, scale, dtype):
    """vLLM's dequantizing read: float32(q) * scale, cast to `dtype` (per head: `[K]`)."""
    if scale is None:
        return q.to(dtype)
    if scale.ndim == 1:
        scale = scale.view(-1, 1)
    return (q.float() * scale).to(dtype)


def _scale(scale: Any):
    import torch

    return None if scale is None else torch.tensor(np.array(scale), dtype=torch.float32)


def torch_reshape_and_cache(key_cache, value_cache, key, value, slots, k_scale=None, v_scale=None):
    """`reshape_and_cache_flash` on torch copies of HND caches `[P, K, S, H]` (jaxsync's
    separate (k, v) layout): rows `key` / `value` `[T, K, H]`, padded tokens (slot < 0)
    skipped. Returns the two caches as torch tensors."""
    kc, vc = to_torch(key_cache).clone(), to_torch(value_cache).clone()
    k, v = to_torch(key), to_torch(value)
    ks, vs = _scale(k_scale), _scale(v_scale)
    block_size = kc.shape[2]
    for i, slot in enumerate(np.asarray(slots).tolist()):
        if slot < 0:
            continue
        kc[slot // block_size, :, slot % block_size] = torch_quantize(k[i], ks, kc.dtype)
        vc[slot // block_size, :, slot % block_size] = torch_quantize(v[i], vs, vc.dtype)
    return kc, vc


def torch_concat_and_cache_mla(cache, kv_c, k_pe, slots, scale=None):
    """`concat_and_cache_mla` on a torch copy of `[P, S, L]`: row i = concat(kv_c[i], k_pe[i]),
    quantized with one scale for an fp8 cache; padded tokens skipped."""
    import torch

    out = to_torch(cache).clone()
    c, pe = to_torch(kv_c), to_torch(k_pe)
    s = _scale(scale)
    block_size = out.shape[1]
    for i, slot in enumerate(np.asarray(slots).tolist()):
        if slot < 0:
            continue
        row = torch.cat([c[i], pe[i]])
        out[slot // block_size, slot % block_size] = torch_quantize(row, s, out.dtype)
    return out


def torch_gather(cache, slots, scale=None, dtype=None):
    """The rows of `slots` from a torch copy of `[P, K, S, H]` or `[P, S, L]`, dequantized to
    `dtype` when given (an fp8 cache), zeros for padded tokens (slot < 0)."""
    import torch

    t = to_torch(cache)
    s = _scale(scale)
    heads = t.ndim == 4
    block_size = t.shape[2] if heads else t.shape[1]
    rows = []
    for slot in np.asarray(slots).tolist():
        if slot < 0:
            shape = t.shape[1:2] + t.shape[3:] if heads else t.shape[2:]
            rows.append(torch.zeros(shape, dtype=dtype or t.dtype))
            continue
        q = (
            t[slot // block_size, :, slot % block_size]
            if heads
            else t[slot // block_size, slot % block_size]
        )
        rows.append(q if dtype is None else torch_dequantize(q, s, dtype))
    return torch.stack(rows)
