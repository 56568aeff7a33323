"""Registers the Voxtral paths for `jaxsync verify` and their benchmarks for `jaxsync bench`."""

from __future__ import annotations

import functools as ft
import itertools
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsync.models.voxtral import _reference as ref
from jaxsync.models.voxtral._config import MelConfig, VoxtralAudioConfig
from jaxsync.models.voxtral._mel import log_mel_spectrogram
from jaxsync.models.voxtral._model import VoxtralAudioEmbedder, VoxtralAudioModel
from jaxsync.models.voxtral._weights import load_voxtral_audio
from jaxsync.registry import BenchCase, Parity, PathCase, register_bench, register_path


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


@register_path("voxtral.log_mel", description="padded waveforms -> Whisper log-mel (one program)")
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
def _tiny_reference() -> tuple[Any, VoxtralAudioEmbedder]:
    model, path, cfg = ref.build_tiny_voxtral(tempfile.mkdtemp(prefix="jaxsync-voxtral-"))
    mel = MelConfig.from_feature_extractor(ref.whisper_fe(cfg.num_mel_bins))
    return model, VoxtralAudioEmbedder(load_voxtral_audio(path, cfg), mel)


def _embed_parity() -> Parity:
    import jaxsync.testing as jt

    model, emb = _tiny_reference()
    fe = ref.whisper_fe(emb.config.num_mel_bins)
    lengths = [7001, 3000, 2 * emb.chunk_samples, 301]
    x = _batch(lengths, max(lengths))
    out = emb(x, lengths)
    worst = 0.0
    for i, n in enumerate(lengths):
        mel = ref.processor_features(fe, x[i, :n], emb.config.chunk_frames)
        _, want = ref.torch_audio_features(model, mel)
        rows = np.asarray(out.embeddings)[out.offsets[i] : out.offsets[i] + out.num_tokens[i]]
        worst = max(worst, jt.rel_err(rows, want))
    return Parity(worst, 1e-5, "rel", "HF processor features + get_audio_features, 4 audios")


@ft.cache
def _tiny_random() -> VoxtralAudioEmbedder:
    """The tiny config with random NNX weights: verify's checks need no torch."""
    cfg = VoxtralAudioConfig(num_mel_bins=128, text_hidden_size=ref.TINY_TEXT["hidden_size"],
                             **ref.TINY_AUDIO)  # fmt: skip
    return VoxtralAudioEmbedder(VoxtralAudioModel(cfg, rngs=nnx.Rngs(0)), MelConfig())


def _embedder(checkpoint: str | None) -> VoxtralAudioEmbedder:
    if checkpoint is None:
        return _tiny_random()
    from transformers import AutoConfig

    cfg = VoxtralAudioConfig.from_hf_config(AutoConfig.from_pretrained(checkpoint))
    model = load_voxtral_audio(checkpoint, cfg, dtype=jnp.bfloat16, allow_cast=True)
    return VoxtralAudioEmbedder(model, MelConfig(num_mel_bins=cfg.num_mel_bins))


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


# ---------------------------------------------------------------- benchmarks


def _rotate(items):
    cycle = itertools.cycle(items)
    return lambda: next(cycle)


def _mel_cases(device: str, size: str) -> list[BenchCase]:
    import torch

    fe = ref.whisper_fe(128)
    cfg = MelConfig.from_feature_extractor(fe)
    filters = torch.from_numpy(fe.mel_filters).to(device, torch.float32)
    n = 30 * _SR if size == "released" else 2 * _SR
    cases = []
    for b in (1, 4, 16, 32) if size == "released" else (1, 3):
        hosts = [_batch([n] * b, n, seed) for seed in range(3)]
        jx = _rotate([jax.device_put(h) for h in hosts])
        tx = _rotate([torch.from_numpy(h).to(device) for h in hosts])
        hx = _rotate(hosts)

        def jax_fn(jx=jx, b=b):  # HF batch semantics: per-example max over the 30 s rows
            return log_mel_spectrogram(jx(), [n] * b, config=cfg, floor="per_example",
                                       max_length=n).features  # fmt: skip

        def hf_torch(hx=hx):  # transformers' torch extractor on the GPU (host in, host out)
            return fe._torch_extract_fbank_features(hx(), device)

        def vllm(tx=tx):  # vLLM: per waveform, already on the device
            return torch.stack([ref.vllm_melspec(w, filters) for w in tx()])

        fns = {"transformers_torch_extractor": hf_torch, "vllm_post_pr": vllm}
        cases.append(BenchCase(f"log_mel[{size},B={b}x{n // _SR}s]", jax_fn, fns, b * n * 4))
    return cases


def _encoder_cases(device: str, size: str) -> list[BenchCase]:
    import torch

    if size == "released":
        from transformers import VoxtralConfig

        text = {"model_type": "llama", **ref.TINY_TEXT, "hidden_size": 3072, "head_dim": 128}
        hf_cfg = VoxtralConfig(text_config=text)
        dtype, tdtype, counts = jnp.bfloat16, torch.bfloat16, (1, 4, 8)
    else:
        hf_cfg, dtype, tdtype, counts = ref.tiny_hf_config(128), jnp.float32, torch.float32, (1, 3)
    cfg = VoxtralAudioConfig.from_hf_config(hf_cfg)
    hf_cfg._attn_implementation = "eager"
    from transformers import VoxtralForConditionalGeneration

    torch.manual_seed(0)
    with torch.device(device):
        hf = VoxtralForConditionalGeneration(hf_cfg).to(tdtype).eval()
    model = VoxtralAudioModel(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
    emb = VoxtralAudioEmbedder(model, MelConfig(num_mel_bins=cfg.num_mel_bins))
    cases = []
    for c in counts:
        mels = [np.random.default_rng(s).uniform(-1, 2, (c, 128, cfg.chunk_frames)) for s in (0, 1)]
        jx = _rotate([jax.device_put(m.astype(np.float32)) for m in mels])
        tx = _rotate([torch.from_numpy(m).to(device, tdtype) for m in mels])

        def jax_fn(jx=jx):
            return emb.from_features(jx())

        def hf_eager(tx=tx):
            return hf.get_audio_features(tx()).pooler_output

        name = f"audio_encoder[{size},C={c}x{cfg.chunk_frames}]"
        cases.append(BenchCase(name, jax_fn, {"transformers_eager": hf_eager}))
    return cases


@register_bench("voxtral")
def _bench(device: str, size: str) -> list[BenchCase]:
    return _mel_cases(device, size) + _encoder_cases(device, size)
