"""Hostile Qwen3-Omni audio encoder construction: bad encoder arguments, planner and helper
inputs, config values and sources, and corrupt or mismatched checkpoints, each refused with a
typed error naming the problem."""

from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from jaxsync.harness.paths.qwen3_omni import reference as ref
from jaxsync.models import qwen3_omni as q3
from jaxsync.weights import WeightError


CFG = ref.TINY
F = CFG.num_mel_bins


# ---------------------------------------------------------------- encoder construction


def test_bad_encoder_arguments():
    tower = q3.Qwen3OmniAudioTower(CFG, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="Qwen3OmniAudioTower"):
        q3.Qwen3OmniAudioEncoder(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(TypeError, match="placement"):
        q3.Qwen3OmniAudioEncoder(tower, placement="cpu")
    with pytest.raises(TypeError, match="integers"):
        q3.Qwen3OmniAudioEncoder(tower, window_buckets=[4.0, 8.0])
    with pytest.raises(ValueError, match="ascending"):
        q3.Qwen3OmniAudioEncoder(tower, window_buckets=[8, 4])
    with pytest.raises(ValueError, match="maxsize"):
        q3.Qwen3OmniAudioEncoder(tower, plan_cache_size=0)
    small = q3.Qwen3OmniAudioEncoder(tower, window_buckets=[2])
    f = ref.random_features(CFG, [450])  # 5 chunks -> 3 windows of 2 chunks > bucket 2
    with pytest.raises(ValueError):
        small(f, [450])


def test_planner_and_helpers_refuse_non_integers():
    with pytest.raises(TypeError, match="num_frames"):
        q3.plan([120], CFG, num_frames=120.0)
    with pytest.raises(TypeError, match="integers"):
        q3.pad_features(np.zeros((F, 3), np.float32), [3.0])
    with pytest.raises(ValueError, match="feature_lens sum to 4"):
        q3.pad_features(np.zeros((F, 3), np.float32), [4])


# ---------------------------------------------------------------- configs


@pytest.mark.parametrize(
    "field, value, exc",
    [
        ("encoder_layers", True, TypeError),
        ("encoder_layers", 2.0, TypeError),
        ("d_model", np.float64(42), TypeError),
        ("num_mel_bins", np.bool_(True), TypeError),
        ("output_dim", "29", TypeError),
        ("encoder_layers", 0, ValueError),
        ("n_window_infer", -1, ValueError),
        ("activation_function", 1, TypeError),
    ],
)
def test_bad_config_values(field, value, exc):
    kwargs = {**CFG.__dict__, field: value}
    with pytest.raises(exc, match=field):
        q3.Qwen3OmniAudioConfig(**kwargs)
    with pytest.raises(exc, match=field):
        q3.Qwen3OmniAudioConfig.from_hf_config(kwargs)


def test_bad_config_sources(tmp_path):
    with pytest.raises(TypeError, match="HF config"):
        q3.Qwen3OmniAudioConfig.from_hf_config(42)
    with pytest.raises(WeightError, match="no config.json in"):
        q3.Qwen3OmniAudioConfig.from_hf_config(tmp_path)  # a directory without config.json
    with pytest.raises(ValueError, match="unsupported"):
        q3.Qwen3OmniAudioConfig.from_hf_config({"audio_config": {"use_flash": True}})


# ---------------------------------------------------------------- weights


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("torch")
    model = ref.build_hf_encoder(CFG)
    return ref.save_hf_encoder(
        model, tmp_path_factory.mktemp("q3h") / "model.safetensors", "thinker.audio_tower."
    )


def test_bad_weights(checkpoint, tmp_path):
    data = Path(checkpoint).read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightError):
        q3.load_model(tmp_path / "cut.safetensors", CFG)
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(WeightError):
        q3.load_model(tmp_path / "junk.safetensors", CFG)
    with pytest.raises(ValueError, match="config.json"):
        q3.load_model(checkpoint)  # no config.json next to it: cfg is needed
    with pytest.raises(TypeError, match="Qwen3OmniAudioConfig"):
        q3.load_model(checkpoint, CFG.__dict__)
    other = q3.Qwen3OmniAudioConfig(**{**CFG.__dict__, "encoder_ffn_dim": 59})
    with pytest.raises(WeightError, match="shape"):
        q3.load_model(checkpoint, other)
    with pytest.raises(WeightError):
        q3.load_model(tmp_path / "missing.safetensors", CFG)
