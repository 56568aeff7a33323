"""The GLM-4.1V vision tower at transformers' own tester config (the full `Glm4vConfig`, saved as
`config.json` and read by our loader) matched against transformers; the keys accepted at any
value (`IGNORED_FIELDS`) leave transformers' result unchanged, and keys that change it are
still refused."""

from __future__ import annotations

import numpy as np
import pytest

from jaxsync.models import glm4v
from jaxsync.models.glm4v._config import IGNORED_FIELDS
from jaxsync.testing import assert_close, requires_torch


pytestmark = requires_torch

from jaxsync.harness.paths.glm4v import reference as ref  # noqa: E402


# transformers tests/models/glm4v/test_modeling_glm4v.py, `Glm4vVisionText2TextModelTester`:
# its `__init__` defaults as `get_config` passes them to `Glm4vConfig`.
TESTER_TEXT = {
    "vocab_size": 99, "hidden_size": 16, "intermediate_size": 22, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "output_channels": 64,
    "hidden_act": "silu", "max_position_embeddings": 512,
    "rope_parameters": {"type": "default", "mrope_section": [2, 1, 1]}, "rope_theta": 10000,
    "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
}  # fmt: skip
TESTER_VISION = {
    "depth": 2, "hidden_act": "silu", "hidden_size": 48, "out_hidden_size": 16,
    "intermediate_size": 22, "patch_size": 14, "spatial_merge_size": 1, "temporal_patch_size": 2,
}  # fmt: skip
TESTER_TOP = dict(
    image_token_id=7, video_token_id=8, video_start_token_id=3, video_end_token_id=4,
    image_start_token_id=5, image_end_token_id=6,
)  # fmt: skip
# The tester's images: 112 x 112 pixels, patch 14 -> an 8 x 8 grid; plus a two-frame video.
GRID = [[1, 8, 8], [2, 2, 4]]
ODD = {
    "attention_dropout": 0.3,
    "initializer_range": 0.5,
    "hidden_dropout_prob": 0.4,
}  # every ignored key, non-default


def _hf_config(**vision):
    from transformers import Glm4vConfig

    return Glm4vConfig(
        text_config=dict(TESTER_TEXT), vision_config={**TESTER_VISION, **vision}, **TESTER_TOP
    )


def _vision_model(full, state=None):
    vision = full.vision_config
    vision._attn_implementation = "eager"
    model = ref.build_reference(vision, seed=2)
    if state is not None:
        model.load_state_dict(state)
    return model


@pytest.fixture(scope="module")
def tester(tmp_path_factory):
    full = _hf_config()
    return full, _vision_model(full), tmp_path_factory.mktemp("glm4v_tester")


def test_tester_config_matches_transformers_through_the_loader(tester):
    full, torch_model, path = tester
    full.save_pretrained(path)
    ckpt = ref.save_checkpoint(torch_model, path / "model.safetensors")
    model = glm4v.load_model(ckpt)  # the config comes from the full config.json
    cfg = model.cfg
    assert (cfg.depth, cfg.hidden_size, cfg.num_heads, cfg.head_dim) == (2, 48, 12, 4)
    assert (cfg.spatial_merge_size, cfg.table_side, cfg.out_hidden_size) == (1, 24, 16)
    px = ref.pixels(GRID, cfg, seed=1)
    out = glm4v.Glm4vVisionEncoder(model)(px, GRID)
    hidden, merged = ref.forward(torch_model, px, GRID)
    n = out.num_tokens
    assert_close(np.asarray(out.extras["hidden"])[:n], hidden, rtol=1e-5)
    assert_close(np.asarray(out.embeddings)[:n], merged, rtol=1e-5)


def test_ignored_keys_leave_transformers_result_unchanged(tester):
    full, torch_model, _ = tester
    odd = _hf_config(**ODD)
    read = glm4v.Glm4vVisionConfig.from_hf_config
    assert read(odd) == read(full)
    assert all(odd.vision_config.to_dict()[k] == v for k, v in ODD.items())  # really saved
    cfg = read(full)
    px = ref.pixels(GRID, cfg, seed=3)
    got = ref.forward(_vision_model(odd, torch_model.state_dict()), px, GRID)
    for a, b in zip(got, ref.forward(torch_model, px, GRID), strict=True):
        np.testing.assert_array_equal(a, b)
    assert set(ODD) == IGNORED_FIELDS  # every listed key is exercised here


@pytest.mark.parametrize(
    "vision, match",
    [
        ({"hidden_act": "mish"}, "hidden_act 'mish'"),
        ({"rope_parameters": {"rope_type": "axial", "rope_theta": 100.0, "factor": 2.0}}, "axial"),
        ({"window_size": 7}, "window_size"),
    ],
)
def test_keys_it_does_not_implement_are_refused(vision, match):
    with pytest.raises(ValueError, match=match):
        glm4v.Glm4vVisionConfig.from_hf_config(_hf_config(**vision))
