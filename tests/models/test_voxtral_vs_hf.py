"""Voxtral audio tower + projector vs transformers through our loader, end to end from waveforms."""

from __future__ import annotations

import copy
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsync._jit import jit_method
from jaxsync.harness.paths.voxtral import reference as ref
from jaxsync.models.voxtral import (
    MelConfig,
    VoxtralAudioConfig,
    VoxtralAudioEncoder,
    VoxtralAudioTower,
    load_model,
)
from jaxsync.testing import rel_err, requires_torch
from jaxsync.weights import WeightError


pytestmark = requires_torch

RTOL = 1e-5
# bf16 weights and activations (fp32 LayerNorm statistics and softmax), against the fp32
# reference: bf16 has an 8-bit mantissa (rel. rounding 3.9e-3) and 2 layers of residual sums
# plus attention compound it; torch's own bf16 run lands at the same order (checked below).
BF16_RTOL = 3e-2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, path, cfg = ref.build_tiny_voxtral(tmp_path_factory.mktemp("voxtral"))
    return model, path, cfg, load_model(path)


_audio, _batch, _mel = ref.noisy_audio, ref.padded_batch, ref.window_features


def test_hub_and_transformers_keys_load_identically(tiny, tmp_path):
    *_, cfg, loaded = tiny
    _, hub_path, _ = ref.build_tiny_voxtral(tmp_path, hub_keys=True)  # same seed, "audio_tower.*"
    hub = load_model(hub_path, cfg)
    a, b = nnx.to_flat_state(nnx.state(loaded)), nnx.to_flat_state(nnx.state(hub))
    # Stacked layers: one leaf per weight kind of a layer (15), whatever the depth.
    assert len(a) == len(b) and len(a) == 4 + 1 + 2 + 15 + 2
    assert loaded.layers.layer.fc1.kernel[...].shape[0] == cfg.num_hidden_layers
    for (pa, va), (pb, vb) in zip(a, b, strict=True):
        assert pa == pb and np.array_equal(va[...], vb[...]), pa


@pytest.mark.parametrize("chunks", [1, 3])
def test_encoder_and_audio_features_parity(tiny, chunks):
    model, _, cfg, jmodel = tiny
    mel = _mel(chunks, cfg, chunks)
    want_enc, want_emb = ref.torch_audio_features(model, mel)
    x = jnp.asarray(mel, jnp.float32)
    enc = jit_method(jmodel, "encode")(x)
    assert jmodel.cfg == cfg  # read from the checkpoint's config.json
    emb = jit_method(jmodel, "audio_features")(x)
    assert emb.shape == (chunks * cfg.tokens_per_chunk, cfg.text_hidden_size)
    assert rel_err(enc, want_enc) <= RTOL, rel_err(enc, want_enc)
    assert rel_err(emb, want_emb) <= RTOL, rel_err(emb, want_emb)
    # The entry's encoder-only rows: transformers' last_hidden_state, window after window.
    hidden = VoxtralAudioEncoder(jmodel, project=False)(input_features=mel, num_chunks=[chunks])
    assert hidden.lengths == (chunks * cfg.max_source_positions,)
    want_rows = np.asarray(want_enc).reshape(-1, cfg.hidden_size)
    assert rel_err(hidden.rows[: hidden.lengths[0]], want_rows) <= RTOL


@pytest.mark.parametrize("g", [None, 1.5])
def test_waveform_to_embeddings_one_call(tiny, g):
    """Waveforms -> mel -> encoder -> projector in one program vs VoxtralProcessor-style features
    (pad to whole windows, per-audio max or fixed floor) fed to `get_audio_features`."""
    model, _, cfg, jmodel = tiny
    fe = ref.whisper_fe(128) if g is None else ref.realtime_fe(128, g)
    emb = VoxtralAudioEncoder(jmodel, MelConfig.from_feature_extractor(fe))
    window = cfg.chunk_frames * 160  # 6400 samples
    audios = [_audio(n, i) for i, n in enumerate([7001, 3000, 2 * window, 301])]
    out = emb(_batch(audios), [len(a) for a in audios], sampling_rate=16000)
    assert out.offsets == (0, 10, 15, 25) and out.lengths == (10, 5, 10, 5)  # 2, 1, 2, 1 windows
    got = np.asarray(out.embeddings)
    assert got.shape == (8 * cfg.tokens_per_chunk, cfg.text_hidden_size)  # 6 windows -> bucket 8
    for i, a in enumerate(audios):
        if g is None:
            mel = ref.processor_features(fe, a, cfg.chunk_frames)
        else:  # realtime extractor on the audio zero-padded to whole windows
            padded = _batch([a], out.lengths[i] // cfg.tokens_per_chunk * window)[0]
            mel = ref.realtime_torch(fe, padded).reshape(128, -1, cfg.chunk_frames)
            mel = mel.transpose(1, 0, 2)
        _, want = ref.torch_audio_features(model, mel)
        rows = got[out.offsets[i] : out.offsets[i] + out.lengths[i]]
        assert rel_err(rows, want) <= RTOL, (i, rel_err(rows, want))
    assert np.asarray(out.extras["finite"])[:4].all()


def test_bf16_checkpoint_loads_at_bf16(tiny, tmp_path):
    """A bf16 checkpoint loads at bf16 with no flag (embed_positions float32, as upstream); an
    fp32 one casts to bf16 on request. Both against the fp32 reference at the bf16 tolerance."""
    model, path, cfg, _ = tiny
    bf16_model = copy.deepcopy(model).to(dtype=_torch_bf16())
    ckpt = tmp_path / "bf16"
    ckpt.mkdir()
    from jaxsync.testing import save_torch_state

    save_torch_state(bf16_model.state_dict(), ckpt / "model.safetensors")
    (ckpt / "config.json").write_text((Path(path).parent / "config.json").read_text())
    mel = _mel(2, cfg, 7)
    _, want = ref.torch_audio_features(model, mel)
    _, torch_bf16 = ref.torch_audio_features(bf16_model, mel)
    for jbf16 in (load_model(ckpt), load_model(path, dtype=jnp.bfloat16)):
        assert jbf16.conv1.kernel[...].dtype == jnp.bfloat16
        assert jbf16.embed_positions.embedding[...].dtype == jnp.float32  # as upstream
        got = jit_method(jbf16, "audio_features")(jnp.asarray(mel, jnp.float32))
        assert got.dtype == jnp.bfloat16
        ours, theirs = rel_err(got, want), rel_err(torch_bf16, want)
        assert ours <= BF16_RTOL, (ours, theirs)
        assert ours <= 3 * theirs, (ours, theirs)  # no worse than bf16 rounding explains


def _torch_bf16():
    import torch

    return torch.bfloat16


def test_config_from_hf_and_released_shapes():
    import torch
    from transformers import VoxtralConfig, VoxtralEncoderConfig, VoxtralForConditionalGeneration

    with pytest.raises(ValueError, match="activation_function"):
        VoxtralAudioConfig.from_hf_config(VoxtralEncoderConfig(activation_function="relu"))
    with pytest.raises(ValueError, match="multiple of 4"):
        VoxtralAudioConfig.from_hf_config(VoxtralEncoderConfig(max_source_positions=1501))
    with pytest.raises(ValueError, match="unsupported non-default Voxtral config field"):
        VoxtralAudioConfig.from_hf_config(VoxtralEncoderConfig(pad_token_id=3))
    # Released audio tower (VoxtralEncoderConfig defaults) and projector into a 3072-wide LM; the
    # LM itself is shrunk to one layer since only its width matters here.
    text = {"model_type": "llama", **ref.TINY_TEXT, "hidden_size": 3072, "head_dim": 128}
    released = VoxtralConfig(text_config=text)
    cfg = VoxtralAudioConfig.from_hf_config(released)
    assert (cfg.chunk_frames, cfg.tokens_per_chunk) == (3000, 375)
    assert VoxtralAudioConfig.from_hf_config(released.to_dict()) == cfg  # a dict too
    abstract = nnx.eval_shape(lambda: VoxtralAudioTower(cfg, rngs=nnx.Rngs(0)))
    ours = sum(int(np.prod(v.shape)) for _, v in nnx.to_flat_state(nnx.state(abstract)))
    with torch.device("meta"):
        hf = VoxtralForConditionalGeneration(released)
    theirs = sum(
        p.numel() for n, p in hf.named_parameters() if "audio_tower" in n or "projector" in n
    )
    assert ours == theirs


def test_weight_errors(tiny, tmp_path):
    from safetensors.numpy import load_file, save_file

    *_, path, cfg, _ = tiny
    state = load_file(path)
    del state["model.audio_tower.layers.1.fc2.bias"]
    save_file(state, str(tmp_path / "m.safetensors"))
    with pytest.raises(
        WeightError, match=r"'layers\.layer\.fc2\.bias' not in the checkpoint: layers \[1\]"
    ):
        load_model(tmp_path / "m.safetensors", cfg)


@pytest.mark.parametrize("field", [{"padding_value": 0.5}, {"padding_side": "left"}])
def test_feature_extractor_padding_it_does_not_implement_is_refused(field):
    """A Whisper extractor that pads with another value or on the left gives other features for
    every padded window (the control below); the front end zero-pads on the right only."""
    from transformers import WhisperFeatureExtractor

    a = _audio(3001, 0)
    fe = WhisperFeatureExtractor(feature_size=80, **field)
    plain = ref.processor_features(WhisperFeatureExtractor(feature_size=80), a, 40)
    assert rel_err(ref.processor_features(fe, a, 40), plain) > 1e-2  # semantics do change
    with pytest.raises(ValueError, match=next(iter(field))):
        MelConfig.from_feature_extractor(fe)


def test_configs_of_other_whisper_style_encoders_are_refused():
    """AudioFlamingo3's encoder config has the Voxtral fields, but its encoder average-pools the
    frames before the final norm (half the rows: the control); its model_type is refused."""
    import torch
    from transformers import AudioFlamingo3Encoder, AudioFlamingo3EncoderConfig

    af3 = AudioFlamingo3EncoderConfig(num_mel_bins=8, **ref.TINY_AUDIO)
    with torch.no_grad():
        x, mask = torch.zeros(1, 8, 40), torch.ones(1, 40, dtype=torch.long)
        rows = AudioFlamingo3Encoder(af3).eval()(x, mask).last_hidden_state
    assert rows.shape[1] == ref.TINY_AUDIO["max_source_positions"] // 2
    for src in (af3, af3.to_dict()):
        with pytest.raises(ValueError, match="audioflamingo3_encoder"):
            VoxtralAudioConfig.from_hf_config(src)
    full = ref.tiny_hf_config().to_dict()
    with pytest.raises(ValueError, match="model_type 'other'"):
        VoxtralAudioConfig.from_hf_config({**full, "model_type": "other"})
