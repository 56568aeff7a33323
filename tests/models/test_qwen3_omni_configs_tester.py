"""The Qwen3-Omni audio encoder at transformers' own tester config (the full thinker config,
saved as `config.json` and read by our loader) matched against transformers; the keys accepted
at any value (`IGNORED_FIELDS`) leave transformers' result unchanged, and keys we do not
implement are still refused."""

from __future__ import annotations

import pytest

import jaxsync
from jaxsync.models import qwen3_omni as q3
from jaxsync.models.qwen3_omni._config import IGNORED_FIELDS
from jaxsync.testing import assert_close, requires_torch


pytestmark = requires_torch

from jaxsync.harness.paths.qwen3_omni import reference as ref  # noqa: E402


# transformers tests/models/qwen3_omni_moe/test_modeling_qwen3_omni_moe.py,
# `Qwen3OmniMoeThinkerForConditionalGenerationTester`: its `__init__` as `get_config` passes it to
# `Qwen3OmniMoeThinkerConfig`.
TESTER_AUDIO = {
    "d_model": 32, "encoder_attention_heads": 4, "encoder_ffn_dim": 32, "encoder_layers": 2,
    "num_mel_bins": 20, "max_source_positions": 1500, "initializer_range": 0.02,
    "downsample_hidden_size": 32, "n_window": 50, "output_dim": 32, "n_window_infer": 100,
}  # fmt: skip
TESTER_VISION = {
    "depth": 2, "embed_dim": 32, "hidden_act": "quick_gelu", "hidden_size": 32,
    "out_hidden_size": 32, "intermediate_size": 24, "mlp_ratio": 4, "num_heads": 4,
    "patch_size": 16, "spatial_merge_size": 1, "temporal_patch_size": 2,
    "initializer_range": 0.02, "deepstack_visual_indexes": [1],
}  # fmt: skip
TESTER_TEXT = {
    "rope_parameters": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default",
                        "interleaved": True},
    "vocab_size": 99, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-06, "use_cache": True,
    "tie_word_embeddings": False, "rope_theta": 1000000.0, "use_sliding_window": False,
    "sliding_window": 50, "max_window_layers": 3, "attention_dropout": 0.0, "pad_token_id": 0,
    "initializer_range": 0.02, "moe_intermediate_size": 32, "num_experts_per_tok": 2,
    "num_experts": 8, "decoder_sparse_step": 1,
}  # fmt: skip
TESTER_TOP = dict(
    audio_token_id=1, image_token_id=2, video_token_id=3, position_id_per_seconds=13,
    seconds_per_chunk=2, audio_start_token_id=4, audio_end_token_id=5, vision_start_token_id=7,
    vision_end_token_id=8, user_token_id=6, initializer_range=0.02,
)  # fmt: skip
LENS = [230, 17]  # mel frames: three chunks (one per attention window) and a short one
# Every ignored key at a non-default value (`conv_chunksize=1`: one chunk per conv loop).
ODD = dict(dropout=0.3, attention_dropout=0.3, activation_dropout=0.3, initializer_range=0.5,
           conv_chunksize=1)  # fmt: skip


def _hf_config(**audio):
    from transformers import Qwen3OmniMoeThinkerConfig

    return Qwen3OmniMoeThinkerConfig(
        audio_config={**TESTER_AUDIO, **audio}, vision_config=dict(TESTER_VISION),
        text_config=dict(TESTER_TEXT), **TESTER_TOP,
    )  # fmt: skip


def _encoder(thinker, state):
    """transformers' audio encoder of `thinker`'s audio config, in eval mode, holding `state`."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeAudioEncoder,
    )

    model = Qwen3OmniMoeAudioEncoder(thinker.audio_config).float().eval()
    model.load_state_dict(state)
    return model


@pytest.fixture(scope="module")
def tester(tmp_path_factory):
    thinker = _hf_config()
    cfg = q3.Qwen3OmniAudioConfig.from_hf_config(thinker)
    state = ref.build_hf_encoder(cfg, seed=3).state_dict()  # random O(1) weights of that shape
    return thinker, _encoder(thinker, state), tmp_path_factory.mktemp("qwen3_omni_tester")


def test_tester_config_matches_transformers_through_the_loader(tester):
    thinker, model, path = tester
    thinker.save_pretrained(path)
    ref.save_hf_encoder(model, path / "model.safetensors", "audio_tower.")
    tower = q3.load_model(path)  # the config comes from the thinker's config.json
    cfg = tower.cfg
    assert (cfg.num_mel_bins, cfg.d_model, cfg.chunks_per_window, cfg.output_dim) == (20, 32, 1, 32)
    x = ref.random_features(cfg, LENS, seed=1)
    out = q3.Qwen3OmniAudioEncoder(tower)(jaxsync.async_h2d(q3.pad_features(x, LENS)), LENS)
    for got, want in zip(out.split(), ref.reference_outputs(model, x, LENS), strict=True):
        assert_close(got, want, rtol=1e-5)


def test_ignored_keys_leave_transformers_result_unchanged(tester):
    thinker, model, _ = tester
    odd = _hf_config(**ODD)
    read = q3.Qwen3OmniAudioConfig.from_hf_config
    assert read(odd) == read(thinker)
    assert all(odd.audio_config.to_dict()[k] == v for k, v in ODD.items())  # really saved
    x = ref.random_features(read(thinker), LENS, seed=2)
    got = ref.reference_outputs(_encoder(odd, model.state_dict()), x, LENS)
    for a, b in zip(got, ref.reference_outputs(model, x, LENS), strict=True):
        assert_close(a, b, rtol=1e-6)  # torch's conv rounds batches of other sizes differently
    assert set(ODD) == IGNORED_FIELDS  # every listed key is exercised here


@pytest.mark.parametrize(
    "audio, match",
    [
        (dict(scale_embedding=True), "scale_embedding"),  # transformers sets but never applies it
        (dict(n_window=40), "n_window"),  # 80-frame chunks: upstream's 13 tokens per chunk break
        (dict(use_flash_attention=True), "use_flash_attention"),  # not a field we know
    ],
)
def test_keys_it_does_not_implement_are_refused(audio, match):
    with pytest.raises(ValueError, match=match):
        q3.Qwen3OmniAudioConfig.from_hf_config(_hf_config(**audio))
