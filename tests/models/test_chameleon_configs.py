"""Chameleon VQ tokenizer vs transformers at VQ configs the main parity tests do not use: an
`attn_type` other than "vanilla" (upstream then builds no attention block at all, neither at
`attn_resolutions` nor in the mid block), through the production loader."""

import numpy as np
import pytest

from jaxsync.testing import rel_err, requires_torch


pytestmark = requires_torch

import jax.numpy as jnp  # noqa: E402

from jaxsync.harness.paths.chameleon import reference as ref  # noqa: E402
from jaxsync.models.chameleon import ChameleonImageEncoder  # noqa: E402


# 8x8 pixels, two levels -> 4x4 = 16 tokens; attn_resolutions names both grids, so a port that
# ignored attn_type would add attention at every level.
SMALL = dict(
    embed_dim=5,
    num_embeddings=13,
    latent_channels=7,
    resolution=8,
    channel_multiplier=[1, 2],
    attn_resolutions=[8, 4],
)


@pytest.mark.parametrize("attn_type", ["linear", "none"])
def test_non_vanilla_attn_type_has_no_attention_as_upstream(tmp_path, attn_type):
    hf_cfg = ref.tiny_hf_config(**SMALL, attn_type=attn_type)
    model = ref.build_hf_model(hf_cfg, seed=2)
    ref.save_checkpoint(model, str(tmp_path))
    model.config.save_pretrained(tmp_path)
    enc = ChameleonImageEncoder.from_pretrained(tmp_path, buckets=(4,))
    assert enc.cfg.vq.attn_type == attn_type and not enc.cfg.vq.attention
    pixels = ref.random_pixels(3, hf_cfg["vq_config"], seed=1)
    want = ref.hf_image_tokens(model, pixels)
    latents, codes = enc.encode(jnp.asarray(pixels))
    assert rel_err(np.asarray(latents).transpose(0, 3, 1, 2), want["latents"]) <= 1e-5
    np.testing.assert_array_equal(np.asarray(codes), want["codes"])
    np.testing.assert_array_equal(np.asarray(enc.get_image_tokens(pixels)), want["tokens"])
