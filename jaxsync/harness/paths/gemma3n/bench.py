"""Registers the Gemma 3n audio benchmark for `jaxsync bench` (jaxsync vs transformers eager).

Each workload is timed through the entry and, beside it, through the server form: `forward` in
a server's own jit over the flat state leaves, its meta uploaded once outside the timed call.
"""

import functools as ft
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import jaxsync
from jaxsync.harness.paths.gemma3n import reference as R
from jaxsync.harness.registry import BenchCase, register_bench
from jaxsync.models.gemma3n import Gemma3nAudioEncoder, forward, load_model, plan
from jaxsync.testing import server_step


_FRAMES_PER_SECOND = 100  # Gemma3nAudioFeatureExtractor: 10 ms hop


@ft.cache
def _bench_models(size: str, device: str):
    import torch

    ref = R.build_reference(tempfile.mkdtemp(prefix="jaxsync-gemma3n-bench-"), size=size)
    model = load_model(ref.checkpoint, ref.cfg, dtype=jnp.bfloat16)
    ref.tower.to(device=device, dtype=torch.bfloat16)
    ref.embedder.to(device=device, dtype=torch.bfloat16)
    return ref, model, Gemma3nAudioEncoder(model)


def _server_runner(model, emb: Gemma3nAudioEncoder, batches, *, on_device: bool, state: dict):
    """The server form on the same rotated batches: each batch planned (the entry's buckets)
    and its meta uploaded once, outside the timed call; features padded to the plan's shape,
    on the device already (`on_device`) or uploaded per call as a server's host features are."""
    step, leaves = server_step(model, forward)
    staged = []
    for feats, mask in batches:
        p = plan(mask, emb.cfg, buckets=emb.buckets)
        x = np.zeros((p.batch, p.frame_bucket, feats.shape[2]), np.float32)
        x[: feats.shape[0], : feats.shape[1]] = feats
        staged.append((jax.device_put(x) if on_device else x, jaxsync.upload_packed(p)))

    def run():
        state["i"] = (state["i"] + 1) % len(staged)
        x, meta = staged[state["i"]]
        return step(leaves, x if on_device else jax.device_put(x), meta).rows

    return run


@register_bench("gemma3n")
def _bench(device: str, size: str) -> list[BenchCase]:
    """jaxsync vs transformers eager (bf16): 1-8 clips of 5-30 s (released) or tiny frames."""
    import torch

    ref, model, emb = _bench_models(size, device)
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
        server_device = _server_runner(model, emb, batches, on_device=True, state={"i": 0})
        server_host = _server_runner(model, emb, batches, on_device=False, state={"i": 0})
        cases.append(BenchCase(f"{name}, device features]", jax_device,
                               {"transformers_eager": hf_eager}))  # fmt: skip
        cases.append(BenchCase(f"{name}, device features] · server form", server_device))
        cases.append(BenchCase(f"{name}, host features]", jax_fn))
        cases.append(BenchCase(f"{name}, host features] · server form", server_host))
    return cases
