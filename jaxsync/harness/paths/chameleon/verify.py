"""Registers the Chameleon paths for `jaxsync verify` (parity against transformers)."""

from __future__ import annotations

import functools as ft
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxsync.harness.paths.chameleon import reference as ref
from jaxsync.harness.registry import Parity, PathCase, register_path
from jaxsync.models.chameleon import ChameleonConfig, ChameleonImageEncoder


_TINY_BUCKETS = (4,)


@ft.cache
def _tiny_paths(checkpoint: str | None) -> ChameleonImageEncoder:
    if checkpoint is not None:  # verify's batches 3, 1, 2 share one bucket here too
        return ChameleonImageEncoder.from_pretrained(checkpoint, buckets=_TINY_BUCKETS)
    return ChameleonImageEncoder(ref.tiny_tower(), buckets=_TINY_BUCKETS)


@ft.cache
def _tiny_reference() -> tuple[Any, ChameleonImageEncoder]:
    """The HF tiny model and our paths loaded from its saved checkpoint."""
    hf_cfg = ref.tiny_hf_config()
    model = ref.build_hf_model(hf_cfg)
    ckpt = ref.save_checkpoint(model, tempfile.mkdtemp(prefix="jaxsync-chameleon-"))
    cfg = ChameleonConfig.from_hf_config(model.config)
    return model, ChameleonImageEncoder.from_pretrained(ckpt, cfg, buckets=_TINY_BUCKETS)


def _image_tokens_parity() -> Parity:
    import jaxsync.testing as jt

    model, paths = _tiny_reference()
    vq_cfg = ref.tiny_vq_config()
    t = paths.tokens_per_image
    worst, mismatches = 0.0, 0
    for batch in (1, 2, 3):
        pixels = ref.random_pixels(batch, vq_cfg, seed=batch)
        want = ref.hf_image_tokens(model, pixels)
        latents, _ = paths.encode(jnp.asarray(pixels))
        worst = max(worst, jt.rel_err(np.asarray(latents).transpose(0, 3, 1, 2), want["latents"]))
        mismatches += int((np.asarray(paths.get_image_tokens(pixels)) != want["tokens"]).sum())
        rows = np.asarray(paths(pixels).rows[: batch * t])  # the embedded image tokens
        mismatches += int((rows != want["embedded"].reshape(rows.shape)).sum())
    detail = f"HF get_image_tokens and get_image_features, B=1,2,3; latents rel {worst:.1e}"
    if worst > 1e-5:
        return Parity(worst, 1e-5, "rel", detail)
    return Parity(float(mismatches), 0.0, "mismatches", detail)


@register_path(
    "chameleon.image_tokens",
    description="pixels -> VQ codes -> BPE ids -> embedded rows (one program)",
)
def _build_image_tokens(checkpoint: str | None) -> PathCase:
    paths = _tiny_paths(checkpoint)
    # Device pixels: with host pixels every argument is static, and the harness's compiled-HLO
    # scan would constant-fold the whole encoder (slow, and not what runs).
    inputs = [(jax.device_put(ref.random_pixels(b, paths.cfg.vq, seed=b)),) for b in (3, 1, 2)]
    return PathCase(
        fn=paths,
        inputs=inputs,
        parity=_image_tokens_parity if checkpoint is None else None,
    )


def _mask_parity() -> Parity:
    import torch

    _, paths = _tiny_reference()
    ids = paths.mapping.image_token_ids.tolist()
    bad = 0
    for shape in ((7, paths.cfg.vocab_size), (2, 5, paths.cfg.vocab_size)):
        logits = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        want = ref.hf_mask_logits(logits, ids).numpy()
        got = np.asarray(paths.mask_image_logits(jnp.asarray(logits.numpy())))
        bad += int((got != want).sum())
    return Parity(float(bad), 0.0, "mismatches", "HF logits[:, :, image_tokens] = finfo.min")


@register_path("chameleon.mask_logits", description="image-token logit mask (cached column mask)")
def _build_mask(checkpoint: str | None) -> PathCase:
    paths = _tiny_paths(checkpoint)
    keys = jax.random.split(jax.random.key(0), 3)
    inputs = [(jax.random.normal(k, (5, paths.cfg.vocab_size)),) for k in keys]
    return PathCase(
        fn=paths.mask_image_logits,
        inputs=inputs,
        parity=_mask_parity if checkpoint is None else None,
    )


def _merge_parity() -> Parity:
    model, paths = _tiny_reference()
    t = paths.cfg.vq.tokens_per_image
    ids = np.array([[1] + [paths.mapping.image_token_id] * t + [2]], dtype=np.int64)
    pixels = ref.random_pixels(1, ref.tiny_vq_config(), seed=4)
    hf = ref.hf_merge(model, ids, pixels)
    image = jnp.take(jnp.asarray(hf["embed_table"]), paths.get_image_tokens(pixels), axis=0)
    got = paths.merge_image_embeddings(jnp.asarray(hf["text_embeds"]), image, input_ids=ids)
    mismatches = float((np.asarray(got) != hf["want"]).sum())
    return Parity(mismatches, 0.0, "mismatches", "HF masked_scatter")


@register_path("chameleon.merge_embeddings", description="image embeddings -> <image> positions")
def _build_merge(checkpoint: str | None) -> PathCase:
    paths = _tiny_paths(checkpoint)
    d, seq = paths.cfg.hidden_size, 41
    text = jax.random.normal(jax.random.key(1), (2, seq, d))
    image = jax.random.normal(jax.random.key(2), (13, d))

    def merge(text, image, positions):
        return paths.merge_image_embeddings(text, image, positions=positions, num_image_tokens=9)

    starts = (0, 30, 50)  # 9 placeholders at different places, one position bucket
    inputs = [(text, image, np.arange(s, s + 9, dtype=np.int32)) for s in starts]
    return PathCase(fn=merge, inputs=inputs, parity=_merge_parity if checkpoint is None else None)
