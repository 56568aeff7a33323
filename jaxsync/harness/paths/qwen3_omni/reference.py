"""The transformers reference, shared by the tests, `jaxsync verify` and `jaxsync bench`.

torch / transformers are imported lazily inside the functions (they are test extras).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np

from jaxsync.models.qwen3_omni import Qwen3OmniAudioConfig


TINY = Qwen3OmniAudioConfig(
    num_mel_bins=22,  # -> 11 -> 6 -> 3 after the convs: exercises the odd ceil-halving
    encoder_layers=2,
    encoder_attention_heads=3,
    encoder_ffn_dim=53,
    d_model=42,
    max_source_positions=31,
    n_window=50,  # 100-frame chunks, as released
    n_window_infer=200,  # two chunks per window, so windows matter at small lengths
    output_dim=29,
    downsample_hidden_size=7,
)
"""Tiny random-weight config for parity tests (prime / odd sizes where the model allows)."""

RELEASED = Qwen3OmniAudioConfig(output_dim=2048)
"""The released Qwen3-Omni-30B-A3B audio encoder config."""


def hf_config(cfg: Qwen3OmniAudioConfig, attn_implementation: str = "sdpa") -> Any:
    """The HF `Qwen3OmniMoeAudioEncoderConfig` matching `cfg`."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeAudioEncoderConfig,
    )

    hf = Qwen3OmniMoeAudioEncoderConfig(**dataclasses.asdict(cfg))
    hf._attn_implementation = attn_implementation
    return hf


def build_hf_encoder(
    cfg: Qwen3OmniAudioConfig,
    *,
    seed: int = 0,
    attn_implementation: str = "sdpa",
    randomize: bool = True,
) -> Any:
    """A float32 `Qwen3OmniMoeAudioEncoder` in eval mode (on the CPU).

    With `randomize`, every parameter is redrawn: HF initialises biases to zero and norms to one,
    which would hide a swapped bias or norm mapping; tensors are drawn at a scale that keeps
    activations O(1). Without it, HF's own initialisation is kept (enough for benchmarks).
    """
    import torch
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeAudioEncoder,
    )

    torch.manual_seed(seed)
    model = Qwen3OmniMoeAudioEncoder(hf_config(cfg, attn_implementation)).float().eval()
    if not randomize:
        return model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_post" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p[0].numel()))
    return model


def save_hf_encoder(model: Any, path: str | Path, prefix: str = "") -> str:
    """Saves the encoder's weights as safetensors, keys under `prefix` (e.g. a checkpoint's)."""
    return save_hf_encoder_state(model.state_dict(), path, prefix)


def save_hf_encoder_state(state: dict[str, Any], path: str | Path, prefix: str = "") -> str:
    """Saves a torch state dict as safetensors, keys under `prefix`."""
    from jaxsync.testing import save_torch_state

    return save_torch_state({prefix + k: v for k, v in state.items()}, path)


def random_features(cfg: Qwen3OmniAudioConfig, feature_lens, *, seed: int = 0) -> np.ndarray:
    """[num_mel_bins, sum(lens)] float32 log-mel-like features."""
    rng = np.random.default_rng(seed)
    total = int(np.sum(feature_lens))
    return rng.standard_normal((cfg.num_mel_bins, total)).astype(np.float32)


def reference_outputs(model: Any, features: np.ndarray, feature_lens) -> list[np.ndarray]:
    """Per-audio outputs of the HF encoder (float32 numpy, [tokens_a, O]).

    Zero-length audios are removed before calling HF, which mis-plans them (the tail index of an
    empty audio points at the previous audio's last chunk, or at the batch's last chunk, and
    overwrites its length); their outputs are returned as empty arrays.
    """
    import torch
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        _get_feat_extract_output_lengths,
    )

    lens = np.asarray(feature_lens, np.int64)
    out_dim = model.config.output_dim
    result = [np.zeros((0, out_dim), np.float32) for _ in lens]
    keep = np.nonzero(lens > 0)[0]
    if keep.size == 0:
        return result
    x = torch.from_numpy(np.ascontiguousarray(features[:, : int(lens.sum())]))
    feats = torch.from_numpy(lens[keep])
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        y = model(x.to(dtype), feature_lens=feats).last_hidden_state.float().numpy()
    tokens = _get_feat_extract_output_lengths(feats, model.config.n_window).numpy()
    for a, piece in zip(keep, np.split(y, np.cumsum(tokens)[:-1]), strict=True):
        result[a] = piece
    return result
