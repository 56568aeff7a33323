"""Chameleon configs as transformers' own tester builds them, read from `config.json` by our
loader and matched against transformers; the keys accepted at any value (`IGNORED_FIELDS`) leave
transformers' image tokens unchanged, and keys that do change them are still refused."""

from __future__ import annotations

import numpy as np
import pytest

from jaxsync.harness.paths.chameleon import reference as ref
from jaxsync.models.chameleon import ChameleonConfig, ChameleonImageEncoder
from jaxsync.models.chameleon._config import IGNORED_FIELDS
from jaxsync.testing import requires_torch


pytestmark = requires_torch


def _tester_config(*, codes_named: bool = False, **vq: object) -> dict:
    """transformers tests/models/chameleon/test_modeling_chameleon.py, `ChameleonModelTester`:
    its `__init__` defaults as `get_config` and `get_vq_config` pass them (the vocabulary map:
    every id named `chr(id)`, `<image>` at 4, `IMGIMG` names for ids 10..14).

    The tester names ids 10..14 after themselves (codes 10..14) while its VQ makes codes 0..4;
    `codes_named` names codes 0..4 at those ids instead."""
    vocab = {i: chr(i) for i in range(99)}
    vocab[4] = "<image>"
    for i in range(10, 15):
        vocab[i] = ref.image_token_name(i - 10 if codes_named else i)
    vq_config = dict(embed_dim=5, num_embeddings=5, latent_channels=5, in_channels=3,
                     base_channels=32, channel_multiplier=[1, 2])  # fmt: skip
    return dict(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, intermediate_size=37, hidden_act="gelu", hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1, max_position_embeddings=512, type_vocab_size=16,
        is_decoder=False, initializer_range=0.02, pad_token_id=0,
        vocabulary_map={v: k for k, v in vocab.items()}, vq_config={**vq_config, **vq},
    )  # fmt: skip


# Every ignored key at a value other than the tester's and transformers' defaults.
ODD = {
    "config": dict(
        attention_bias=True, attention_dropout=0.3, hidden_act="relu", intermediate_size=41,
        max_position_embeddings=64, mlp_bias=True, model_parallel_size=2, num_attention_heads=4,
        num_hidden_layers=1, num_key_value_heads=1, rms_norm_eps=1e-3, swin_norm=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}, rope_theta=500.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0}, bos_token_id=1, eos_token_id=2,
        pad_token_id=3, initializer_range=0.5, hidden_dropout_prob=0.3,
        attention_probs_dropout_prob=0.3, type_vocab_size=2, is_decoder=True,
    ),
    "vq_config": dict(dropout=0.3, initializer_range=0.5),
}  # fmt: skip


@pytest.fixture(scope="module")
def tester(tmp_path_factory):
    # resolution 10: the tester feeds 10x10 pixels (`ChameleonVision2SeqModelTester`, 25 image
    # tokens); transformers' convolutions take any size, our encoder is built for one.
    # Codes named: the tester's own map is refused (see below).
    hf = _tester_config(codes_named=True, resolution=10)
    model = ref.build_hf_model(hf, seed=3)
    path = tmp_path_factory.mktemp("chameleon_tester")
    ref.save_checkpoint(model, str(path))
    model.config.save_pretrained(path)
    return hf, model, path


def test_tester_config_is_accepted_as_it_is_built():
    cfg = ChameleonConfig.from_hf_config(_tester_config())
    assert (cfg.vocab_size, cfg.hidden_size, cfg.image_token_id) == (99, 32, 4)
    assert (cfg.vq.num_embeddings, cfg.vq.resolution, cfg.vq.channel_multiplier) == (5, 512, (1, 2))


def test_tester_config_matches_transformers_through_the_loader(tester):
    hf, model, path = tester
    saved = (path / "config.json").read_text()
    assert '"type_vocab_size": 16' in saved and '"hidden_dropout_prob": 0.1' in saved
    enc = ChameleonImageEncoder.from_pretrained(path, buckets=(4,))
    assert enc.cfg.vq.tokens_per_image == 25
    pixels = ref.random_pixels(3, hf["vq_config"], seed=1)
    want = ref.hf_image_tokens(model, pixels)
    assert len(np.unique(want["codes"])) > 1  # the ids below carry the codes
    np.testing.assert_array_equal(np.asarray(enc.get_image_tokens(pixels)), want["tokens"])


def test_tester_vocabulary_is_refused_unless_asked_for(tester, tmp_path):
    """The tester's map leaves the VQ's codes 0..4 without a name: transformers maps every one
    of them to id 0; we refuse that unless asked for it."""
    hf, reference, _ = tester
    model = ref.build_hf_model(_tester_config(resolution=10), seed=3)  # the tester's own map
    model.load_state_dict(reference.state_dict())
    ref.save_checkpoint(model, str(tmp_path))
    model.config.save_pretrained(tmp_path)
    pixels = ref.random_pixels(2, hf["vq_config"], seed=1)
    with pytest.raises(ValueError, match="code"):
        ChameleonImageEncoder.from_pretrained(tmp_path, buckets=(4,)).get_image_tokens(pixels)
    enc = ChameleonImageEncoder.from_pretrained(tmp_path, buckets=(4,), missing_code_id=0)
    tokens = ref.hf_image_tokens(model, pixels)["tokens"]
    assert not tokens.any()
    np.testing.assert_array_equal(np.asarray(enc.get_image_tokens(pixels)), tokens)


def test_ignored_keys_leave_transformers_image_tokens_unchanged(tester):
    hf, model, _ = tester
    odd = {**hf, **ODD["config"], "vq_config": {**hf["vq_config"], **ODD["vq_config"]}}
    assert ChameleonConfig.from_hf_config(odd) == ChameleonConfig.from_hf_config(hf)
    other = ref.build_hf_model(odd, seed=4)
    other.model.vqmodel.load_state_dict(model.model.vqmodel.state_dict())
    pixels = ref.random_pixels(2, hf["vq_config"], seed=2)
    got, want = ref.hf_image_tokens(other, pixels), ref.hf_image_tokens(model, pixels)
    for key in ("latents", "codes", "tokens"):
        np.testing.assert_array_equal(got[key], want[key])
    # every listed key is exercised here
    assert set(ODD["config"]) == IGNORED_FIELDS.config
    assert set(ODD["vq_config"]) == IGNORED_FIELDS.vq_config


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(vq_config=dict(double_latent=True)), "double_latent"),  # doubles conv_out's width
        (dict(vq_config=dict(quant_conv_bias=False)), "quant_conv_bias"),  # not a field we know
        (dict(image_seq_length=16), "image_seq_length"),
    ],
)
def test_keys_that_would_change_the_result_are_refused(change, match):
    hf = _tester_config()
    for k, v in change.items():
        hf[k] = {**hf[k], **v} if k == "vq_config" else v
    with pytest.raises(ValueError, match=match):
        ChameleonConfig.from_hf_config(hf)
