"""Broken checkpoint files are a WeightError naming the file, never a raw SafetensorError, OSError
or KeyError."""

import json
import re

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jaxsync import weights
from jaxsync.weights import Rule, WeightError


class _Pair(nnx.Module):
    def __init__(self):
        self.a = nnx.Param(np.zeros((3, 5), np.float32))
        self.b = nnx.Param(np.zeros((7,), np.float32))


RULES = [Rule("a", "a"), Rule("b", "b")]


def _sharded(tmp_path):
    rng = np.random.default_rng(0)
    save_file({"a": rng.standard_normal((3, 5)).astype(np.float32)}, tmp_path / "s1.safetensors")
    save_file({"b": rng.standard_normal(7).astype(np.float32)}, tmp_path / "s2.safetensors")
    index = {"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return tmp_path


def _truncate(file):
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 5])


def _garbage_header(file):
    data = file.read_bytes()
    file.write_bytes(data[:8] + b"\x00garbage!" + data[17:])


def _header_length_too_big(file):
    data = file.read_bytes()
    file.write_bytes((2**40).to_bytes(8, "little") + data[8:])


def _drop_shard(tmp_path):
    (tmp_path / "s2.safetensors").unlink()


def _key_not_in_shard(tmp_path):
    save_file({"c": np.zeros(7, np.float32)}, tmp_path / "s2.safetensors")


@pytest.mark.parametrize(
    "breaks, file",
    [
        (lambda d: _truncate(d / "s2.safetensors"), "s2.safetensors"),
        (lambda d: _garbage_header(d / "s1.safetensors"), "s1.safetensors"),
        (lambda d: _header_length_too_big(d / "s2.safetensors"), "s2.safetensors"),
        (_drop_shard, "s2.safetensors"),
        (_key_not_in_shard, "s2.safetensors"),
        (lambda d: (d / "model.safetensors.index.json").write_text("{"), "index.json"),
        (lambda d: (d / "model.safetensors.index.json").write_text("{}"), "index.json"),
    ],
    ids=["truncated", "garbage-header", "header-length", "missing-shard", "key-absent",
         "index-json", "index-no-weight-map"],
)  # fmt: skip
def test_broken_files_name_the_file(tmp_path, breaks, file):
    breaks(_sharded(tmp_path))
    for call in (
        lambda: weights.load_weights(_Pair, tmp_path, RULES),
        lambda: weights.checkpoint_dtype(tmp_path),
        lambda: dict(weights.read_checkpoint(tmp_path)),
    ):
        with pytest.raises(WeightError, match=re.escape(file)):
            call()


def test_intact_files_load(tmp_path):
    # The positive control of the fixture above: unbroken, the same checkpoint loads.
    net = weights.load_weights(_Pair, _sharded(tmp_path), RULES)
    assert net.a[...].shape == (3, 5)
    assert weights.checkpoint_dtype(tmp_path) == np.float32
    assert sorted(k for k, _ in weights.read_checkpoint(tmp_path)) == ["a", "b"]


def test_single_truncated_file(tmp_path):
    save_file({"a": np.zeros((3, 5), np.float32), "b": np.zeros(7, np.float32)}, tmp_path / "m.st")
    _truncate(tmp_path / "m.st")
    with pytest.raises(WeightError, match=r"unreadable safetensors file .*m\.st"):
        weights.load_weights(_Pair, tmp_path / "m.st", RULES)


# ---------------------------------------------------------------- paths the user gives

HUB_ID = "zai-org/GLM-4.1V-9B-Thinking"


def test_a_hub_id_or_missing_path_is_named_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative path that does not exist here
    for call in (
        weights.checkpoint_keys,
        weights.checkpoint_dtype,
        lambda path: weights.load_weights(_Pair, path, RULES),
    ):
        with pytest.raises(WeightError, match=f"checkpoint '{HUB_ID}' does not exist") as e:
            call(HUB_ID)
        assert "Hub ids are not downloaded" in str(e.value) and "snapshot_download" in str(e.value)


def test_a_folder_without_safetensors_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(
        WeightError, match=re.escape(f"no *.safetensors files in checkpoint folder '{tmp_path}'")
    ):
        weights.load_weights(_Pair, tmp_path, RULES)


def _non_utf8(d):
    (d / "config.json").write_bytes(b'{"a": "\xff"}')
    return d


@pytest.mark.parametrize(
    "given, match, also",
    [
        (lambda d: HUB_ID, "it does not exist. Hub ids are not downloaded", FileNotFoundError),
        (lambda d: d / "nope" / "model.safetensors", "it does not exist", FileNotFoundError),
        (lambda d: d, "no config.json in", FileNotFoundError),
        (lambda d: (d / "config.json").write_text("{not json") and d, "not valid JSON .*line 1",
         json.JSONDecodeError),
        (_non_utf8, "not UTF-8", json.JSONDecodeError),
        (lambda d: (d / "config.json").write_text("[1, 2]") and d, "holds a JSON list", ValueError),
    ],
    ids=["hub-id", "missing-file", "no-config", "broken-json", "not-utf8", "not-an-object"],
)  # fmt: skip
def test_config_read_errors_name_the_path_given(tmp_path, monkeypatch, given, match, also):
    from jaxsync import hfconfig

    monkeypatch.chdir(tmp_path)
    path = given(tmp_path)
    with pytest.raises(WeightError, match=match) as e:
        hfconfig.as_dict(path, what="Test")
    assert str(e.value).startswith(f"cannot read a Test config from {str(path)!r}: ")
    assert isinstance(e.value, also)  # what `open` / `json.load` raised, for older callers
    shown = e.value.__cause__ or (None if e.value.__suppress_context__ else e.value.__context__)
    assert shown is None  # no traceback from inside json or open


def test_config_read_from_a_checkpoint_path(tmp_path):
    from jaxsync import hfconfig

    _sharded(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "x"}')
    for path in ("config.json", "s1.safetensors", "model.safetensors.index.json", "."):
        assert hfconfig.as_dict(tmp_path / path) == {"model_type": "x"}, path


def _family_configs() -> dict:
    """Each family's module, its config class and a tiny config dict (no torch needed)."""
    import dataclasses

    from jaxsync.harness.paths.chameleon import reference as cham
    from jaxsync.harness.paths.gemma3n import reference as gem
    from jaxsync.harness.paths.glm4v import reference as glm
    from jaxsync.harness.paths.qwen3_omni import reference as qwen
    from jaxsync.harness.paths.voxtral import reference as vox
    from jaxsync.models import chameleon, gemma3n, glm4v, qwen3_omni, voxtral

    t = gem.TINY_HF
    audio = {"model_type": "voxtral_encoder", "num_mel_bins": 128, **vox.TINY_AUDIO}
    return {
        "chameleon": (chameleon, chameleon.ChameleonConfig, cham.tiny_hf_config()),
        "gemma3n": (gemma3n, gemma3n.Gemma3nAudioConfig,
                    {"audio_config": t["audio"], "text_config": t["text"], **t["top"]}),
        "glm4v": (glm4v, glm4v.Glm4vVisionConfig, dict(glm.TINY)),
        "qwen3_omni": (qwen3_omni, qwen3_omni.Qwen3OmniAudioConfig, dataclasses.asdict(qwen.TINY)),
        "voxtral": (voxtral, voxtral.VoxtralAudioConfig,
                    {"audio_config": audio, "text_config": {"hidden_size": 36}}),
    }  # fmt: skip


FAMILIES = ["chameleon", "gemma3n", "glm4v", "qwen3_omni", "voxtral"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_load_model_names_the_path_given(tmp_path, monkeypatch, family):
    module, config_class, d = _family_configs()[family]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(WeightError, match=f"'{HUB_ID}' does not exist. Hub ids are not"):
        module.load_model(HUB_ID, config_class.from_hf_config(d))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(WeightError, match="'broken/config.json' is not valid JSON"):
        module.load_model("broken")
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "no_weights" / "config.json").write_text(json.dumps(d))
    with pytest.raises(WeightError, match="no \\*.safetensors files in checkpoint folder 'no_w"):
        module.load_model("no_weights")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_load_model_without_config_json(tmp_path, monkeypatch, family):
    module, _, _ = _family_configs()[family]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "no_config").mkdir()
    with pytest.raises(WeightError, match="'no_config'.*no config.json"):
        module.load_model("no_config")
    with pytest.raises(WeightError, match="does not exist. Hub ids are not downloaded"):
        module.load_model(HUB_ID)


def test_settings_transformers_drops_are_the_ones_it_drops():
    pytest.importorskip("transformers")
    from transformers import GenerationConfig, PretrainedConfig

    from jaxsync.hfconfig import DROPPED_BY_TRANSFORMERS

    generation = set(GenerationConfig._get_default_generation_params())
    assert DROPPED_BY_TRANSFORMERS == generation | {"_commit_hash"}
    loaded = PretrainedConfig.from_dict({k: 7 for k in DROPPED_BY_TRANSFORMERS}).to_dict()
    assert not DROPPED_BY_TRANSFORMERS & set(loaded)


def _with_generation_settings(d: dict) -> dict:
    """`d` as older transformers saved it: generation settings in every (sub-)config."""
    nested = {k: _with_generation_settings(v) if k.endswith("_config") else v for k, v in d.items()}
    return {**nested, "num_beams": 4, "max_length": 7, "bad_words_ids": None, "_commit_hash": "a"}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_accepts_settings_transformers_drops(family):
    _, config_class, d = _family_configs()[family]
    got = config_class.from_hf_config(_with_generation_settings(d))
    assert got == config_class.from_hf_config(d)
