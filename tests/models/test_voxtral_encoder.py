"""Voxtral audio encoder + projector vs transformers, end to end from waveforms, sync-freedom."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsync
import jaxsync.check
from jaxsync.models.voxtral import (
    MelConfig,
    VoxtralAudioConfig,
    VoxtralAudioEmbedder,
    VoxtralAudioModel,
    _reference as ref,
    load_voxtral_audio,
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
    return model, path, cfg, load_voxtral_audio(path, cfg)


@pytest.fixture(scope="module")
def embedder(tiny):
    fe = ref.whisper_fe(128)
    return VoxtralAudioEmbedder(tiny[3], MelConfig.from_feature_extractor(fe)), fe


def _mel(c: int, cfg: VoxtralAudioConfig, seed: int) -> np.ndarray:
    # (log10 + 4) / 4 features live roughly in [-1, 2].
    return np.random.default_rng(seed).uniform(-1.0, 2.0, (c, 128, cfg.chunk_frames))


def _audio(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(n) + 0.2 * np.sin(np.arange(n) * 0.3)).astype(np.float32)


def _batch(audios, width=None):
    x = np.zeros((len(audios), width or max(map(len, audios))), np.float32)
    for i, a in enumerate(audios):
        x[i, : len(a)] = a
    return x


def test_hub_and_transformers_keys_load_identically(tiny, tmp_path):
    *_, cfg, loaded = tiny
    _, hub_path, _ = ref.build_tiny_voxtral(tmp_path, hub_keys=True)  # same seed, "audio_tower.*"
    hub = load_voxtral_audio(hub_path, cfg)
    a, b = nnx.to_flat_state(nnx.state(loaded)), nnx.to_flat_state(nnx.state(hub))
    assert len(a) == len(b) and len(a) == 4 + 1 + 2 + cfg.num_hidden_layers * 15 + 2
    for (pa, va), (pb, vb) in zip(a, b, strict=True):
        assert pa == pb and np.array_equal(va[...], vb[...]), pa


@pytest.mark.parametrize("chunks", [1, 3])
def test_encoder_and_audio_features_parity(tiny, chunks):
    model, _, cfg, jmodel = tiny
    mel = _mel(chunks, cfg, chunks)
    want_enc, want_emb = ref.torch_audio_features(model, mel)
    x = jnp.asarray(mel, jnp.float32)
    enc = jaxsync.jit_method(jmodel, "encode")(x)
    emb = jaxsync.jit_method(jmodel, "audio_features")(x)
    assert emb.shape == (chunks * cfg.tokens_per_chunk, cfg.text_hidden_size)
    assert rel_err(enc, want_enc) <= RTOL, rel_err(enc, want_enc)
    assert rel_err(emb, want_emb) <= RTOL, rel_err(emb, want_emb)


@pytest.mark.parametrize("g", [None, 1.5])
def test_waveform_to_embeddings_one_call(tiny, g):
    """Waveforms -> mel -> encoder -> projector in one program vs VoxtralProcessor-style features
    (pad to whole windows, per-audio max or fixed floor) fed to `get_audio_features`."""
    model, _, cfg, jmodel = tiny
    fe = ref.whisper_fe(128) if g is None else ref.realtime_fe(128, g)
    emb = VoxtralAudioEmbedder(jmodel, MelConfig.from_feature_extractor(fe))
    window = cfg.chunk_frames * 160  # 6400 samples
    audios = [_audio(n, i) for i, n in enumerate([7001, 3000, 2 * window, 301])]
    out = emb(_batch(audios), [len(a) for a in audios], sampling_rate=16000)
    assert out.num_chunks.tolist() == [2, 1, 2, 1]
    assert out.offsets.tolist() == [0, 10, 15, 25] and out.num_tokens.tolist() == [10, 5, 10, 5]
    got = np.asarray(out.embeddings)
    assert got.shape == (8 * cfg.tokens_per_chunk, cfg.text_hidden_size)  # 6 windows -> bucket 8
    for i, a in enumerate(audios):
        if g is None:
            mel = ref.processor_features(fe, a, cfg.chunk_frames)
        else:  # realtime extractor on the audio zero-padded to whole windows
            padded = _batch([a], out.num_chunks[i] * window)[0]
            mel = ref.realtime_torch(fe, padded).reshape(128, -1, cfg.chunk_frames)
            mel = mel.transpose(1, 0, 2)
        _, want = ref.torch_audio_features(model, mel)
        rows = got[out.offsets[i] : out.offsets[i] + out.num_tokens[i]]
        assert rel_err(rows, want) <= RTOL, (i, rel_err(rows, want))
    assert np.asarray(out.finite)[:4].all()


def test_bf16(tiny):
    model, path, cfg, _ = tiny
    jbf16 = load_voxtral_audio(path, cfg, dtype=jnp.bfloat16, allow_cast=True)
    assert jbf16.audio_tower.embed_positions.embedding[...].dtype == jnp.float32  # as upstream
    mel = _mel(2, cfg, 7)
    _, want = ref.torch_audio_features(model, mel)
    got = jaxsync.jit_method(jbf16, "audio_features")(jnp.asarray(mel, jnp.float32))
    assert got.dtype == jnp.bfloat16
    _, torch_bf16 = ref.torch_audio_features(copy.deepcopy(model).to(dtype=_torch_bf16()), mel)
    ours, theirs = rel_err(got, want), rel_err(torch_bf16, want)
    assert ours <= BF16_RTOL, (ours, theirs)
    assert ours <= 3 * theirs, (ours, theirs)  # no worse than bf16 rounding explains


def _torch_bf16():
    import torch

    return torch.bfloat16


def test_sync_free_and_no_recompile(embedder):
    emb, _ = embedder
    rng = np.random.default_rng(3)

    def case(lens):  # all: batch bucket 4, width bucket 128 hops, 8 windows (<= 8)
        return _batch([_audio(n, int(rng.integers(99))) for n in lens], 20000), list(lens)

    first = case([7001, 3000, 12800, 301])
    more = [case([19000, 5000, 6400]), case([12801, 12000, 400, 6399])]
    jaxsync.check.assert_sync_free(emb, *first, inputs=more)
    mel = jnp.asarray(_mel(2, emb.config, 0), jnp.float32)
    jaxsync.check.assert_sync_free(emb.from_features, mel, inputs=[(mel * 0.5,)])


def test_bad_input(tiny, embedder):
    emb, _ = embedder
    x = _batch([_audio(5000, 0), _audio(3000, 1)])
    x[1, 10] = np.inf
    with pytest.raises(ValueError, match=r"waveforms \[1\] contain NaN or inf"):
        emb(x, [5000, 3000])
    assert np.asarray(emb(jax.device_put(x), [5000, 3000]).finite)[:2].tolist() == [True, False]
    with pytest.raises(ValueError, match="empty audio"):
        emb(x, [5000, 0])
    with pytest.raises(ValueError, match="sampled at 24000 Hz"):
        emb(x, [5000, 3000], sampling_rate=24000)
    with pytest.raises(ValueError, match="80 mel bins, the encoder expects 128"):
        VoxtralAudioEmbedder(tiny[3], MelConfig(num_mel_bins=80))


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
    abstract = nnx.eval_shape(lambda: VoxtralAudioModel(cfg, rngs=nnx.Rngs(0)))
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
    with pytest.raises(WeightError, match=r"layers\.1\.fc2\.bias"):
        load_voxtral_audio(tmp_path / "m.safetensors", cfg)
