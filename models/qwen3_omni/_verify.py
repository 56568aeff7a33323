"""Registers the Qwen3-Omni audio encoder for `jaxsync verify` and `jaxsync bench`."""

from __future__ import annotations

import functools as ft
import itertools
import json
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import jaxsync
from jaxsync.models.qwen3_omni import _reference as ref
from jaxsync.models.qwen3_omni._config import Qwen3OmniAudioConfig
from jaxsync.models.qwen3_omni._model import AudioEncoder, pad_features
from jaxsync.models.qwen3_omni._modules import Qwen3OmniAudioTower
from jaxsync.models.qwen3_omni._plan import FRAME_BUCKETS
from jaxsync.models.qwen3_omni._weights import load_audio_encoder
from jaxsync.registry import BenchCase, Parity, PathCase, register_bench, register_path


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
def _tiny_pair() -> tuple[Any, AudioEncoder]:
    """The HF tiny encoder and ours loaded from its saved `thinker.audio_tower.*` weights."""
    model = ref.build_hf_encoder(ref.TINY)
    path = Path(tempfile.mkdtemp(prefix="jaxsync-qwen3-omni-")) / "model.safetensors"
    ref.save_hf_encoder(model, path, prefix="thinker.audio_tower.")
    return model, AudioEncoder(load_audio_encoder(ref.TINY, path))


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
        hf = json.loads((Path(checkpoint) / "config.json").read_text())
        cfg = Qwen3OmniAudioConfig.from_hf_config(hf)
        tower = load_audio_encoder(cfg, checkpoint, dtype=jnp.bfloat16)
        mixes = [[s * 100 for s in BENCH_SECONDS], [5900, 3400, 1600, 600]]
    return PathCase(
        fn=AudioEncoder(tower),
        inputs=padded_inputs(cfg, mixes),
        parity=_parity if checkpoint is None else None,  # the reference is the tiny model
        # One audio filling each frame bucket (its window bucket follows); up to 60 s of audio.
        make_inputs=lambda frames: padded_inputs(cfg, [[frames]])[0],
        buckets=tuple(b for b in FRAME_BUCKETS if b <= 6000),
    )


@register_bench("qwen3_omni")
def _bench(device: str, size: str) -> list[BenchCase]:
    """jaxsync vs transformers (eager PyTorch; sdpa and eager attention) on one batch."""
    import torch

    if size == "tiny":
        cfg, lens, dtype = ref.TINY, [130, 57, 410, 260], jnp.float32
    elif size == "released":
        cfg, lens, dtype = ref.RELEASED, [s * 100 for s in BENCH_SECONDS], jnp.bfloat16
    else:
        raise ValueError(f"unknown size {size!r}; expected 'tiny' or 'released'")
    tower = Qwen3OmniAudioTower(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
    rotation = padded_inputs(cfg, [lens] * 3)

    def jax_runner(enc: AudioEncoder):
        inputs = itertools.cycle(rotation)

        def run():
            x, lengths = next(inputs)
            return enc(x, lengths).embeddings

        jax.block_until_ready(run())  # compile outside the timed region
        return run

    # Stacked weights run as one scan with the state packed in rows (the default), the same
    # unpacked, per-layer weights, and the state in one flat buffer per dtype: the GPU A/B of
    # host dispatch against device time (1, 29, 525 and 1-2 state arguments per call at the
    # released size).
    run_jax = jax_runner(AudioEncoder(tower))
    run_stacked = jax_runner(AudioEncoder(tower, pack_weights=None))
    run_per_layer = jax_runner(AudioEncoder(tower, scan_layers=False))
    run_flat = jax_runner(AudioEncoder(tower, pack_weights="flat"))
    del tower

    torch_dtype = torch.bfloat16 if dtype == jnp.bfloat16 else torch.float32
    model = ref.build_hf_encoder(cfg, randomize=False).to(device=device, dtype=torch_dtype)
    feats = [
        torch.from_numpy(ref.random_features(cfg, lens, seed=i)).to(device, torch_dtype)
        for i in range(3)
    ]
    lens_t = torch.tensor(lens, device=device)
    torch_inputs = itertools.cycle(feats)

    def run_torch(attn: str):
        def run():
            model.config._attn_implementation = attn
            with torch.no_grad():
                return model(next(torch_inputs), feature_lens=lens_t).last_hidden_state

        return run

    name = f"qwen3_omni.audio_encoder[{size}, {len(lens)} audios, {sum(lens)} frames]"
    return [
        BenchCase(
            name,
            run_jax,
            {"transformers_sdpa": run_torch("sdpa"), "transformers_eager": run_torch("eager")},
        ),
        BenchCase(f"{name} [unpacked]", run_stacked),
        BenchCase(f"{name} [per_layer]", run_per_layer),
        BenchCase(f"{name} [flat_packed]", run_flat),
    ]
