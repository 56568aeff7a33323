"""GLM-4.1V with one poisoned image in a batch: its own outputs go non-finite and its on-device
flag names it, every other image stays bit-identical, in each attention layout and kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsync
from jaxsync.harness.paths.glm4v import reference as ref
from jaxsync.models import glm4v


CFG = glm4v.Glm4vVisionConfig(**ref.TINY)

POISON_GRID = [[1, 6, 6], [1, 4, 8], [2, 2, 4], [1, 10, 6]]


@pytest.mark.parametrize("layout", ["dense", "segments", "ragged"])
@pytest.mark.parametrize("impl", ["xla", "dot_product"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_poisoned_image_never_changes_the_others(impl, bad, layout):
    """One image with a NaN / inf patch: its own outputs go non-finite (as upstream), every
    other image is bit-identical to the clean run, and the on-device flag names the image."""
    model = glm4v.Glm4vVisionTower(CFG, rngs=nnx.Rngs(0), attention=impl)
    assert model.blocks.at(0).attn.impl == impl
    enc = glm4v.Glm4vVisionEncoder(model, layout=layout)
    px = ref.pixels(POISON_GRID, CFG, seed=4)
    plan = enc.plan(POISON_GRID, px.shape[0])
    clean = np.zeros((plan.padded_patches, CFG.patch_dim), np.float32)
    clean[: px.shape[0]] = px
    poisoned = clean.copy()
    poisoned[36 + 5, 7] = bad  # one value of image 1
    a = enc(jaxsync.async_h2d(clean), POISON_GRID)
    b = enc(jaxsync.async_h2d(poisoned), POISON_GRID)
    n_items = len(POISON_GRID)
    np.testing.assert_array_equal(np.asarray(a.extras["finite"])[:n_items], [True] * 4)
    np.testing.assert_array_equal(
        np.asarray(b.extras["finite"])[:n_items], [True, False, True, True]
    )
    for key in ("embeddings", "hidden"):
        got = b.embeddings if key == "embeddings" else b.extras[key]
        want = a.embeddings if key == "embeddings" else a.extras[key]
        parts_b = [np.asarray(got[o : o + n]) for o, n in zip(b.offsets, b.lengths, strict=True)]
        parts_a = [np.asarray(want[o : o + n]) for o, n in zip(a.offsets, a.lengths, strict=True)]
        for i, (pa, pb) in enumerate(zip(parts_a, parts_b, strict=True)):
            if i == 1:
                assert not np.isfinite(pb).any()  # the poisoned image itself, as upstream
            else:
                np.testing.assert_array_equal(pb, pa, err_msg=f"{key} of image {i}")


def test_unmasked_value_product_would_leak():
    """Negative control: the same masked softmax without the value guard turns a clean segment
    into NaN (0 * NaN), so the test above can see a leak."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((6, 2, 4)), jnp.float32) for _ in range(3))
    k, v = k.at[4].set(jnp.nan), v.at[4].set(jnp.nan)  # a NaN row gives NaN keys and values
    seg = jnp.array([0, 0, 0, 1, 1, 1])
    mask = seg[:, None] == seg[None, :]
    from jaxsync.models.glm4v._attention import masked_attention

    guarded = np.asarray(masked_attention(q, k, v, mask, "xla"))
    assert np.isfinite(guarded[:3]).all() and not np.isfinite(guarded[3:]).all()
    scores = jnp.where(mask[None], jnp.einsum("QNH,KNH->NQK", q, k), -jnp.inf)
    leaky = jnp.einsum("NQK,KNH->QNH", jax.nn.softmax(scores, -1), v)
    assert not np.isfinite(np.asarray(leaky[:3])).all()


@pytest.mark.gpu
def test_ragged_cudnn_is_sync_free_and_isolates_each_image():
    """GPU: the default layout of a bf16 tower is cuDNN's ragged attention. It never syncs, one
    program serves every mix of the bucket, and a poisoned image leaves the others bit-identical."""
    if jax.default_backend() not in ("gpu", "cuda"):
        pytest.skip("cuDNN attention needs a GPU")
    from jaxsync.check import assert_sync_free

    cfg = glm4v.Glm4vVisionConfig(**{**ref.TINY, "hidden_size": 64, "num_heads": 4})  # H = 16
    model = glm4v.Glm4vVisionTower(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    enc = glm4v.Glm4vVisionEncoder(model)
    assert model.blocks.at(0).attn.impl == "cudnn" and enc.layout == "ragged"
    grids = [POISON_GRID, [[1, 8, 8], [2, 4, 6], [1, 6, 6]], [[1, 10, 10], [1, 6, 6], [1, 2, 2]]]
    assert len({enc.plan(g).padded_patches for g in grids}) == 1
    inputs = [(ref.pixels(g, cfg, seed=i), g) for i, g in enumerate(grids)]
    assert assert_sync_free(enc, *inputs[0], inputs=inputs[1:]).compiles == 0

    px = ref.pixels(POISON_GRID, cfg, seed=4)
    plan = enc.plan(POISON_GRID, px.shape[0])
    clean = np.zeros((plan.padded_patches, cfg.patch_dim), np.float32)
    clean[: px.shape[0]] = px
    poisoned = clean.copy()
    poisoned[36 + 5, 7] = np.nan  # one value of image 1
    a = enc(jaxsync.async_h2d(clean.astype(jnp.bfloat16)), POISON_GRID)
    b = enc(jaxsync.async_h2d(poisoned.astype(jnp.bfloat16)), POISON_GRID)
    np.testing.assert_array_equal(np.asarray(b.extras["finite"])[:4], [True, False, True, True])
    for i, (o, n) in enumerate(zip(a.offsets, a.lengths, strict=True)):
        got = np.asarray(b.embeddings[o : o + n], np.float32)
        if i == 1:
            assert not np.isfinite(got).any()
        else:
            np.testing.assert_array_equal(got, np.asarray(a.embeddings[o : o + n], np.float32))
