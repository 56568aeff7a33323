"""GLM-4.1V vision tower vs transformers at configs the main parity tests do not use: every
activation transformers' `ACT2FN` offers that the tower implements, through the production
loader (config.json read beside the checkpoint)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxsync.models._activations import ACTIVATION_NAMES
from jaxsync.testing import assert_close, requires_torch


pytestmark = requires_torch

from jaxsync.harness.paths.glm4v import reference as ref  # noqa: E402
from jaxsync.models import glm4v  # noqa: E402


# One block, head dim 12, a 4x4 table, odd output widths: small enough to compile in seconds.
SMALL = dict(
    depth=1,
    hidden_size=24,
    num_heads=2,
    image_size=28,
    patch_size=7,
    out_hidden_size=13,
    intermediate_size=11,
)
# An image larger than the table and a two-frame video in one batch.
GRID = [[1, 6, 4], [2, 2, 2]]


@pytest.mark.parametrize("act", ACTIVATION_NAMES)
def test_every_supported_activation_matches_transformers(tmp_path, act):
    hf = ref.hf_config(**SMALL, hidden_act=act)
    torch_model = ref.build_reference(hf, seed=5)
    hf.save_pretrained(tmp_path)
    ckpt = ref.save_checkpoint(torch_model, tmp_path / "model.safetensors")
    model = glm4v.load_model(ckpt)  # the config comes from config.json
    assert model.cfg.hidden_act == act
    px = ref.pixels(GRID, model.cfg, seed=1)
    out = glm4v.Glm4vVisionEncoder(model)(px, GRID)
    hidden, merged = ref.forward(torch_model, px, GRID)
    n = out.num_tokens
    assert_close(np.asarray(out.extras["hidden"])[:n], hidden, rtol=1e-5, err_msg=act)
    assert_close(np.asarray(out.embeddings)[:n], merged, rtol=1e-5, err_msg=act)


def test_unimplemented_activation_is_refused_by_name():
    with pytest.raises(ValueError, match="hidden_act 'mish' is not supported"):
        glm4v.Glm4vVisionConfig.from_hf_config(ref.hf_config(**SMALL, hidden_act="mish"))
