"""Registers the Gemma 3n audio benchmark for `jaxsync bench` (jaxsync vs transformers eager)."""

import functools as ft
import tempfile

import jax
import jax.numpy as jnp

from jaxsync.models.gemma3n import Gemma3nAudioEncoder, load_model
from jaxsync.paths.gemma3n import reference as R
from jaxsync.registry import BenchCase, register_bench


_FRAMES_PER_SECOND = 100  # Gemma3nAudioFeatureExtractor: 10 ms hop


@ft.cache
def _bench_models(size: str, device: str):
    import torch

    ref = R.build_reference(tempfile.mkdtemp(prefix="jaxsync-gemma3n-bench-"), size=size)
    model = load_model(ref.checkpoint, ref.cfg, dtype=jnp.bfloat16)
    ref.tower.to(device=device, dtype=torch.bfloat16)
    ref.embedder.to(device=device, dtype=torch.bfloat16)
    return ref, Gemma3nAudioEncoder(model, ref.cfg)


@register_bench("gemma3n")
def _bench(device: str, size: str) -> list[BenchCase]:
    """jaxsync vs transformers eager (bf16): 1-8 clips of 5-30 s (released) or tiny frames."""
    import torch

    ref, emb = _bench_models(size, device)
    cfg = ref.cfg
    shapes = [(1, 5), (1, 30), (8, 30)] if size == "released" else [(1, 0.2), (3, 0.5)]
    cases = []
    for clips, seconds in shapes:
        frames = int(seconds * _FRAMES_PER_SECOND)
        batches = []
        for seed in range(3):  # rotated inputs, same shapes
            lengths = [max(1, frames - 37 * i) for i in range(clips)]
            batches.append(R.mel_batch(lengths, frames, cfg.input_feat_size, seed=seed))
        t_batches = [
            (torch.from_numpy(f).to(device, torch.bfloat16), torch.from_numpy(m).to(device))
            for f, m in batches
        ]
        pad_tok = torch.tensor([[cfg.text_vocab_size - 1]], dtype=torch.long, device=device)
        state, host_state = {"i": 0}, {"i": 0}  # the torch baseline reads the device row's

        def jax_fn(batches=batches, state=host_state):  # processor output: host features
            state["i"] = (state["i"] + 1) % len(batches)
            return emb(*batches[state["i"]])

        on_device = [(jax.device_put(f), m) for f, m in batches]

        def jax_device(on_device=on_device, state=state):  # features already on the device
            state["i"] = (state["i"] + 1) % len(on_device)
            return emb(*on_device[state["i"]])

        def hf_eager(t_batches=t_batches, state=state, pad_tok=pad_tok):
            feats, mask = t_batches[state["i"]]
            with torch.no_grad():  # Gemma3nModel.forward's audio part, pad recomputed per call
                out = ref.tower(feats, ~mask, return_dict=True)
                e = ref.embedder(inputs_embeds=out.last_hidden_state)
                pad = ref.embedder(input_ids=pad_tok)
                e = torch.where(out.audio_mel_mask.unsqueeze(-1), pad, e)
                b, t, d = e.shape
                n = cfg.soft_tokens
                e = e[:, :n] if t > n else torch.cat((e, pad.expand(b, n - t, d)), dim=1)
            return e

        name = f"gemma3n.audio_embed[{size}, {clips}x{seconds}s"
        cases.append(BenchCase(f"{name}, device features]", jax_device,
                               {"transformers_eager": hf_eager}))  # fmt: skip
        cases.append(BenchCase(f"{name}, host features]", jax_fn))
    return cases
