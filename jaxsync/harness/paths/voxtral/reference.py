"""transformers / vLLM reference builders shared by the tests, `jaxsync verify` and the benches.

torch and transformers are imported lazily inside the functions (they live in the `test` extra).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from jaxsync.models.voxtral._config import VoxtralAudioConfig


# Tiny but odd sizes: head_dim 7, 2 layers, 20 positions (a window = 40 frames = 6400 samples).
TINY_AUDIO = dict(
    hidden_size=28, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
    max_source_positions=20,
)  # fmt: skip
TINY_TEXT = dict(
    vocab_size=61, hidden_size=36, intermediate_size=44, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, head_dim=18,
)  # fmt: skip
# `VoxtralAudioConfig` fields of the same tiny model (128 mel bins, projected to the text width).
TINY_ENCODER = dict(num_mel_bins=128, text_hidden_size=TINY_TEXT["hidden_size"], **TINY_AUDIO)


def tiny_hf_config(num_mel_bins: int = 128, **audio: Any):
    """A tiny transformers `VoxtralConfig`."""
    from transformers import VoxtralConfig

    return VoxtralConfig(
        audio_config={"model_type": "voxtral_encoder", "num_mel_bins": num_mel_bins,
                      **TINY_AUDIO, **audio},
        text_config={"model_type": "llama", **TINY_TEXT},
        audio_token_id=7,
    )  # fmt: skip


def build_tiny_voxtral(
    directory: str | Path, *, num_mel_bins: int = 128, seed: int = 0, hub_keys: bool = False
):
    """Random tiny `VoxtralForConditionalGeneration` (fp32, eval) saved as safetensors.

    Every audio parameter is redrawn (LayerNorm scales around 1, non-zero biases) so that no
    tensor is left at an initialiser value a wrong mapping could get right by accident.

    Args:
      directory: where `model.safetensors` and `config.json` go.
      num_mel_bins: encoder input bins.
      seed: torch seed.
      hub_keys: save with the Hub spelling (`audio_tower.*`) instead of transformers 5.x's
        `model.audio_tower.*`.

    Returns:
      `(torch_model, checkpoint_path, VoxtralAudioConfig)`.
    """
    import torch
    from transformers import VoxtralForConditionalGeneration

    from jaxsync.testing import save_torch_state

    torch.manual_seed(seed)
    hf_cfg = tiny_hf_config(num_mel_bins)
    hf_cfg._attn_implementation = "eager"
    model = VoxtralForConditionalGeneration(hf_cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "audio_tower" not in name and "multi_modal_projector" not in name:
                continue
            if p.ndim == 1:
                base = 1.0 if "norm" in name and name.endswith("weight") else 0.0
                p.copy_(base + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p[0].numel()))
    state = model.state_dict()
    if hub_keys:
        state = {k.removeprefix("model."): v for k, v in state.items()}
    path = save_torch_state(state, Path(directory) / "model.safetensors")
    hf_cfg.to_json_file(str(Path(directory) / "config.json"))
    return model, path, VoxtralAudioConfig.from_hf_config(hf_cfg)


def tone_audio(n: int, seed: int, sampling_rate: int = 16000) -> np.ndarray:
    """`[n]` float32 test audio: noise plus a 440 Hz tone plus a quiet tail, so that the
    dynamic-range floor actually clips something."""
    rng = np.random.default_rng(seed)
    t = np.arange(n) / sampling_rate
    x = 0.05 * rng.standard_normal(n) + 0.3 * np.sin(2 * np.pi * 440.0 * t)
    x[-n // 5 :] *= 1e-5
    return x.astype(np.float32)


def padded_batch(audios: list[np.ndarray], width: int | None = None, fill: float = 0.0):
    """`[B, width]` float32: each audio at the start of its row, `fill` after it."""
    width = width or max(len(a) for a in audios)
    x = np.full((len(audios), width), fill, np.float32)
    for i, a in enumerate(audios):
        x[i, : len(a)] = a
    return x


def noisy_audio(n: int, seed: int) -> np.ndarray:
    """`[n]` float32 test audio: noise plus a fast sine."""
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(n) + 0.2 * np.sin(np.arange(n) * 0.3)).astype(np.float32)


def window_features(c: int, cfg: VoxtralAudioConfig, seed: int) -> np.ndarray:
    """`[c, 128, chunk_frames]` float64 log-mel windows: (log10 + 4) / 4 features live roughly
    in [-1, 2]."""
    return np.random.default_rng(seed).uniform(-1.0, 2.0, (c, 128, cfg.chunk_frames))


def tiny_tower(seed: int = 0, **overrides: Any):
    """The tiny encoder tower (`TINY_ENCODER` with `overrides`), random weights from `seed`."""
    from flax import nnx

    from jaxsync.models.voxtral import VoxtralAudioTower

    return VoxtralAudioTower(
        VoxtralAudioConfig(**{**TINY_ENCODER, **overrides}), rngs=nnx.Rngs(seed)
    )


def one_row_meta(n: int = 4000, frames: int = 25):
    """The packed metadata `log_mel_rows` reads for one waveform of `n` samples as one row."""
    import jaxsync
    from jaxsync.models.voxtral import MelMeta

    meta = MelMeta(*(np.array([v], np.int32) for v in (n, n, 0, 0, frames)))
    return jaxsync.upload_packed(meta._asdict())


def whisper_fe(num_mel_bins: int):
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=num_mel_bins)


def realtime_fe(num_mel_bins: int, global_log_mel_max: float | None = 1.5):
    from transformers import VoxtralRealtimeFeatureExtractor

    return VoxtralRealtimeFeatureExtractor(
        feature_size=num_mel_bins, global_log_mel_max=global_log_mel_max
    )


def whisper_numpy(fe, audio: np.ndarray) -> np.ndarray:
    """transformers' NumPy path on one waveform as given: `[F, N // hop]`."""
    return fe._np_extract_fbank_features(np.asarray(audio, np.float32)[None], "cpu")[0]


def whisper_torch(fe, batch: np.ndarray, device: str = "cpu") -> np.ndarray:
    """transformers' torch path: `[F, T]` for 1-D input, `[B, F, T]` (max per example) for 2-D."""
    return fe._torch_extract_fbank_features(np.asarray(batch, np.float32), device)


def whisper_call(fe, audios: list[np.ndarray]) -> np.ndarray:
    """`WhisperFeatureExtractor.__call__` defaults: pad / truncate to 30 s, `[B, F, 3000]`."""
    return fe(audios, sampling_rate=fe.sampling_rate, return_tensors="np")["input_features"]


def realtime_torch(fe, audio: np.ndarray) -> np.ndarray:
    """VoxtralRealtimeFeatureExtractor's torch path (= vLLM pre-PR) on one waveform."""
    import torch

    return fe._torch_extract_fbank_features(torch.from_numpy(np.asarray(audio, np.float32))).numpy()


def processor_features(fe, audio: np.ndarray, chunk_frames: int) -> np.ndarray:
    """VoxtralProcessor._retrieve_input_features for one audio: pad to a multiple of the window,
    whole-audio max, split into `[n_chunks, F, chunk_frames]`."""
    feats = fe(
        np.asarray(audio, np.float32), sampling_rate=fe.sampling_rate, padding="longest",
        truncation=False, pad_to_multiple_of=chunk_frames * fe.hop_length, return_tensors="np",
    )["input_features"]  # fmt: skip
    return feats.reshape(fe.feature_size, -1, chunk_frames).transpose(1, 0, 2)


def torch_audio_features(model, mel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(audio_tower(mel).last_hidden_state, get_audio_features(mel).pooler_output)` in numpy."""
    import torch

    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        x = torch.from_numpy(np.asarray(mel, np.float32)).to(dtype)
        enc = model.model.audio_tower(x).last_hidden_state
        emb = model.get_audio_features(x).pooler_output
    return enc.float().numpy(), emb.float().numpy()


def vllm_melspec(waveform, mel_filters, global_log_mel_max: float | None = None):
    """vLLM post-PR `compute_whisper_melspec` on one torch waveform (benchmark baseline)."""
    import torch

    window = torch.hann_window(400, device=waveform.device)
    stft = torch.stft(waveform, 400, 160, window=window, return_complex=True)
    magnitudes = stft[..., :-1].abs() ** 2
    log_spec = torch.clamp(mel_filters.T @ magnitudes, min=1e-10).log10()
    if global_log_mel_max:
        log_spec = torch.clamp(log_spec, min=global_log_mel_max - 8.0)
    else:
        log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def float64_melspec(
    batch: np.ndarray, filters: np.ndarray, global_log_mel_max: float | None = None
) -> np.ndarray:
    """Upstream's algorithm (torch.stft, drop last frame, filters, log10, floor per row) in
    float64: the oracle that separates our fp32 rounding from the fp32 references' own."""
    import torch

    x = torch.from_numpy(np.array(batch, np.float64, ndmin=2))
    window = torch.hann_window(filters.shape[0] * 2 - 2, dtype=torch.float64)
    stft = torch.stft(x, window.shape[0], 160, window=window, return_complex=True)
    log = (torch.from_numpy(np.asarray(filters)).T @ stft[..., :-1].abs() ** 2).clamp(min=1e-10)
    log = log.log10()
    if global_log_mel_max:
        log = log.clamp(min=global_log_mel_max - 8.0)
    else:
        log = torch.maximum(log, log.amax(dim=(1, 2), keepdim=True) - 8.0)
    return ((log + 4.0) / 4.0).numpy()
