"""The Gemma 3n audio path at transformers' own tester config (saved as `config.json` and read by
our loader) matched against transformers; the keys accepted at any value (`IGNORED_FIELDS`) leave
transformers' result unchanged, and keys we do not implement are still refused."""

from __future__ import annotations

import pytest

from jaxsync.harness.paths.gemma3n import reference as R
from jaxsync.models.gemma3n import Gemma3nAudioEncoder, from_hf_config, load_model
from jaxsync.models.gemma3n._config import IGNORED_FIELDS
from jaxsync.testing import rel_err, requires_torch


pytestmark = requires_torch

# transformers tests/models/gemma3n/test_modeling_gemma3n.py, `Gemma3nAudioModelTester`:
# `get_audio_encoder_config` (every other audio field at transformers' default).
TESTER_AUDIO = dict(
    input_feat_size=32, hidden_size=32, conf_num_attention_heads=4, conf_num_hidden_layers=2,
    sscp_conv_channel_size=[16, 8], conf_conv_kernel_size=3, conf_attention_chunk_size=4,
    conf_attention_context_left=5,
)  # fmt: skip
# Its inputs: a 1 s and a 0.5 s clip give 48 and 22 mel frames.
LENGTHS, FRAMES = [48, 22], 48


def _variant(**audio) -> dict:
    """`R.build_reference`'s variant holding the tester's audio config exactly. The tester builds
    the audio encoder alone; the embedder's text side is the tiny reference's, with transformers'
    default vocabulary size so that its padding id lies in the default audio vocabulary."""
    from transformers import Gemma3nAudioConfig

    defaults = Gemma3nAudioConfig().to_dict()
    reset = {k: defaults[k] for k in R.TINY_HF["audio"]}  # undo the tiny reference's choices
    return {"audio": {**reset, **TESTER_AUDIO, **audio}, "text": {"vocab_size": 262_400}}


@pytest.fixture(scope="module")
def tester(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3n_tester")
    return R.build_reference(path, variant=_variant()), path


def test_tester_config_matches_transformers_through_the_loader(tester):
    ref, path = tester
    ref.hf_cfg.to_json_file(str(path / "config.json"))
    model = load_model(ref.checkpoint)  # the config comes from config.json beside it
    cfg = from_hf_config(path)
    assert cfg == ref.cfg
    assert (cfg.input_feat_size, cfg.hidden_size, cfg.sscp_conv_channel_size) == (32, 32, (16, 8))
    assert cfg.num_tower_positions(FRAMES) == 3
    enc = Gemma3nAudioEncoder(model, frame_buckets=FRAMES)
    feats, mask = R.mel_batch(LENGTHS, FRAMES, cfg.input_feat_size, seed=1)
    want = R.reference_embed(ref, feats, mask)
    assert rel_err(R.per_clip(enc(feats, mask)), want) <= 1e-5


def test_ignored_keys_leave_transformers_result_unchanged(tester, tmp_path):
    ref, _ = tester
    odd = {"initializer_range": 0.5}  # every ignored key, at a non-default value
    other = R.build_reference(tmp_path, variant=_variant(**odd), save=False)
    assert other.cfg == ref.cfg
    assert all(other.hf_cfg.audio_config.to_dict()[k] == v for k, v in odd.items())
    other.tower.load_state_dict(ref.tower.state_dict())
    other.embedder.load_state_dict(ref.embedder.state_dict())
    feats, mask = R.mel_batch(LENGTHS, FRAMES, 32, seed=2)
    assert rel_err(R.reference_embed(other, feats, mask), R.reference_embed(ref, feats, mask)) == 0
    assert set(odd) == IGNORED_FIELDS  # every listed key is exercised here


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(model_type="gemma4"), "gemma4"),  # reuses the layout; its audio tower differs
        (dict(audio_config=dict(model_type="gemma4_audio")), "gemma4_audio"),
        (dict(audio_config=dict(conf_use_bias=True)), "conf_use_bias"),  # not a field we know
    ],
)
def test_keys_it_does_not_implement_are_refused(tester, change, match):
    ref, _ = tester
    d = ref.hf_cfg.to_dict()
    for k, v in change.items():
        d[k] = {**d[k], **v} if isinstance(v, dict) else v
    with pytest.raises(ValueError, match=match):
        from_hf_config(d)
