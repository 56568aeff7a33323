"""Reference builders shared by the tests, `jaxsync verify` and the benchmarks.

Tiny random Chameleon configs, synthetic vocabulary maps shaped like the released one, and the
`transformers` reference model. torch / transformers are imported lazily inside the functions.
"""

from __future__ import annotations

import functools as ft
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from jaxsync.models.chameleon._vocab import IMAGE_PREFIX


def image_token_name(code: int, *, suffix: str = "Z") -> str:
    """The `IMGIMG` name of a VQ code (digits written as letters A..J), like the released map."""
    return IMAGE_PREFIX + "".join(chr(ord("A") + int(d)) for d in str(code)) + suffix


def synth_vocab_map(
    num_codes: int,
    *,
    first_id: int = 4,
    seed: int | None = None,
    skip_codes: Iterable[int] = (),
    text_tokens: int = 4,
) -> dict[str, int]:
    """A tokenizer map with `num_codes` image tokens plus a few text and special tokens.

    Args:
      num_codes: codes `0..num_codes-1` get a name (minus `skip_codes`).
      first_id: BPE id of the first image token; image tokens take consecutive ids.
      seed: if given, the code order over those ids is a random permutation (so `img2bpe` is not
        monotone); otherwise code c gets id `first_id + c`.
      skip_codes: codes left without a name (an irregular map).
      text_tokens: plain text tokens placed before `first_id` and after the image block.
    """
    codes = [c for c in range(num_codes) if c not in set(skip_codes)]
    if seed is not None:
        codes = list(np.random.default_rng(seed).permutation(codes))
    vocab = {f"<t{i}>": i for i in range(min(text_tokens, first_id))}
    vocab.update({image_token_name(int(c)): first_id + i for i, c in enumerate(codes)})
    nxt = first_id + len(codes)
    vocab.update({"<racm3:break>": nxt, "<image>": nxt + 1, "<eoss>": nxt + 2})
    vocab.update({f"word{i}": nxt + 3 + i for i in range(text_tokens)})
    return vocab


def tiny_vq_config(**overrides: Any) -> dict[str, Any]:
    """A tiny HF `vq_config` dict: 2 levels, 22x22 pixels -> 11x11 = 121 tokens, prime sizes."""
    cfg = dict(
        embed_dim=7,
        num_embeddings=97,
        latent_channels=13,
        resolution=22,
        in_channels=3,
        base_channels=32,
        channel_multiplier=[1, 2],
        num_res_blocks=1,
        attn_resolutions=[22],
        attn_type="vanilla",
        double_latent=False,
        dropout=0.0,
    )
    cfg.update(overrides)
    return cfg


def tiny_hf_config(vocab_map: dict[str, int] | None = None, **vq_overrides: Any) -> dict[str, Any]:
    """A tiny HF `ChameleonConfig` dict (1 decoder layer) around `tiny_vq_config`."""
    vq = tiny_vq_config(**vq_overrides)
    if vocab_map is None:
        vocab_map = synth_vocab_map(vq["num_embeddings"], seed=0)
    return dict(
        vocab_size=max(vocab_map.values()) + 1 + 6,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocabulary_map=vocab_map,
        vq_config=vq,
    )


def released_hf_config() -> dict[str, Any]:
    """The released `facebook/chameleon-7b` VQ config with a synthetic 8192-code vocabulary map."""
    return dict(vocab_size=65536, vocabulary_map=synth_vocab_map(8192, seed=0), vq_config={})


def build_hf_model(config: dict[str, Any], *, seed: int = 0, dtype: str = "float32"):
    """The `transformers` `ChameleonForConditionalGeneration`, seeded, in eval mode."""
    import torch
    import transformers

    torch.manual_seed(seed)
    hf_cfg = transformers.ChameleonConfig(**config)
    model = transformers.ChameleonForConditionalGeneration(hf_cfg).eval()
    return model.to(getattr(torch, dtype))


def build_hf_vqvae(vq_config: dict[str, Any], *, seed: int = 0, dtype: str = "float32"):
    """Only the `transformers` `ChameleonVQVAE` (for the tokenizer benchmark at full size)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.ChameleonVQVAE(transformers.ChameleonVQVAEConfig(**vq_config)).eval()
    return model.to(getattr(torch, dtype))


def save_checkpoint(model: Any, directory: str) -> str:
    """Saves `model.state_dict()` (keys `model.vqmodel.*`, ...) as one safetensors file."""
    from jaxsync.testing import save_torch_state

    return save_torch_state(model, os.path.join(directory, "model.safetensors"))


def tiny_tower(seed: int = 0, **vq_overrides: Any) -> Any:
    """A `ChameleonImageTower` of `tiny_hf_config(**vq_overrides)`, seeded random weights."""
    from flax import nnx

    from jaxsync.models.chameleon import ChameleonConfig, ChameleonImageTower

    cfg = ChameleonConfig.from_hf_config(tiny_hf_config(**vq_overrides))
    return ChameleonImageTower(cfg, rngs=nnx.Rngs(seed))


def tiny_encoder(buckets: tuple[int, ...] = (4,), **vq_overrides: Any) -> Any:
    """A `ChameleonImageEncoder` of `tiny_tower(**vq_overrides)`."""
    from jaxsync.models.chameleon import ChameleonImageEncoder

    return ChameleonImageEncoder(tiny_tower(**vq_overrides), buckets=buckets)


def random_pixels(batch: int, vq: Any, *, seed: int = 0) -> np.ndarray:
    """Float32 pixels `[B, C, R, R]` in [-1, 1] (the processor's normalised range).

    `vq` is a HF `vq_config` dict or a `ChameleonVQConfig`.
    """
    get = vq.get if isinstance(vq, dict) else ft.partial(getattr, vq)
    rng = np.random.default_rng(seed)
    shape = (batch, get("in_channels"), get("resolution"), get("resolution"))
    return rng.uniform(-1.0, 1.0, size=shape).astype(np.float32)


def hf_image_tokens(model: Any, pixels: np.ndarray) -> dict[str, np.ndarray]:
    """HF reference: encoder latents (NCHW), VQ codes, `get_image_tokens` BPE ids, and the
    embedded image tokens `get_image_features(...).pooler_output` [B, T, D] (vLLM's rows)."""
    import torch

    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        x = torch.from_numpy(pixels).to(dtype)
        out = model.model.vqmodel.encode(x, return_dict=True)
        bpe = model.model.get_image_tokens(x)
        embedded = model.model.get_image_features(x).pooler_output
    return dict(
        latents=out.last_hidden_state.float().numpy(),
        codes=out.image_tokens.numpy().reshape(pixels.shape[0], -1),
        tokens=bpe.numpy(),
        embedded=embedded.float().numpy(),
    )


def latent_rows(latents: np.ndarray) -> np.ndarray:
    """HF's NCHW latents `[B, L, h, w]` as the encoder-only rows `[B*h*w, L]` (raster order)."""
    b, c = latents.shape[:2]
    return latents.reshape(b, c, -1).transpose(0, 2, 1).reshape(-1, c)


def hf_mask_logits(logits: Any, image_token_ids: list[int]) -> Any:
    """HF's mask semantic `logits[:, :, image_tokens] = finfo.min` (2-D: vLLM's pre-PR
    `logits[:, image_tokens]`) applied to a clone of a torch tensor."""
    import torch

    t = logits.clone()
    if t.ndim == 2:
        t[:, image_token_ids] = torch.finfo(t.dtype).min
    else:
        t[:, :, image_token_ids] = torch.finfo(t.dtype).min
    return t


def hf_merge(model: Any, input_ids: np.ndarray, pixels: np.ndarray) -> dict[str, np.ndarray]:
    """HF's placeholder merge (`masked_scatter` of image features at `<image>` ids).

    Returns `text_embeds` [B, S, D], the `embed_table` [V, D] and the merged `want` [B, S, D].
    """
    import torch

    with torch.no_grad():
        tids = torch.from_numpy(input_ids)
        embeds = model.model.embed_tokens(tids)
        feats = model.model.get_image_features(torch.from_numpy(pixels)).pooler_output
        mask = model.model.get_placeholder_mask(tids, inputs_embeds=embeds, image_features=feats)
        want = embeds.masked_scatter(mask, feats)
    return {
        "text_embeds": embeds.numpy(),
        "embed_table": model.model.embed_tokens.weight.detach().numpy(),
        "want": want.numpy(),
    }
