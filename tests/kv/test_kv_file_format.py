"""`save_kv` / `load_kv` in vLLM's ExampleConnector file layout (the default, `format="vllm"`):
a file written by vLLM's rules with torch loads into jaxsync caches, and a file jaxsync writes
is read back by vLLM's rules; `format="jaxsync"` keeps jaxsync's own layout."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsync.harness.paths.kv.reference import host_random_cache, to_numpy, to_torch
from jaxsync.kv import KVLayout, extract_kv, kv_folder, load_kv, save_kv, slot_mapping_for
from jaxsync.testing import assert_refused, fresh_copy, requires_torch


LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
HEADS, HEAD_DIM, BLOCK, BLOCKS = 2, 4, 4, 9
KINDS = {
    "packed": dict(kind="packed", num_kv_heads=HEADS, head_dim=HEAD_DIM),
    "separate": dict(kind="separate", num_kv_heads=HEADS, head_dim=HEAD_DIM),
    "mla": dict(kind="mla", latent_dim=6),
}
TOKENS = list(range(300, 313))  # 13 tokens: 12 kept, 3 blocks


def make(kind, dtype, seed):
    layout = KVLayout(num_blocks=BLOCKS, block_size=BLOCK, dtype=dtype, **KINDS[kind])
    return host_random_cache(layout, LAYERS, seed)


def vllm_layer(value):
    """The torch layer vLLM's connector sees: K and V stacked `[2, P, S, K, H]` (NHD) for a
    (k, v) pair, the packed `[P, K, S, 2H]` or MLA `[P, S, L]` cache as it is."""
    import torch

    if not isinstance(value, tuple):
        return to_torch(value)
    k, v = (to_torch(x) for x in value)
    return torch.stack([k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)]).contiguous()


def _vllm_index(layer, slots):
    """Where vLLM's connector reads and writes the slots' rows in `layer` (a view)."""
    import torch

    slot = torch.tensor(slots, dtype=torch.long)
    if layer.ndim == 5:  # K and V stacked: reshape(2, P*S, -1)[:, slots]
        return layer.reshape(2, layer.shape[1] * layer.shape[2], -1), (slice(None), slot)
    if layer.ndim == 4:  # packed: layer[slot // S, :, slot % S]
        size = layer.shape[2]
        return layer, (slot // size, slice(None), slot % size)
    return layer.reshape(-1, layer.shape[-1]), (slot,)  # MLA: reshape(P*S, -1)[slots]


def vllm_extract(layer, slots):
    """vLLM's connector save rule."""
    view, index = _vllm_index(layer, slots)
    return view[index]


def vllm_inject(layer, kv, slots):
    """vLLM's connector load rule, the inverse of `vllm_extract`."""
    out = layer.clone()
    view, index = _vllm_index(out, slots)
    view[index] = kv
    return out


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@requires_torch  # its reference is torch
def test_a_file_vllm_wrote_loads(kind, dtype, tmp_path):
    import safetensors.torch

    cache, target = make(kind, dtype, 0), make(kind, dtype, 1)
    saved_blocks, new_blocks = [5, 1, 7], [0, 8, 3]
    slots = slot_mapping_for(saved_blocks, BLOCK, len(TOKENS))
    folder = kv_folder(tmp_path, TOKENS[: slots.size])
    os.makedirs(folder)
    for name in LAYERS:  # what vLLM's save_kv_layer writes
        kv = vllm_extract(vllm_layer(cache[name]), slots.tolist())
        safetensors.torch.save_file({"kv_cache": kv}, os.path.join(folder, f"{name}.safetensors"))
    out = load_kv(tmp_path, fresh_copy(target), TOKENS, new_blocks)
    new_slots = slot_mapping_for(new_blocks, BLOCK, len(TOKENS))
    got, want = extract_kv(out, new_slots), extract_kv(cache, slots)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    if kind == "separate":  # control: the layouts differ (packed and MLA files are alike)
        with pytest.raises(ValueError, match="'jaxsync' format|'k_cache'"):
            load_kv(tmp_path, fresh_copy(target), TOKENS, new_blocks, format="jaxsync")


@pytest.mark.parametrize("kind", list(KINDS))
@requires_torch  # its reference is torch
def test_vllm_reads_a_file_jaxsync_wrote(kind, tmp_path):
    import safetensors.torch

    cache, target = make(kind, jnp.bfloat16, 2), make(kind, jnp.bfloat16, 3)
    folder = save_kv(tmp_path, cache, TOKENS, [2, 6, 4])
    slots = slot_mapping_for([2, 6, 4], BLOCK, len(TOKENS)).tolist()
    new_slots = slot_mapping_for([1, 0, 8], BLOCK, len(TOKENS)).tolist()
    for name in LAYERS:  # what vLLM's start_load_kv does with the file
        kv = safetensors.torch.load_file(os.path.join(folder, f"{name}.safetensors"))["kv_cache"]
        want = vllm_extract(vllm_layer(cache[name]), slots)
        assert kv.shape == want.shape and kv.dtype == want.dtype
        loaded = vllm_inject(vllm_layer(target[name]), kv, new_slots)
        back = vllm_extract(loaded, new_slots)
        np.testing.assert_array_equal(
            to_numpy(back).view(np.uint16), to_numpy(want).view(np.uint16)
        )


@pytest.mark.parametrize("kind", ["separate"])
def test_the_jaxsync_layout_round_trips_and_differs(kind, tmp_path):
    from safetensors import safe_open

    cache, target = make(kind, jnp.float32, 4), make(kind, jnp.float32, 5)
    folder = save_kv(tmp_path, cache, TOKENS, [2, 6, 4], format="jaxsync")
    with safe_open(os.path.join(folder, f"{LAYERS[0]}.safetensors"), "numpy") as f:
        keys = sorted(f.keys())
    assert keys == ["k_cache", "v_cache"]
    out = load_kv(tmp_path, fresh_copy(target), TOKENS, [7, 3, 1], format="jaxsync")
    got = extract_kv(out, slot_mapping_for([7, 3, 1], BLOCK, len(TOKENS)))
    want = extract_kv(cache, slot_mapping_for([2, 6, 4], BLOCK, len(TOKENS)))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # a vLLM-layout load of these files is refused on the host, the caches untouched
    refusal = "'vllm' format|'kv_cache'"
    assert_refused(ValueError, refusal, load_kv, tmp_path, target, TOKENS, [7, 3, 1], keep=target)
    for bad in ("torch", None, "VLLM"):
        assert_refused(ValueError, "format must be", load_kv, tmp_path, target, TOKENS,
                       [7, 3, 1], format=bad, keep=target)  # fmt: skip
        with pytest.raises(ValueError, match="format must be"):
            save_kv(tmp_path / "other", cache, TOKENS, [2, 6, 4], format=bad)
    assert not (tmp_path / "other").exists()
