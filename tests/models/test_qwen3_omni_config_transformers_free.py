"""The Qwen3-Omni audio config parser reads configs identically with and without transformers:
it never imports transformers, and its kept defaults equal transformers' class."""

import json
import subprocess
import sys

import pytest


# Configs the parser accepts and configs it refuses, each judged in both processes.
CASES = {
    "empty": {},
    "released": {"model_type": "qwen3_omni_moe_audio_encoder", "output_dim": 2048},
    "defaults spelled out": {
        "scale_embedding": False,
        "conv_chunksize": 500,
        "dropout": 0.0,
        "initializer_range": 0.02,
    },
    "inert keys at other values": {"dropout": 0.1, "conv_chunksize": 7, "initializer_range": 1.0},
    "legacy generic keys": {"pruned_heads": {}, "torchscript": False, "is_decoder": False},
    "scale_embedding": {"scale_embedding": True},
    "unknown key": {"new_setting": 1},
    "pruned heads": {"pruned_heads": {"0": [1]}},
    "full config": {
        "model_type": "qwen3_omni_moe",
        "thinker_config": {
            "model_type": "qwen3_omni_moe_thinker",
            "audio_config": {"encoder_layers": 2, "d_model": 64, "encoder_attention_heads": 2},
        },
    },
}

_JUDGE = """
import json, sys
if sys.argv[1] == "hidden":
    sys.modules["transformers"] = None  # `import transformers` now raises ImportError
from jaxsync.models.qwen3_omni._config import Qwen3OmniAudioConfig
out = {}
for name, cfg in json.loads(sys.argv[2]).items():
    try:
        out[name] = repr(Qwen3OmniAudioConfig.from_hf_config(cfg))
    except (ValueError, TypeError) as e:
        out[name] = f"{type(e).__name__}: {e}"
out["transformers imported"] = sys.modules.get("transformers") is not None
print(json.dumps(out))
"""


def _judge(mode: str) -> dict:
    cmd = [sys.executable, "-c", _JUDGE, mode, json.dumps(CASES)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_same_verdicts_with_transformers_hidden():
    hidden, visible = _judge("hidden"), _judge("visible")
    assert hidden == visible
    assert hidden["transformers imported"] is False  # the parser imports no transformers
    assert hidden["released"].startswith("Qwen3OmniAudioConfig(")
    assert hidden["legacy generic keys"].startswith("Qwen3OmniAudioConfig(")
    assert hidden["inert keys at other values"].startswith("Qwen3OmniAudioConfig(")
    for refused in ("scale_embedding", "unknown key", "pruned heads"):
        assert hidden[refused].startswith("ValueError: unsupported"), hidden[refused]


def test_kept_defaults_are_transformers_defaults():
    pytest.importorskip("transformers")
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeAudioEncoderConfig,
    )

    from jaxsync.hfconfig import DROPPED_BY_TRANSFORMERS, GENERIC_FIELDS
    from jaxsync.models.qwen3_omni._config import HF_DEFAULTS

    default = Qwen3OmniMoeAudioEncoderConfig().to_dict()
    own = {k: v for k, v in default.items() if k not in GENERIC_FIELDS | DROPPED_BY_TRANSFORMERS}
    assert own == HF_DEFAULTS
