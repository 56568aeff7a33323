"""Hostile Chameleon configs, image vocabularies and checkpoints: each refused with a typed
error naming the problem; a VQ config read from a full checkpoint config."""

import json

import pytest

from jaxsync.harness.paths.chameleon import reference as ref
from jaxsync.models.chameleon import (
    ChameleonConfig,
    ChameleonVQConfig,
    ImageVocabularyMapping,
    load_model,
)
from jaxsync.weights import WeightError


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (dict(vq_config=dict(resolution=22.0)), TypeError, "resolution must be an int"),
        (dict(vq_config=dict(num_res_blocks=True)), TypeError, "num_res_blocks"),
        (dict(vq_config=dict(channel_multiplier=[1, 2.0])), TypeError, "channel_multiplier"),
        (dict(vq_config=dict(embed_dim=0)), ValueError, "embed_dim must be >= 1"),
        (dict(vocab_size=1000.0), TypeError, "vocab_size"),
        (dict(hidden_size="32"), TypeError, "hidden_size"),
        (dict(vocabulary_map={"IMGIMGAZ": 4.0}), TypeError, "vocabulary_map"),
        (dict(vq_config=dict(double_latent=True)), ValueError, "double_latent"),
        (dict(vq_config=dict(attn_type=None)), TypeError, "attn_type must be a str"),
        (dict(model_type="llama"), ValueError, "not a Chameleon config"),
    ],
)
def test_config_refuses(tmp_path, change, exc, match):
    d = ref.tiny_hf_config()
    for k, v in change.items():
        d[k] = {**d[k], **v} if k == "vq_config" else v
    with pytest.raises(exc, match=match):
        ChameleonConfig.from_hf_config(d)
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(exc, match=match):
        ChameleonConfig.from_hf_config(tmp_path)


def test_vq_config_from_a_full_checkpoint_config(tmp_path):
    d = ref.tiny_hf_config()
    (tmp_path / "config.json").write_text(json.dumps(d))
    want = ChameleonConfig.from_hf_config(d).vq
    assert ChameleonVQConfig.from_hf_config(tmp_path) == want
    assert ChameleonVQConfig.from_hf_config(d) == want
    assert ChameleonVQConfig.from_hf_config(d["vq_config"]) == want


def test_vocabulary_refuses_non_integers():
    with pytest.raises(TypeError, match="missing_code_id"):
        ImageVocabularyMapping({"IMGIMGAZ": 1}, num_embeddings=2, missing_code_id=0.0)
    with pytest.raises(TypeError, match="<image>"):
        ImageVocabularyMapping({"IMGIMGAZ": 1, "<image>": 2.0})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    pytest.importorskip("torch")
    d = tmp_path_factory.mktemp("chameleon_ckpt")
    ref.build_hf_model(ref.tiny_hf_config()).save_pretrained(d)
    return d


def test_corrupt_weights_refused(saved, tmp_path):
    from safetensors.numpy import load_file, save_file

    (file,) = saved.glob("*.safetensors")
    tensors = load_file(file)
    key = "model.vqmodel.encoder.conv_in.weight"
    missing = {k: v for k, v in tensors.items() if k != key}
    save_file(missing, tmp_path / "missing.safetensors")
    cfg = ChameleonConfig.from_hf_config(saved)
    with pytest.raises(WeightError, match="conv_in"):
        load_model(tmp_path / "missing.safetensors", cfg)
    shaped = dict(tensors, **{key: tensors[key][:, :, :2]})
    save_file(shaped, tmp_path / "shaped.safetensors")
    with pytest.raises(WeightError, match="conv_in"):
        load_model(tmp_path / "shaped.safetensors", cfg)
    with pytest.raises(TypeError, match="ChameleonConfig"):
        load_model(saved, cfg={"vq_config": {}})
    (tmp_path / "truncated.safetensors").write_bytes(file.read_bytes()[:100])
    with pytest.raises(WeightError):
        load_model(tmp_path / "truncated.safetensors", cfg)
