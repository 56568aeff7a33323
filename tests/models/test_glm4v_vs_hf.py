"""GLM-4.1V vision tower vs transformers `Glm4vVisionModel`; weights via the production loader."""

from __future__ import annotations

import numpy as np
import pytest

from jaxsync.testing import assert_close, rel_err, requires_torch


pytestmark = requires_torch

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxsync.harness.paths.glm4v import reference as ref  # noqa: E402
from jaxsync.models import glm4v  # noqa: E402


# Square at the table size (6x6), non-square, larger and smaller than the table, several images
# in one batch, and videos (t > 1) mixed with images.
BATCHES = {
    "table_size": [[1, 6, 6]],
    "non_square_batch": [[1, 4, 8], [1, 10, 6], [1, 2, 2]],
    "video": [[3, 4, 6]],
    "mixed": [[2, 6, 4], [1, 8, 8], [1, 2, 12]],
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = ref.hf_config(**ref.TINY)
    torch_model = ref.build_reference(hf, seed=0)
    cfg = glm4v.Glm4vVisionConfig.from_hf_config(hf)
    ckpt = ref.save_checkpoint(torch_model, tmp_path_factory.mktemp("glm4v") / "m.safetensors")
    encoder = glm4v.Glm4vVisionEncoder(glm4v.load_model(ckpt, cfg))
    return hf, torch_model, cfg, ckpt, encoder


def test_config_from_hf(tiny):
    hf, _, cfg, _, _ = tiny
    assert (cfg.hidden_size, cfg.num_heads, cfg.table_side, cfg.out_hidden_size) == (48, 4, 6, 29)
    assert cfg.attention_bias and cfg.rope_theta == 10000.0
    assert glm4v.Glm4vVisionConfig.from_hf_config(ref.hf_config()) == glm4v.Glm4vVisionConfig()


def test_config_rejects_unsupported_fields():
    hf = ref.hf_config(**ref.TINY)
    hf.window_size = 7  # a field this port does not implement
    with pytest.raises(ValueError, match="window_size"):
        glm4v.Glm4vVisionConfig.from_hf_config(hf)
    hf = ref.hf_config(**ref.TINY)
    hf.rope_parameters = {"rope_type": "axial", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(ValueError, match="axial"):
        glm4v.Glm4vVisionConfig.from_hf_config(hf)
    with pytest.raises(ValueError, match="multiple of 4"):
        glm4v.Glm4vVisionConfig(hidden_size=30, num_heads=3)


# Position-embedding accuracy. The reference is torch's F.grid_sample path. Evaluated in float64
# (with float64 sampling coordinates) it is exact, and ours must be within 1e-6 absolute of it on
# an N(0, 1) table. torch's own float32 evaluation is up to ~8e-6 away from that exact value (its
# float32 coordinate chain and the cancelling far-tap cubic), so against the float32 reference we
# assert: our distance <= torch-float32's distance from the exact value + 1e-6.


@pytest.mark.parametrize("name", list(BATCHES))
def test_pos_embeds_match_grid_sample(tiny, name):
    _, torch_model, _, _, enc = tiny
    grid = BATCHES[name]
    n = sum(t * h * w for t, h, w in grid)
    got = np.asarray(enc.pos_embeds(grid))
    assert got.shape[0] % 4 == 0 and got.shape[0] >= n
    exact = ref.exact_pos_embeds(torch_model, grid, 2)
    torch32 = ref.pos_embeds(torch_model, grid, 2)  # transformers' Glm4vVisionEmbeddings, fp32
    ours_err = np.abs(got[:n] - exact).max()
    torch_err = np.abs(torch32 - exact).max()
    assert ours_err <= 1e-6, (ours_err, torch_err)
    assert np.abs(got[:n] - torch32).max() <= torch_err + 1e-6


def test_interpolate_pos_embed_standalone_8x8():
    """The standalone kernel on an 8x8 table, jitted, at sizes below, at and above the table."""
    import torch
    import torch.nn.functional as F

    side, dim = 8, 11
    table = np.random.default_rng(3).standard_normal((side * side, dim)).astype(np.float32)
    fn = jax.jit(glm4v.interpolate_pos_embed)
    t2d = torch.from_numpy(table).view(side, side, dim).permute(2, 0, 1)[None]
    for h, w in [(8, 8), (6, 10), (16, 4), (2, 2), (30, 22)]:
        rows, cols = (a.ravel() for a in np.meshgrid(np.arange(h), np.arange(w), indexing="ij"))
        th, tw = np.full(rows.shape, h), np.full(rows.shape, w)
        got = np.asarray(fn(table, rows, cols, th, tw))
        exact = ref.grid_sample_exact(table, rows, cols, th, tw)
        grid = torch.stack(
            [((torch.from_numpy(c) + 0.5) / s) * 2 - 1 for c, s in ((cols, w), (rows, h))], -1
        )[None, :, None, :].float()
        torch32 = F.grid_sample(
            t2d, grid, mode="bicubic", align_corners=False, padding_mode="border"
        )[0, :, :, 0].T.numpy()
        assert np.abs(got - exact).max() <= 1e-6, (h, w)
        assert np.abs(got - torch32).max() <= np.abs(torch32 - exact).max() + 1e-6, (h, w)
    # jax.image.resize's bicubic (Keys a = -0.5, antialiased) is measurably different, so the
    # comparisons above can tell the kernels apart.
    wrong = jax.image.resize(table.reshape(side, side, dim), (h, w, dim), "bicubic")
    assert np.abs(np.asarray(wrong).reshape(h * w, dim) - got).max() > 1e-3


@pytest.mark.parametrize("layout", ["dense", "segments", "ragged"])
@pytest.mark.parametrize("name", list(BATCHES))
def test_tower_fp32(tiny, name, layout):
    _, torch_model, cfg, _, enc = tiny
    if layout != "dense":
        enc = glm4v.Glm4vVisionEncoder(glm4v.load_model(tiny[3], cfg), layout=layout)
    grid = BATCHES[name]
    px = ref.pixels(grid, cfg, seed=len(name))
    out = enc(px, grid)
    hidden, merged = ref.forward(torch_model, px, grid)
    n = out.num_tokens
    assert out.embeddings.shape[0] >= n == merged.shape[0]
    assert_close(np.asarray(out.extras["hidden"])[:n], hidden, rtol=1e-5, err_msg=f"{name} hidden")
    assert_close(np.asarray(out.embeddings)[:n], merged, rtol=1e-5, err_msg=f"{name} merged")
    # Per-item split follows grid_thw (videos: t*h*w/4 tokens each).
    parts = out.split()
    assert [p.shape[0] for p in parts] == [t * h * w // 4 for t, h, w in grid]
    assert_close(np.asarray(parts[-1]), merged[n - parts[-1].shape[0] :], rtol=1e-5)


def test_tower_bf16(tiny):
    """bf16 weights and activations vs the fp32 reference.

    Tolerance 4e-2 (max-norm relative): bf16 keeps 8 mantissa bits (2^-8 ~ 4e-3 per rounding) and
    two blocks plus the merger chain ~10 rounded matmuls; transformers' own bf16 tower lands in the
    same range (asserted below, so a regression of ours is visible relative to it).
    """
    import torch

    hf, torch_model, cfg, ckpt, _ = tiny
    enc = glm4v.Glm4vVisionEncoder(glm4v.load_model(ckpt, cfg, dtype=jnp.bfloat16))
    grid = BATCHES["non_square_batch"]
    px = ref.pixels(grid, cfg, seed=7)
    out = enc(px, grid)
    assert out.embeddings.dtype == jnp.bfloat16
    _, want = ref.forward(torch_model, px, grid)
    ours = rel_err(np.asarray(out.embeddings.astype(jnp.float32))[: out.num_tokens], want)
    torch_bf16 = ref.build_reference(hf, seed=0, dtype=torch.bfloat16)
    theirs = rel_err(ref.forward(torch_bf16, px, grid)[1], want)
    assert ours <= 4e-2, (ours, theirs)
    assert ours <= 2 * theirs + 1e-3, (ours, theirs)


def test_tiny_config_without_transformers_matches_the_hf_one():
    from jaxsync.models.glm4v import Glm4vVisionConfig

    assert Glm4vVisionConfig(**ref.TINY) == Glm4vVisionConfig.from_hf_config(
        ref.hf_config(**ref.TINY)
    )


def test_config_sources_and_defaults(tmp_path):
    """An HF object, its dict, a full Glm4vConfig, and a checkpoint directory give one config;
    the product's copy of the HF defaults matches the transformers class."""
    import json

    from transformers import Glm4vConfig, Glm4vVisionConfig as HfConfig

    from jaxsync.models.glm4v._config import HF_DEFAULTS

    default = HfConfig().to_dict()
    assert {k: default[k] for k in HF_DEFAULTS} == HF_DEFAULTS
    hf = ref.hf_config(**ref.TINY)
    want = glm4v.Glm4vVisionConfig(**ref.TINY)
    full = Glm4vConfig(vision_config=hf.to_dict())
    (tmp_path / "config.json").write_text(json.dumps(full.to_dict()))
    for src in (hf, hf.to_dict(), full, full.to_dict(), tmp_path, str(tmp_path)):
        assert glm4v.Glm4vVisionConfig.from_hf_config(src) == want


def test_glm45v_tower_is_the_same_module(tiny):
    """GLM-4.5V's (MoE) vision config is accepted: its tower computes what GLM-4.1V's does."""
    import transformers

    _, torch_model, cfg, ckpt, enc = tiny
    moe_cfg = transformers.Glm4vMoeVisionConfig(**ref.TINY)
    moe_cfg._attn_implementation = "eager"
    moe = transformers.Glm4vMoeVisionModel(moe_cfg).eval()
    moe.load_state_dict(torch_model.state_dict())
    assert glm4v.Glm4vVisionConfig.from_hf_config(moe_cfg) == cfg
    grid = [[1, 4, 6], [2, 2, 2]]
    px = ref.pixels(grid, cfg, seed=5)
    out = enc(px, grid)
    assert_close(
        np.asarray(out.embeddings)[: out.num_tokens], ref.forward(moe, px, grid)[1], rtol=1e-5
    )


def test_other_glm_vision_towers_are_refused():
    """GLM-OCR's vision config has the same fields but other math (q/k norms, MLP biases)."""
    import transformers

    ocr = transformers.GlmOcrVisionConfig(**ref.TINY)
    assert any("q_norm" in k for k in transformers.GlmOcrVisionModel(ocr).state_dict())
    for src in (ocr, ocr.to_dict(), transformers.GlmOcrConfig(vision_config=ocr.to_dict())):
        with pytest.raises(ValueError, match="glm_ocr_vision"):
            glm4v.Glm4vVisionConfig.from_hf_config(src)
