"""Registers the Qwen3-Omni audio encoder for `jaxsync verify`."""

from __future__ import annotations

import functools as ft
import tempfile
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from flax import nnx

import jaxsync
from jaxsync.harness.paths.qwen3_omni import reference as ref
from jaxsync.harness.registry import Parity, PathCase, register_path
from jaxsync.models.qwen3_omni import (
    FRAME_BUCKETS,
    Qwen3OmniAudioConfig,
    Qwen3OmniAudioEncoder,
    Qwen3OmniAudioTower,
    load_model,
    pad_features,
)


ONE_BUCKET_MIXES = (
    (1, 8, 99, 100, 101, 250, 450),
    (0, 201, 100, 100, 100, 100, 100, 100, 100, 0),
    (99,) * 10,
    (450, 1, 1, 1, 1, 450, 0),
    (333, 0, 77, 250, 1, 260, 7),
)
"""Length mixes that share one program at `ref.TINY` (896 < frames <= 1024, 9-10 windows)."""

PARITY_MIXES = (
    (1, 8, 99, 100, 101, 250, 450),  # every chunking edge; 450 frames > n_window_infer
    (1, 8, 37),  # only short chunks: upstream pads the conv batch to 37 frames
    (0, 101, 250),  # zero-length audio first (upstream corrupts the batch's last chunk)
    (101, 0, 250),  # ... in the middle (upstream corrupts the previous audio's tail)
    (101, 250, 0),  # ... last
)

BENCH_SECONDS = (5, 17, 33, 60)
"""Audio durations of the released-size benchmark batch (100 mel frames per second)."""


def padded_inputs(cfg: Qwen3OmniAudioConfig, mixes, *, seed: int = 0) -> list[tuple]:
    """(device features padded to the frame bucket, lengths) per mix."""
    out = []
    for i, lens in enumerate(mixes):
        x = pad_features(ref.random_features(cfg, lens, seed=seed + i), lens)
        out.append((jaxsync.async_h2d(x), list(lens)))
    return out


@ft.cache
def _tiny_pair() -> tuple[Any, Qwen3OmniAudioEncoder]:
    """The HF tiny encoder and ours loaded from its saved `thinker.audio_tower.*` weights."""
    model = ref.build_hf_encoder(ref.TINY)
    path = Path(tempfile.mkdtemp(prefix="jaxsync-qwen3-omni-")) / "model.safetensors"
    ref.save_hf_encoder(model, path, prefix="thinker.audio_tower.")
    return model, Qwen3OmniAudioEncoder.from_pretrained(path, ref.TINY)


def parity_error(mixes=PARITY_MIXES) -> float:
    """Worst max-norm relative error (per audio) of ours vs HF over `mixes` (fp32)."""
    from jaxsync.testing import rel_err

    model, enc = _tiny_pair()
    worst = 0.0
    for i, lens in enumerate(mixes):
        x = ref.random_features(ref.TINY, lens, seed=100 + i)
        want = ref.reference_outputs(model, x, lens)
        got = enc(jaxsync.async_h2d(pad_features(x, lens)), lens).split()
        worst = max([worst] + [rel_err(g, w) for g, w in zip(got, want, strict=True) if w.size])
    return worst


def _parity() -> Parity:
    detail = f"HF Qwen3OmniMoeAudioEncoder fp32, lengths {list(PARITY_MIXES)}"
    return Parity(parity_error(), 1e-5, "rel", detail)


@register_path("qwen3_omni.audio_encoder", description="mel lengths -> host chunk plan -> encoder")
def _build(checkpoint: str | None) -> PathCase:
    if checkpoint is None:
        cfg = ref.TINY
        tower = Qwen3OmniAudioTower(cfg, rngs=nnx.Rngs(0))
        mixes = ONE_BUCKET_MIXES
    else:
        cfg = Qwen3OmniAudioConfig.from_hf_config(checkpoint)
        tower = load_model(checkpoint, cfg, dtype=jnp.bfloat16)
        mixes = [[s * 100 for s in BENCH_SECONDS], [5900, 3400, 1600, 600]]
    return PathCase(
        fn=Qwen3OmniAudioEncoder(tower),
        inputs=padded_inputs(cfg, mixes),
        parity=_parity if checkpoint is None else None,  # the reference is the tiny model
        # One audio filling each frame bucket (its window bucket follows); up to 60 s of audio.
        make_inputs=lambda frames: padded_inputs(cfg, [[frames]])[0],
        buckets=tuple(b for b in FRAME_BUCKETS if b <= 6000),
    )
