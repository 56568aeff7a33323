"""Configs as transformers 4.x saved them: every (sub-)config carries `PretrainedConfig`'s own keys
at their defaults (`LEGACY_DEFAULTS`), and every family reads them as the current form; the same
keys at a value that changes the model are refused."""

import json

import pytest

from jaxsync.hfconfig import LEGACY_DEFAULTS, unhandled_fields


def _families() -> dict:
    """family -> (parser, a full config dict as transformers' current class saves it)."""
    transformers = pytest.importorskip("transformers")
    from jaxsync.models.chameleon import ChameleonConfig
    from jaxsync.models.gemma3n import from_hf_config as gemma3n
    from jaxsync.models.glm4v import Glm4vVisionConfig
    from jaxsync.models.qwen3_omni import Qwen3OmniAudioConfig
    from jaxsync.models.voxtral import VoxtralAudioConfig

    return {
        "chameleon": (ChameleonConfig.from_hf_config, transformers.ChameleonConfig()),
        "gemma3n": (gemma3n, transformers.Gemma3nConfig()),
        "glm4v": (Glm4vVisionConfig.from_hf_config, transformers.Glm4vConfig()),
        "qwen3_omni": (Qwen3OmniAudioConfig.from_hf_config, transformers.Qwen3OmniMoeConfig()),
        "voxtral": (VoxtralAudioConfig.from_hf_config, transformers.VoxtralConfig()),
    }


def _as_saved_by_4x(d: dict) -> dict:
    """`d` with `LEGACY_DEFAULTS` in it and in every nested config, as 4.x `to_dict` wrote."""
    nested = {k: _as_saved_by_4x(v) if k.endswith("_config") and v else v for k, v in d.items()}
    return {**LEGACY_DEFAULTS, **nested}


def _json(d: dict) -> dict:
    return json.loads(json.dumps(d))


FAMILIES = ["chameleon", "gemma3n", "glm4v", "qwen3_omni", "voxtral"]


@pytest.mark.parametrize("family", FAMILIES)
def test_configs_saved_by_transformers_4x_read_as_the_current_form(family):
    parse, hf = _families()[family]
    current = _json(hf.to_dict())
    assert parse(_json(_as_saved_by_4x(current))) == parse(current)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    ("key", "value"),
    [("pruned_heads", {"0": [1]}), ("add_cross_attention", True), ("tie_encoder_decoder", True)],
)
def test_legacy_keys_that_change_the_model_are_refused(family, key, value):
    parse, hf = _families()[family]
    saved = _as_saved_by_4x(_json(hf.to_dict()))
    # the tower's own config: where the family reads its fields
    sub = {"chameleon": "vq_config", "gemma3n": "audio_config", "glm4v": "vision_config",
           "voxtral": "audio_config"}.get(family)  # fmt: skip
    if family == "qwen3_omni":
        saved["thinker_config"]["audio_config"][key] = value
    else:
        saved[sub][key] = value
    with pytest.raises(ValueError, match=key):
        parse(saved)


def test_legacy_defaults_pass_only_at_their_value():
    assert unhandled_fields(dict(LEGACY_DEFAULTS), {}, ()) == {}
    assert unhandled_fields({"pruned_heads": {"1": [0]}, "is_decoder": True}, {}, ()) == {
        "pruned_heads": {"1": [0]},
        "is_decoder": True,
    }
    # a family's own default for the key wins over the legacy one
    assert unhandled_fields({"pad_token_id": 0}, {"pad_token_id": 0}, ()) == {}
    assert unhandled_fields({"pad_token_id": None}, {"pad_token_id": 0}, ()) == {
        "pad_token_id": None
    }


def test_legacy_defaults_are_what_transformers_keeps():
    """Current transformers keeps these keys when it loads an old config (so they reach the
    parsers through `to_dict()` too)."""
    transformers = pytest.importorskip("transformers")
    loaded = transformers.PretrainedConfig.from_dict(dict(LEGACY_DEFAULTS)).to_dict()
    kept = {k for k in LEGACY_DEFAULTS if k in loaded}
    token_ids = {"bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"}
    assert kept >= set(LEGACY_DEFAULTS) - token_ids


def test_released_glm4v_vision_config_reads():
    """The released GLM-4.1V `config.json`'s vision config (`hidden_dropout_prob` included)."""
    from jaxsync.models.glm4v import Glm4vVisionConfig

    released = {
        "model_type": "glm4v_vision", "hidden_size": 1536, "depth": 24, "num_heads": 12,
        "attention_bias": False, "intermediate_size": 13696, "hidden_act": "silu",
        "hidden_dropout_prob": 0.0, "initializer_range": 0.02, "image_size": 336,
        "patch_size": 14, "out_hidden_size": 4096, "rms_norm_eps": 1e-05,
        "spatial_merge_size": 2, "temporal_patch_size": 2,
    }  # fmt: skip
    assert Glm4vVisionConfig.from_hf_config({"vision_config": released}) == Glm4vVisionConfig()
