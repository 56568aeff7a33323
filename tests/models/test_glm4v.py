"""GLM-4.1V vision entry: sync-freedom, buckets without recompiles, plan layout, the pure forward
in a server's jit, the compiled-program cache, processor inputs, sharding, registry."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsync
from jaxsync.check import assert_sync_free
from jaxsync.models import glm4v
from jaxsync.paths.glm4v import reference as ref
from jaxsync.paths.glm4v.verify import VERIFY_GRIDS
from jaxsync.testing import assert_close, rel_err, requires_torch


CFG = glm4v.Glm4vVisionConfig(**ref.TINY)  # the same tiny odd-sized tower as the parity tests


@pytest.fixture(scope="module")
def model():
    return glm4v.Glm4vVisionTower(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def enc(model):
    return glm4v.Glm4vVisionEncoder(model)


def _inputs():
    return [(ref.pixels(g, CFG, seed=i), g) for i, g in enumerate(VERIFY_GRIDS)]


def _padded(enc, px, grid) -> np.ndarray:
    host = np.zeros((enc.plan(grid).padded_patches, CFG.patch_dim), np.float32)
    host[: px.shape[0]] = px
    return host


def test_verify_grids_share_one_bucket(enc):
    sizes = {tuple(map(tuple, g)) for g in VERIFY_GRIDS}
    assert len({s for s in sizes if len(s) == 1 and s[0][0] == 1}) >= 5  # five image sizes
    assert {enc.plan(g).padded_patches for g in VERIFY_GRIDS} == {128}


def test_tower_is_sync_free_and_never_recompiles(enc):
    first, *rest = _inputs()
    report = assert_sync_free(enc, *first, inputs=rest)
    assert report.compiles == 0


def test_pos_embeds_is_sync_free(enc):
    first, *rest = [(g,) for g in VERIFY_GRIDS]
    assert_sync_free(enc.pos_embeds, *first, inputs=rest)


def test_device_pixels_are_sync_free(enc):
    padded = [(jaxsync.async_h2d(_padded(enc, px, g)), g) for px, g in _inputs()[:3]]
    assert_sync_free(enc, *padded[0], inputs=padded[1:])


def test_one_upload_per_new_grid_and_none_when_cached(model, monkeypatch):
    """Everything derived from grid_thw moves in one packed transfer (pixels are the other), and
    a repeated grid mix reuses its uploaded plan."""
    enc = glm4v.Glm4vVisionEncoder(model)
    calls = []
    real = jaxsync.upload_packed
    monkeypatch.setattr(jaxsync, "upload_packed", lambda f, **k: calls.append(f) or real(f, **k))
    px, g = _inputs()[-1]
    enc(px, g)
    assert len(calls) == 1 and set(calls[0]) == {"h", "w", "th", "tw", "seg", "item"}
    enc(px * 2, g)
    assert len(calls) == 1


def test_plan_layout():
    plan = glm4v.plan_batch([[2, 2, 4], [1, 2, 2]], CFG)
    assert (plan.num_patches, plan.padded_patches, plan.tokens_per_item) == (20, 32, (4, 1))
    f = plan.fields
    # merge-block order: block-row, block-col, inner-row, inner-col; both frames identical
    np.testing.assert_array_equal(f["h"][:16], [0, 0, 1, 1, 0, 0, 1, 1] * 2)
    np.testing.assert_array_equal(f["w"][:16], [0, 1, 0, 1, 2, 3, 2, 3] * 2)
    np.testing.assert_array_equal(f["seg"], [0] * 8 + [1] * 8 + [2] * 4 + [3] * 12)
    np.testing.assert_array_equal(f["tw"][:20], [4] * 16 + [2] * 4)
    np.testing.assert_array_equal(f["item"], [0] * 16 + [1] * 4 + [2] * 12)


def test_padding_never_changes_real_outputs(model):
    """The same batch in its tight bucket and in a 4x larger one: real rows agree."""
    grid = [[2, 6, 4], [1, 8, 8], [1, 2, 12]]  # 48 + 64 + 24 patches = 34 merged tokens
    px = ref.pixels(grid, CFG, seed=11)
    tight = glm4v.Glm4vVisionEncoder(model, group_buckets=[34])
    loose = glm4v.Glm4vVisionEncoder(model, group_buckets=[136])
    a, b = tight(px, grid), loose(px, grid)
    assert (a.embeddings.shape[0], b.embeddings.shape[0]) == (34, 136)
    assert_close(np.asarray(b.embeddings)[:34], np.asarray(a.embeddings), rtol=1e-6)
    assert_close(np.asarray(b.extras["hidden"])[:34], np.asarray(a.extras["hidden"]), rtol=1e-6)
    assert np.isfinite(np.asarray(b.embeddings)).all()


def test_device_pixels_padded_to_bucket(enc):
    grid = [[3, 4, 6]]
    px = ref.pixels(grid, CFG, seed=5)
    a = enc(jax.device_put(_padded(enc, px, grid)), grid)
    b = enc(px, grid)
    np.testing.assert_array_equal(np.asarray(a.embeddings), np.asarray(b.embeddings))
    assert a.lengths == b.lengths == (18,) and a.offsets == (0,)
    with pytest.raises(ValueError, match="padded to the bucket"):
        enc(jax.device_put(px), grid)


def test_released_config_shapes():
    """The released tower (depth 24, hidden 1536) built abstractly: nothing is allocated."""
    model = nnx.eval_shape(
        lambda: glm4v.Glm4vVisionTower(glm4v.Glm4vVisionConfig(), rngs=nnx.Rngs(0))
    )
    assert model.embeddings.position_embedding.shape == (576, 1536)
    assert model.patch_embed.proj.kernel.shape == (3 * 2 * 14 * 14, 1536)
    assert model.downsample.kernel.shape == (4 * 1536, 4096)
    assert len(model.blocks) == 24 and model.blocks[0].mlp.gate_proj.kernel.shape == (1536, 4096)


@requires_torch
def test_registered_for_verify():
    from jaxsync import registry

    names = {s.name for s in registry.paths(["glm4v"])}
    assert names == {"glm4v.vision_tower", "glm4v.pos_embeds"}
    for spec in registry.paths(["glm4v"]):
        case = spec.build(None)
        assert len(case.inputs) >= 2
        parity = case.parity()
        assert parity.ok, (spec.name, str(parity))


@pytest.mark.gpu
def test_cudnn_attention_matches_xla():
    """The GPU flash-attention path (segment mask through cuDNN) against the XLA form, bf16.

    Tolerance 2e-2: the two differ only in bf16 rounding of the attention (cuDNN keeps the
    probabilities in registers; XLA rounds them to bf16 before the value product).
    """
    if jax.default_backend() not in ("gpu", "cuda"):
        pytest.skip("cuDNN attention needs a GPU")
    cfg = glm4v.Glm4vVisionConfig(**{**ref.TINY, "hidden_size": 64, "num_heads": 4})  # H = 16
    grid = [[2, 6, 4], [1, 8, 8], [1, 2, 12]]
    px = ref.pixels(grid, cfg, seed=3)
    outs = []
    for impl in ("xla", "cudnn"):
        model = glm4v.Glm4vVisionTower(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), attention=impl)
        assert model.blocks[0].attn.impl == impl
        outs.append(np.asarray(glm4v.Glm4vVisionEncoder(model)(px, grid).embeddings, np.float32))
    assert rel_err(outs[1], outs[0]) <= 2e-2
