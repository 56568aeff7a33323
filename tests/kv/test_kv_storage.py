"""save_kv / load_kv: upstream folder key, file format, round trip onto the cache's own sharding."""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors.numpy import load_file

import jaxsync.check
import jaxsync.testing
from jaxsync.harness.paths.kv.reference import as_numpy, to_numpy, torch_extract
from jaxsync.kv import KVLayout, extract_kv, kv_folder, load_kv, save_kv, slot_mapping_for
from jaxsync.testing import fresh_copy, requires_torch


LAYERS = ("model.layers.0.attn", "model.layers.1.attn")
TOKENS = [11, 7, 3, 5, 2, 9, 4, 8, 1, 6, 10]  # 11 tokens, S=4 -> 8 kept (2 blocks)


@requires_torch  # its reference is torch
def test_folder_key_matches_upstream():
    import hashlib

    import torch

    kept = torch.tensor(TOKENS)[:8]
    mm = ["img0", "img1"]
    upstream = hashlib.md5(kept.numpy().tobytes() + "-".join(mm).encode()).hexdigest()
    assert kv_folder("/r", TOKENS[:8], mm) == os.path.join("/r", upstream)
    assert kv_folder("/r", TOKENS[:8]) == os.path.join(
        "/r", hashlib.md5(kept.numpy().tobytes()).hexdigest()
    )


@pytest.mark.parametrize("kind", ["packed", "mla", "separate"])
@requires_torch  # its reference is torch
def test_save_matches_torch_and_load_round_trips(tmp_path, kind):
    heads = dict(num_kv_heads=2, head_dim=3)
    dims = {"packed": heads, "separate": heads, "mla": dict(latent_dim=5)}[kind]
    layout = KVLayout(kind=kind, num_blocks=9, block_size=4, dtype=jnp.bfloat16, **dims)
    cache = layout.random(LAYERS, jax.random.key(0))
    # rows as the connector gathers them per leaf (vLLM's file layout: test_kv_file_format)
    folder = save_kv(tmp_path, cache, TOKENS, [6, 2, 8], format="jaxsync")
    assert folder == kv_folder(tmp_path, TOKENS[:8])
    slots = slot_mapping_for([6, 2, 8], 4, len(TOKENS))
    for layer in LAYERS:
        stored = load_file(os.path.join(folder, f"{layer}.safetensors"))
        leaves = jax.tree.leaves(cache[layer])
        names = ["kv_cache"] if kind != "separate" else ["k_cache", "v_cache"]
        assert sorted(stored) == sorted(names)
        for name, leaf in zip(names, leaves, strict=True):
            want = to_numpy(torch_extract(leaf, slots))
            assert stored[name].dtype == ml_dtypes.bfloat16 and stored[name].shape == want.shape
            np.testing.assert_array_equal(stored[name].view(np.uint16), want.view(np.uint16))

    # Load into other blocks of a different cache: the rows land at the new block table.
    target = layout.random(LAYERS, jax.random.key(1))
    out = load_kv(tmp_path, target, TOKENS, [0, 5, 1], format="jaxsync")
    back = extract_kv(out, slot_mapping_for([0, 5, 1], 4, len(TOKENS)))
    saved = extract_kv(cache, slots)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(as_numpy(a).view(np.uint16), as_numpy(b).view(np.uint16))


def test_load_lands_on_the_cache_sharding_sync_free(tmp_path):
    mesh = jaxsync.testing.device_mesh("h")
    shard = NamedSharding(mesh, P(None, "h"))
    layout = KVLayout(kind="packed", num_blocks=9, block_size=4, num_kv_heads=8, head_dim=2,
                      dtype=jnp.float32)  # fmt: skip
    cache = layout.random(LAYERS, jax.random.key(0), placement=shard)
    save_kv(tmp_path, cache, TOKENS, [6, 2, 8])
    other = TOKENS[::-1][:10]  # another request (other kept tokens, so another folder), same bucket
    save_kv(tmp_path, cache, other, [3, 4, 7])
    target = layout.random(LAYERS, jax.random.key(1), placement=shard)

    def step(root, caches, tokens, blocks):  # load donates the caches: one copy per call
        return load_kv(root, fresh_copy(caches), tokens, blocks)

    jaxsync.check.assert_sync_free(
        step, tmp_path, target, TOKENS, [0, 5, 1], inputs=[(tmp_path, target, other, [8, 1])]
    )
    out = load_kv(tmp_path, target, TOKENS, [0, 5, 1])
    for leaf in jax.tree.leaves(out):
        assert leaf.sharding.is_equivalent_to(shard, leaf.ndim)
    np.testing.assert_array_equal(
        as_numpy(out[LAYERS[0]])[[0, 5]], as_numpy(cache[LAYERS[0]])[[6, 2]]
    )


def test_load_errors_leave_cache_untouched(tmp_path):
    layout = KVLayout(kind="mla", num_blocks=9, block_size=4, latent_dim=5, dtype=jnp.float32)
    cache = layout.random(LAYERS, jax.random.key(0))
    with pytest.raises(FileNotFoundError, match="no saved KV"):
        load_kv(tmp_path, cache, TOKENS, [0, 1, 2])
    save_kv(tmp_path, cache, TOKENS, [6, 2, 8])
    other = KVLayout(kind="mla", num_blocks=9, block_size=4, latent_dim=6, dtype=jnp.float32)
    wrong = other.random(LAYERS, jax.random.key(1))
    with pytest.raises(ValueError, match="cache needs"):
        load_kv(tmp_path, wrong, TOKENS, [0, 1, 2])
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves((cache, wrong)))
    assert save_kv(tmp_path, cache, TOKENS[:4], [6]) is None  # nothing kept, nothing written
    assert load_kv(tmp_path, cache, TOKENS[:4], [6]) is cache
    with pytest.raises(ValueError, match="file name"):
        save_kv(tmp_path, {"a/b": cache[LAYERS[0]]}, TOKENS, [6, 2, 8])


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e8m0fnu])
def test_float8_caches_round_trip(tmp_path, dtype):
    # safetensors' numpy reader cannot return float8 tensors (numpy has no such types): load_kv
    # reads their bytes itself, so what save_kv wrote comes back bit for bit.
    layout = KVLayout(kind="separate", num_blocks=7, block_size=3, num_kv_heads=1, head_dim=5,
                      dtype=dtype, stacked=True)  # fmt: skip
    cache = layout.random(LAYERS, jax.random.key(0))
    folder = save_kv(tmp_path, cache, TOKENS, [6, 2, 0, 4])  # 11 tokens, S=3 -> 9 kept
    stored = jax.tree.leaves(jax.device_get(extract_kv(cache, slot_mapping_for([6, 2, 0], 3, 11))))
    target = layout.random(LAYERS, jax.random.key(1))
    out = load_kv(tmp_path, target, TOKENS, [1, 5, 3, 2])
    back = extract_kv(out, slot_mapping_for([1, 5, 3], 3, 11))
    for a, b in zip(jax.tree.leaves(back), stored, strict=True):
        assert a.dtype == dtype
        np.testing.assert_array_equal(as_numpy(a).view(np.uint8), b.view(np.uint8))
    assert sorted(os.listdir(folder)) == sorted(f"{n}.safetensors" for n in LAYERS)


def test_dtypes_files_cannot_hold_are_refused_before_the_folder(tmp_path):
    layout = KVLayout(kind="mla", num_blocks=5, block_size=2, latent_dim=4, dtype=jnp.int4)
    cache = layout.random(LAYERS, jax.random.key(0))
    for call in (save_kv, load_kv):
        with pytest.raises(TypeError, match="cannot hold int4"):
            call(tmp_path, cache, TOKENS[:5], [3, 1])
    assert os.listdir(tmp_path) == []
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(cache))
