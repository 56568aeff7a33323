"""How one layer's KV rows lie in its safetensors file: vLLM's ExampleConnector layout or
jaxsync's own.

vLLM's connector saves one tensor "kv_cache" per layer: the layer's rows at the request's slots,
in the layout of vLLM's cache for that layer. Each jaxsync layout mirrors one of vLLM's:

* packed `[P, K, S, 2H]` (vLLM's packed K/V cache): `[T, K, 2H]`, `layer[slot // S, :, slot % S]`;
* separate K/V, a `(k, v)` pair of `[P, K, S, H]` (vLLM's cache of K and V stacked on a leading
  axis, `[2, P, S, K, H]`, viewed as `[2, P*S, -1]` at the slots): `[2, T, K*H]`, K's rows then
  V's, each token's heads flattened in head order;
* MLA `[P, S, L]`: `[T, L]`.

"vllm" writes and reads these; files move between vLLM and jaxsync both ways. "jaxsync" differs
for separate K/V only: "k_cache" and "v_cache", `[T, K, H]` each (rows as `extract_kv` gives
them). Either holds the same bytes in another order, so the conversion is exact.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np


Format = Literal["vllm", "jaxsync"]
FORMATS = ("vllm", "jaxsync")


def check_format(format: Any) -> None:
    if not isinstance(format, str) or format not in FORMATS:
        raise ValueError(f"format must be 'vllm' or 'jaxsync', got {format!r}")


def _stacked_kv(leaves: list, format: Format) -> bool:
    """Whether the layer's file stacks K and V on a leading axis: a (k, v) pair, "vllm"."""
    if len(leaves) not in (1, 2):
        raise ValueError("a layer must be an array or a (k, v) pair")
    return format == "vllm" and len(leaves) == 2


def tensor_specs(leaves: list, n: int, format: Format) -> dict[str, tuple[tuple, Any]]:
    """`{name: (shape, dtype)}` of the tensors a layer's file holds for `n` tokens; `leaves`:
    the layer's per-layer leaves (or their shapes and dtypes)."""
    if _stacked_kv(leaves, format):
        heads, head_dim = leaves[0].shape[1], leaves[0].shape[-1]
        return {"kv_cache": ((2, n, heads * head_dim), leaves[0].dtype)}
    names = ["kv_cache"] if len(leaves) == 1 else ["k_cache", "v_cache"]
    return {
        name: ((n, *leaf.shape[1:-2], leaf.shape[-1]), leaf.dtype)
        for name, leaf in zip(names, leaves, strict=True)
    }


def to_tensors(rows: list[np.ndarray], leaves: list, format: Format) -> dict[str, np.ndarray]:
    """One layer's host rows (`[T, K, X]` per leaf, or `[T, L]`) as its file's tensors."""
    if not _stacked_kv(leaves, format):
        names = list(tensor_specs(leaves, 0, format))
        return {name: np.ascontiguousarray(r) for name, r in zip(names, rows, strict=True)}
    num = rows[0].shape[0]
    return {"kv_cache": np.stack([r.reshape(num, -1) for r in rows])}  # [2, T, K*H]


def from_tensors(tensors: dict[str, np.ndarray], leaves: list, format: Format) -> list[np.ndarray]:
    """Inverse of `to_tensors`: a layer's rows per leaf from its (checked) file tensors."""
    if not _stacked_kv(leaves, format):
        return list(tensors.values())
    kv = tensors["kv_cache"]  # [2, T, K*H]
    heads, num = leaves[0].shape[1], kv.shape[1]
    return [x.reshape(num, heads, -1) for x in kv]  # k, v: [T, K, H] each
