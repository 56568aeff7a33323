"""Voxtral configs as transformers' own tester builds them, read from `config.json` by our loader
and matched against transformers; the keys accepted at any value (`IGNORED_FIELDS`) leave
transformers' result unchanged, and keys that do change it are still refused."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

import jaxsync
from jaxsync._jit import jit_method
from jaxsync.harness.paths.voxtral import reference as ref
from jaxsync.models.voxtral import MelConfig, VoxtralAudioConfig, load_model
from jaxsync.models.voxtral._config import IGNORED_FIELDS
from jaxsync.testing import rel_err, requires_torch


pytestmark = requires_torch

RTOL = 1e-5
# transformers tests/models/voxtral/test_modeling_voxtral.py, `VoxtralModelTester` (the version
# with explicit sub-config dicts): its `__init__` defaults, passed by `get_config` as
# `VoxtralConfig(text_config=..., audio_config=..., ignore_index=-100, audio_token_id=0)`.
TESTER_TEXT = {
    "model_type": "llama", "intermediate_size": 36, "initializer_range": 0.02, "hidden_size": 32,
    "max_position_embeddings": 52, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "use_labels": True, "use_mrope": False, "vocab_size": 99,
    "head_dim": 8, "pad_token_id": 0,
}  # fmt: skip
TESTER_AUDIO = {
    "model_type": "voxtral_encoder", "hidden_size": 16, "num_attention_heads": 4,
    "intermediate_size": 16, "num_hidden_layers": 2, "num_mel_bins": 80,
    "max_source_positions": 30, "initializer_range": 0.02,
}  # fmt: skip
TESTER_TOP = {"ignore_index": -100, "audio_token_id": 0}
# Every ignored key at a value other than transformers' default.
ODD = {
    "outer": {"vocab_size": 5, "pad_token_id": 3, "ignore_index": -1},
    "audio": {"dropout": 0.3, "attention_dropout": 0.3, "activation_dropout": 0.3,
              "layerdrop": 0.3, "initializer_range": 0.5, "vocab_size": 7,
              "scale_embedding": True},
}  # fmt: skip


def _hf_config(audio=None, **top):
    from transformers import VoxtralConfig

    return VoxtralConfig(
        text_config=dict(TESTER_TEXT),
        audio_config={**TESTER_AUDIO, **(audio or {})},
        **{**TESTER_TOP, **top},
    )


def _model(hf_cfg, state=None):
    """transformers' model of `hf_cfg` in eval mode: audio weights random and O(1), or `state`."""
    import torch
    from transformers import VoxtralForConditionalGeneration

    torch.manual_seed(0)
    model = VoxtralForConditionalGeneration(hf_cfg).float().eval()
    if state is not None:
        model.load_state_dict(state)
        return model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "audio_tower" in name or "multi_modal_projector" in name:
                base = 1.0 if p.ndim == 1 and "norm" in name and name.endswith("weight") else 0.0
                scale = 0.2 if p.ndim == 1 else 1 / math.sqrt(p[0].numel())
                p.copy_(base + scale * torch.randn_like(p))
    return model


def _mel(chunks: int, cfg: VoxtralAudioConfig) -> np.ndarray:
    shape = (chunks, cfg.num_mel_bins, cfg.chunk_frames)
    return np.random.default_rng(chunks).uniform(-1.0, 2.0, shape).astype(np.float32)


@pytest.fixture(scope="module")
def tester(tmp_path_factory):
    hf_cfg = _hf_config()
    return hf_cfg, _model(hf_cfg), tmp_path_factory.mktemp("voxtral_tester")


def test_tester_config_matches_transformers_through_the_loader(tester):
    hf_cfg, model, path = tester
    jaxsync.testing.save_torch_state(model, path / "model.safetensors")
    hf_cfg.to_json_file(str(path / "config.json"))
    assert "ignore_index" in (path / "config.json").read_text()  # saved as the tester builds it
    tower = load_model(path)  # the config comes from config.json
    cfg = tower.cfg
    assert (cfg.hidden_size, cfg.frames_per_token, cfg.chunk_frames) == (16, 1, 60)
    assert (cfg.num_mel_bins, cfg.text_hidden_size) == (80, 32)
    mel = _mel(2, cfg)
    want_enc, want_emb = ref.torch_audio_features(model, mel)
    enc = jit_method(tower, "encode")(jnp.asarray(mel))
    emb = jit_method(tower, "audio_features")(jnp.asarray(mel))
    assert rel_err(enc, want_enc) <= RTOL and rel_err(emb, want_emb) <= RTOL


def test_ignored_keys_leave_transformers_result_unchanged(tester):
    hf_cfg, model, _ = tester
    odd = _hf_config(ODD["audio"], **ODD["outer"])
    assert VoxtralAudioConfig.from_hf_config(odd) == VoxtralAudioConfig.from_hf_config(hf_cfg)
    saved = odd.to_dict()
    for key, value in {**ODD["outer"], **ODD["audio"]}.items():
        assert value in (saved.get(key), saved["audio_config"].get(key)), key  # really non-default
    # every listed key is exercised here
    assert set(ODD["outer"]) == IGNORED_FIELDS.outer and set(ODD["audio"]) == IGNORED_FIELDS.audio
    mel = _mel(1, VoxtralAudioConfig.from_hf_config(hf_cfg))
    got = ref.torch_audio_features(_model(odd, model.state_dict()), mel)
    for a, b in zip(got, ref.torch_audio_features(model, mel), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "audio, top, match",
    [
        ({"activation_function": "quick_gelu"}, {}, "activation_function"),
        ({}, {"projector_hidden_act": "silu"}, "projector_hidden_act"),
    ],
)
def test_keys_that_change_the_result_are_refused(tester, audio, top, match):
    hf_cfg, model, _ = tester
    other = _hf_config(audio, **top)
    mel = _mel(1, VoxtralAudioConfig.from_hf_config(hf_cfg))
    got = ref.torch_audio_features(_model(other, model.state_dict()), mel)[1]
    assert rel_err(got, ref.torch_audio_features(model, mel)[1]) > 1e-3  # the control
    with pytest.raises(ValueError, match=match):
        VoxtralAudioConfig.from_hf_config(other)


def test_feature_extractor_attributes_it_never_applies_are_accepted():
    from transformers import WhisperFeatureExtractor

    plain = WhisperFeatureExtractor(feature_size=80)
    saved = WhisperFeatureExtractor(feature_size=80, do_normalize=True, return_attention_mask=True)
    assert saved.do_normalize and "do_normalize" in saved.to_dict()
    audio = ref.noisy_audio(3001, 0)
    np.testing.assert_array_equal(  # transformers computes the same features with them
        ref.processor_features(saved, audio, 40), ref.processor_features(plain, audio, 40)
    )
    assert MelConfig.from_feature_extractor(saved) == MelConfig.from_feature_extractor(plain)


def test_feature_extractor_attributes_that_change_features_are_refused():
    from transformers import WhisperFeatureExtractor

    with pytest.raises(ValueError, match="preemphasis"):  # unknown to the front end
        MelConfig.from_feature_extractor(WhisperFeatureExtractor(feature_size=80, preemphasis=0.9))
    fe = WhisperFeatureExtractor(feature_size=80)
    fe.n_samples = 16000  # pads to 1 s windows instead of 30 s
    with pytest.raises(ValueError, match="n_samples"):
        MelConfig.from_feature_extractor(fe)
