"""Registers the Voxtral paths for `jaxsync verify` (torch and transformers inside functions)."""

from __future__ import annotations

import functools as ft
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsync.harness.paths.voxtral import reference as ref
from jaxsync.harness.registry import Parity, PathCase, register_path
from jaxsync.models.voxtral import (
    MelConfig,
    VoxtralAudioConfig,
    VoxtralAudioEncoder,
    VoxtralAudioTower,
    load_model,
    log_mel_spectrogram,
)


_SR = 16000


def _audio(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    tone = 0.3 * np.sin(2 * np.pi * 440.0 * np.arange(n) / _SR)
    return (0.05 * rng.standard_normal(n) + tone).astype(np.float32)


def _batch(lengths, width: int, seed: int = 0) -> np.ndarray:
    x = np.zeros((len(lengths), width), np.float32)
    for i, n in enumerate(lengths):
        x[i, :n] = _audio(n, seed + i)
    return x


# ---------------------------------------------------------------- verify: log-mel


def _log_mel_parity() -> Parity:
    """Worst abs error over 80/128 bins vs transformers' float64 NumPy path (as given) and its
    fp32 torch 30 s batch path (where the fp32 reference's own error is reported alongside)."""
    lengths = (3 * _SR + 77, 31 * _SR + 4417)
    worst, torch_worst = 0.0, 0.0
    for bins in (80, 128):
        fe = ref.whisper_fe(bins)
        cfg = MelConfig.from_feature_extractor(fe)
        x = _batch(lengths, max(lengths))
        out = log_mel_spectrogram(x, list(lengths), config=cfg)
        feats = np.asarray(out.features)
        for i, n in enumerate(lengths):
            want = ref.whisper_numpy(fe, x[i, :n])
            worst = max(worst, float(np.abs(feats[i, :, : out.num_frames[i]] - want).max()))
        batch = log_mel_spectrogram(x, list(lengths), config=cfg, floor="per_example")
        want = ref.whisper_call(fe, [x[i, :n] for i, n in enumerate(lengths)])
        torch_worst = max(torch_worst, float(np.abs(np.asarray(batch.features)[:2] - want).max()))
    detail = f"HF numpy path, 80/128 bins, 3 s and 31 s; HF torch __call__ abs {torch_worst:.1e}"
    return Parity(worst, 2e-5, "abs", detail)


@register_path(
    "voxtral.log_mel",
    description="padded waveforms -> Whisper log-mel (one program)",
    checkpoints=False,
)
def _build_log_mel(checkpoint: str | None) -> PathCase:
    cfg = MelConfig()
    width = 4096 * 160  # 40.96 s: one device bucket; lengths vary inside it
    inputs = [
        (jax.device_put(_batch(lens, width, seed)), list(lens))
        for seed, lens in enumerate([(3 * _SR + 77, 30 * _SR), (width, 401), (12345, 20 * _SR)])
    ]
    # Host waveforms are padded to power-of-two frame buckets (x hop samples), batch bucket 1;
    # one audio filling each bucket from 1.28 s to 41 s.
    return PathCase(fn=log_mel_spectrogram, inputs=inputs, parity=_log_mel_parity,
                    kwargs={"config": cfg},
                    make_inputs=lambda frames: (_audio(frames * 160, frames)[None], [frames * 160]),
                    buckets=(128, 256, 512, 1024, 2048, 4096))  # fmt: skip


# ---------------------------------------------------------------- verify: audio embeddings


@ft.cache
def _tiny_reference() -> tuple[Any, VoxtralAudioEncoder]:
    model, path, cfg = ref.build_tiny_voxtral(tempfile.mkdtemp(prefix="jaxsync-voxtral-"))
    mel = MelConfig.from_feature_extractor(ref.whisper_fe(cfg.num_mel_bins))
    return model, VoxtralAudioEncoder.from_pretrained(path, cfg, mel_config=mel)


def _embed_parity() -> Parity:
    import jaxsync.testing as jt

    model, emb = _tiny_reference()
    fe = ref.whisper_fe(emb.cfg.num_mel_bins)
    lengths = [7001, 3000, 2 * emb.chunk_samples, 301]
    x = _batch(lengths, max(lengths))
    out = emb(x, lengths)
    emb_rows = np.asarray(out.embeddings)
    worst = 0.0
    for i, n in enumerate(lengths):
        mel = ref.processor_features(fe, x[i, :n], emb.cfg.chunk_frames)
        _, want = ref.torch_audio_features(model, mel)
        rows = emb_rows[out.offsets[i] : out.offsets[i] + out.lengths[i]]
        worst = max(worst, jt.rel_err(rows, want))
    return Parity(worst, 1e-5, "rel", "HF processor features + get_audio_features, 4 audios")


@ft.cache
def _tiny_random() -> VoxtralAudioEncoder:
    """The tiny config with random NNX weights: verify's checks need no torch."""
    cfg = VoxtralAudioConfig(**ref.TINY_ENCODER)
    return VoxtralAudioEncoder(VoxtralAudioTower(cfg, rngs=nnx.Rngs(0)), MelConfig())


def _embedder(checkpoint: str | None) -> VoxtralAudioEncoder:
    if checkpoint is None:
        return _tiny_random()
    model = load_model(checkpoint, dtype=jnp.bfloat16)
    return VoxtralAudioEncoder(model, MelConfig(num_mel_bins=model.cfg.num_mel_bins))


@register_path(
    "voxtral.audio_embeddings",
    description="waveforms -> log-mel -> Voxtral encoder -> projector (one program)",
)
def _build_embed(checkpoint: str | None) -> PathCase:
    emb = _embedder(checkpoint)
    win = emb.chunk_samples
    width = 2 * win
    cases = [(win + 7, 3000), (2 * win, 401), (999, win + 1)]  # 3 windows each -> one bucket
    inputs = [(jax.device_put(_batch(c, width, i)), list(c)) for i, c in enumerate(cases)]
    return PathCase(
        fn=emb.__call__, inputs=inputs, parity=_embed_parity if checkpoint is None else None
    )
