"""Registers the Gemma 3n audio path for `jaxsync verify`."""

import tempfile

import jax.numpy as jnp
from flax import nnx

from jaxsync.harness.paths.gemma3n import reference as R
from jaxsync.harness.registry import Parity, PathCase, register_path
from jaxsync.models.gemma3n import (
    Gemma3nAudioConfig,
    Gemma3nAudioEncoder,
    Gemma3nAudioModel,
    from_hf_config,
)


_TINY_BUCKET = 64


def _inputs(cfg: Gemma3nAudioConfig) -> list[tuple]:
    out = []
    for lengths, frames in R.TINY_INPUTS:
        feats, mask = R.mel_batch(lengths, frames, cfg.input_feat_size, seed=frames)
        out.append((feats, mask))
    return out


def _parity() -> Parity:
    from jaxsync.testing import rel_err

    ref = R.build_reference(tempfile.mkdtemp(prefix="jaxsync-gemma3n-"))
    emb = Gemma3nAudioEncoder.from_pretrained(ref.checkpoint, ref.cfg, frame_buckets=_TINY_BUCKET)
    worst = 0.0
    for feats, mask in _inputs(ref.cfg):
        got = R.per_clip(emb(feats, mask))
        worst = max(worst, rel_err(got, R.reference_embed(ref, feats, mask)))
    return Parity(worst, 1e-5, "rel", "HF Gemma3nAudioEncoder + embed_audio + forward padding")


@register_path(
    "gemma3n.audio_embed",
    description="mel features -> audio tower -> embedder -> pad to 188 (one program)",
)
def _build(checkpoint: str | None) -> PathCase:
    if checkpoint is None:
        cfg = R.tiny_config()
        model = Gemma3nAudioModel(cfg, rngs=nnx.Rngs(0))
        emb = Gemma3nAudioEncoder(model, frame_buckets=_TINY_BUCKET)
        return PathCase(fn=emb, inputs=_inputs(cfg), parity=_parity)
    cfg = from_hf_config(checkpoint)
    emb = Gemma3nAudioEncoder.from_pretrained(checkpoint, cfg, dtype=jnp.bfloat16)
    inputs = []
    for seconds in (5, 4, 3):  # one 512-frame bucket of the default frame buckets
        feats, mask = R.mel_batch([seconds * 100], seconds * 100, cfg.input_feat_size)
        inputs.append((feats, mask))
    return PathCase(fn=emb, inputs=inputs, parity=None)
