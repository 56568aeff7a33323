"""transformers reference for the Gemma 3n audio path (tests, `jaxsync verify`, bench).

torch/transformers are imported inside the functions so that importing this module is free.
"""

import copy
import dataclasses
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from jaxsync.models.gemma3n import Gemma3nAudioConfig, from_hf_config


__all__ = [
    "TINY_HF",
    "TINY_INPUTS",
    "Reference",
    "build_reference",
    "hf_config",
    "mel_batch",
    "per_clip",
    "reference_embed",
    "tiny_config",
]

# Odd / prime sizes so that a transposed or mis-split axis cannot line up by accident. Non-default
# rms_norm_eps, right context, reduction factor and first time kernel exercise the generic paths.
TINY_HF: dict[str, Any] = {
    "audio": dict(
        hidden_size=22,
        conf_num_attention_heads=2,
        input_feat_size=13,
        vocab_size=7,
        vocab_offset=40,
        rms_norm_eps=1e-5,
        conf_attention_chunk_size=5,
        conf_attention_context_left=4,
        conf_attention_context_right=2,
        conf_attention_logit_cap=3.0,
        conf_num_hidden_layers=2,
        conf_conv_kernel_size=3,
        conf_reduction_factor=3,
        sscp_conv_channel_size=[5, 7],
        sscp_conv_kernel_size=[[5, 3], [3, 3]],
    ),
    "text": dict(
        hidden_size=17,
        vocab_size=47,
        vocab_size_per_layer_input=47,
        num_attention_heads=1,
        num_key_value_heads=1,
    ),
    "top": dict(audio_soft_tokens_per_image=5, audio_token_id=41),
}


# (lengths, frames) of the verify inputs: one (batch, frame) bucket; tower output shorter than,
# equal to and (for 60 frames with the 20/37 mask) padded up to soft_tokens.
TINY_INPUTS = (([23, 9, 1], 23), ([57, 40, 13], 57), ([37, 37, 20], 60))


def tiny_config() -> Gemma3nAudioConfig:
    """`Gemma3nAudioConfig` of `TINY_HF`, read from the dict (no torch or transformers needed)."""
    t = TINY_HF
    return from_hf_config({"audio_config": t["audio"], "text_config": t["text"], **t["top"]})


def hf_config(size: str = "tiny", variant: dict[str, dict] | None = None) -> Any:
    """A transformers `Gemma3nConfig`: "tiny" (above) or "released" (defaults = gemma-3n-E4B).

    `variant` ({"audio": ..., "text": ..., "top": ...}, each optional) replaces tiny fields.
    """
    import transformers

    if size == "released":
        return transformers.Gemma3nConfig()
    parts = {k: {**v, **(variant or {}).get(k, {})} for k, v in TINY_HF.items()}
    return transformers.Gemma3nConfig(
        text_config=parts["text"], audio_config=parts["audio"], **parts["top"]
    )


@dataclasses.dataclass
class Reference:
    """HF modules and the checkpoint they were saved to."""

    hf_cfg: Any
    cfg: Gemma3nAudioConfig
    tower: Any  # transformers Gemma3nAudioEncoder
    embedder: Any  # transformers Gemma3nMultimodalEmbedder
    checkpoint: str


def _randomise(module: Any, seed: int) -> None:
    """Replaces HF's init (near-identity norms, zero per-dim scale) by O(1) random weights."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.ndim == 1:
                p.copy_(1.0 + 0.3 * noise)  # norms; per_dim_scale goes through softplus
            else:
                p.copy_(noise / np.sqrt(np.prod(p.shape[1:])))


def build_reference(
    directory: str | Path,
    *,
    size: str = "tiny",
    seed: int = 0,
    save: bool = True,
    variant: dict[str, dict] | None = None,
    **overrides: Any,
) -> Reference:
    """Builds random-weight HF audio modules (float32) and saves them as a Gemma3n checkpoint.

    The state dict is written under `model.audio_tower.*` / `model.embed_audio.*`, the keys of
    `Gemma3nForConditionalGeneration` (building that whole model needs timm for its vision tower).
    `variant` changes the tiny HF config (see `hf_config`); `overrides` our config.
    """
    import torch
    import transformers.models.gemma3n.modeling_gemma3n as m

    from jaxsync.testing import save_torch_state

    hf_cfg = hf_config(size, variant)
    torch.manual_seed(seed)
    tower = m.Gemma3nAudioEncoder(hf_cfg.audio_config).eval()
    embedder = m.Gemma3nMultimodalEmbedder(hf_cfg.audio_config, hf_cfg.text_config).eval()
    _randomise(tower, seed)
    _randomise(embedder, seed + 1)
    # one file per variant: several references may share a directory
    tag = f"{size}_{seed}" + ("" if variant is None else f"_{zlib.crc32(repr(variant).encode())}")
    path = str(Path(directory) / f"gemma3n_audio_{tag}.safetensors")
    if save:
        state = {f"model.audio_tower.{k}": v for k, v in tower.state_dict().items()}
        state |= {f"model.embed_audio.{k}": v for k, v in embedder.state_dict().items()}
        save_torch_state(state, path)
    cfg = Gemma3nAudioConfig.from_hf_config(hf_cfg, **overrides)
    return Reference(hf_cfg, cfg, tower, embedder, path)


def reference_embed(
    ref: Reference,
    features: np.ndarray,
    mask: np.ndarray,
    *,
    truncate: bool = False,
    dtype: Any = None,
) -> np.ndarray:
    """The audio part of transformers' `Gemma3nModel.forward`, transcribed line by line.

    `truncate=True` replaces the final padding step with vLLM's
    `adjust_audio_features_to_expected_length` (keep the first `soft_tokens`). Without it, more
    than `soft_tokens` positions raise in torch (negative `expand`), as in transformers.
    Returns `[B, soft_tokens, D]` float32 numpy.
    """
    import torch

    tower, embedder = ref.tower, ref.embedder
    if dtype is not None:  # copies: casting in place would round the fp32 reference weights
        tower, embedder = copy.deepcopy(tower).to(dtype), copy.deepcopy(embedder).to(dtype)
    with torch.no_grad():
        device = next(tower.parameters()).device
        feats = torch.from_numpy(np.asarray(features, np.float32)).to(device)
        valid = torch.from_numpy(np.asarray(mask, bool)).to(device)
        out = tower(feats, ~valid, return_dict=True)  # get_audio_features(..., ~mask)
        emb = embedder(inputs_embeds=out.last_hidden_state)
        pad_tok = torch.tensor([[ref.hf_cfg.text_config.vocab_size - 1]], device=device)
        pad = embedder(input_ids=pad_tok)
        emb = torch.where(out.audio_mel_mask.unsqueeze(-1), pad, emb)
        b, t, d = emb.shape
        n = ref.hf_cfg.audio_soft_tokens_per_image
        if truncate and t > n:
            emb = emb[:, :n]
        else:
            emb = torch.cat((emb, pad.expand(b, n - t, d)), dim=1)
    return emb.float().cpu().numpy()


def mel_batch(lengths: list[int], frames: int, n_mel: int, seed: int = 0):
    """Random log-mel-like features `[B, frames, F]` (zero past each length) and valid masks."""
    rng = np.random.default_rng(seed)
    feats = rng.standard_normal((len(lengths), frames, n_mel)).astype(np.float32)
    mask = np.arange(frames)[None, :] < np.asarray(lengths)[:, None]
    return feats * mask[:, :, None], mask


def per_clip(out: Any) -> np.ndarray:
    """An encoder's `Embeddings` as host `[num_clips, soft_tokens, D]` float32 (tests only)."""
    rows = np.array(out.embeddings, np.float32)[: out.num_tokens]  # a writable copy
    n = out.lengths[0]
    return rows.reshape(len(out.lengths), n, rows.shape[-1])
