"""Entry plans keyed by the content of the host metadata (`jaxsync._plans.metadata_key`): metadata
mutated in place after a call is planned (or refused) again, never served the stale plan."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsync._plans import metadata_key


def test_metadata_key_is_exact_content():
    key = metadata_key
    assert key([[1, 4, 6]]) == key([[1, 4, 6]]) != key([[1, 4, 8]])
    assert key([1, 2]) != key((1, 2)) != key([[1, 2]])
    a = np.array([[1, 4, 6]])
    assert key(a) == key(a.copy()) != key(a.astype(np.int32)) != key(a.reshape(3, 1))
    # equal to ints and hashing like them, so never a key: they must meet the checks
    for bad in ([True, 5], [2.0], [[1, 4.0, 6]], [np.int64(3)], [[1], 2], "16", None):
        assert key(bad) is None, bad
    assert key(np.array(["a"])) is None and key(np.array([None])) is None


def test_glm4v_grid_mutated_in_place_is_planned_again():
    from jaxsync.harness.paths.glm4v import reference as ref
    from jaxsync.models import glm4v

    enc = glm4v.Glm4vVisionEncoder(
        glm4v.Glm4vVisionTower(glm4v.Glm4vVisionConfig(**ref.TINY), rngs=nnx.Rngs(0))
    )
    grid = [[1, 4, 6], [1, 6, 6]]
    pixels = jnp.asarray(ref.pixels([[1, 4, 6], [1, 6, 6]], enc.cfg))
    padded = jnp.zeros((enc.plan(grid).padded_patches, enc.cfg.patch_dim)).at[:60].set(pixels)
    first = enc(padded, grid)
    grid[1][1:] = [8, 4]  # same list object, another image size (same bucket)
    second = enc(padded, grid)
    assert first.lengths == (6, 9) and second.lengths == (6, 8)
    want = enc(padded, [[1, 4, 6], [1, 8, 4]])
    np.testing.assert_array_equal(np.asarray(second.embeddings), np.asarray(want.embeddings))
    grid[1][1:] = [6, 5]  # not a multiple of the merge size: refused, not served from the cache
    with pytest.raises(ValueError, match="multiples of spatial_merge_size"):
        enc(padded, grid)
    grid[1][2] = True  # a bool equals 1 and hashes like it: checked, refused
    with pytest.raises(TypeError, match="integers"):
        enc(padded, grid)
    array = np.array([[1, 4, 6], [1, 6, 6]])
    assert enc(padded, array).lengths == (6, 9)
    array[1, 1] = 0
    with pytest.raises(ValueError, match=">= 1"):
        enc(padded, array)


def test_voxtral_num_chunks_mutated_in_place_is_planned_again():
    from jaxsync.harness.paths.voxtral import reference as ref
    from jaxsync.models import voxtral

    cfg = voxtral.VoxtralAudioConfig(**ref.TINY_ENCODER)
    enc = voxtral.VoxtralAudioEncoder(voxtral.VoxtralAudioTower(cfg, rngs=nnx.Rngs(0)))
    feats = jnp.zeros((4, cfg.num_mel_bins, cfg.chunk_frames), jnp.float32)
    counts = np.array([1, 2])
    per = enc(input_features=feats, num_chunks=counts).lengths[0]
    counts[:] = [3, 1]
    assert enc(input_features=feats, num_chunks=counts).lengths == (3 * per, per)
    counts[:] = [4, 1]  # 5 windows in a 4-window array: refused
    with pytest.raises(ValueError, match="sums to 5"):
        enc(input_features=feats, num_chunks=counts)
    listed = [2, 2]
    assert enc(input_features=feats, num_chunks=listed).lengths == (2 * per, 2 * per)
    listed[0] = 0
    with pytest.raises(ValueError, match=">= 1"):
        enc(input_features=feats, num_chunks=listed)


def test_gemma3n_mask_mutated_in_place_is_planned_again():
    from jaxsync.harness.paths.gemma3n import reference as ref
    from jaxsync.models.gemma3n import Gemma3nAudioEncoder, Gemma3nAudioModel

    cfg = ref.tiny_config()
    enc = Gemma3nAudioEncoder(Gemma3nAudioModel(cfg, rngs=nnx.Rngs(0)))
    feats = jnp.ones((2, 40, cfg.input_feat_size), jnp.float32)
    mask = np.ones((2, 40), bool)
    full = np.asarray(enc(feats, mask).embeddings)
    mask[1, 9:] = False  # clip 1 now has 9 real frames
    short = np.asarray(enc(feats, mask).embeddings)
    want = np.asarray(enc(feats, mask.copy()).embeddings)
    np.testing.assert_array_equal(short, want)
    t = cfg.soft_tokens
    assert not np.array_equal(short[t : 2 * t], full[t : 2 * t])
    mask[1, :] = False  # a clip without a real frame: refused
    with pytest.raises(ValueError, match="no valid frame"):
        enc(feats, mask)
