"""Benchmarks of the Qwen3-Omni audio encoder against transformers (`jaxsync bench`)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
from flax import nnx

import jaxsync
from jaxsync.harness.paths._server import rows_only
from jaxsync.harness.paths.qwen3_omni import reference as ref
from jaxsync.harness.paths.qwen3_omni.verify import BENCH_SECONDS, padded_inputs
from jaxsync.harness.registry import BenchCase, register_bench
from jaxsync.models.qwen3_omni import Qwen3OmniAudioEncoder, Qwen3OmniAudioTower, forward
from jaxsync.testing import server_step


@register_bench("qwen3_omni")
def _bench(device: str, size: str) -> list[BenchCase]:
    """jaxsync's entry vs transformers (eager PyTorch; sdpa and eager attention) on one batch,
    and beside it the server form: `forward` in a server's own jit over the flat state leaves."""
    import torch

    if size == "tiny":
        cfg, lens, dtype = ref.TINY, [130, 57, 410, 260], jnp.float32
    elif size == "released":
        cfg, lens, dtype = ref.RELEASED, [s * 100 for s in BENCH_SECONDS], jnp.bfloat16
    else:
        raise ValueError(f"unknown size {size!r}; expected 'tiny' or 'released'")
    tower = Qwen3OmniAudioTower(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
    rotation = padded_inputs(cfg, [lens] * 3)

    def jax_runner(enc: Qwen3OmniAudioEncoder):
        inputs = itertools.cycle(rotation)

        def run():
            x, lengths = next(inputs)
            return enc(x, lengths).embeddings

        jax.block_until_ready(run())  # compile outside the timed region
        return run

    encoder = Qwen3OmniAudioEncoder(tower)
    run_jax = jax_runner(encoder)
    run_server = server_runner(tower, encoder, rotation)
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
        BenchCase(f"{name} · server form", run_server),
    ]


def server_runner(tower: Qwen3OmniAudioTower, encoder: Qwen3OmniAudioEncoder, rotation):
    """The server form in a server's own jit: `forward(nnx.merge(flat state leaves), ...)`, each
    batch's meta uploaded once (`upload_packed(plan)`) outside the timed call."""
    step, leaves = server_step(tower, rows_only(forward))
    metas = [(x, jaxsync.upload_packed(encoder.plan(x.shape, lens))) for x, lens in rotation]
    inputs = itertools.cycle(metas)

    def run():
        x, meta = next(inputs)
        return step(leaves, x, meta)

    jax.block_until_ready(run())  # compile outside the timed region
    return run
