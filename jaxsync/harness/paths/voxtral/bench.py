"""Benchmarks of the Voxtral paths for `jaxsync bench` (torch baselines imported lazily).

Every workload timed through an entry on device inputs is timed beside it through the server
form: the pure function (`forward`, `log_mel_rows`) in a server's own jit, the tower's state as
flat leaves, with the plan's meta uploaded once (`upload_packed(plan)`) outside the timed call.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxsync
from jaxsync.harness.paths._server import rows_only, server_runner
from jaxsync.harness.paths.voxtral import reference as ref
from jaxsync.harness.paths.voxtral.verify import _SR, _batch
from jaxsync.harness.registry import BenchCase, register_bench
from jaxsync.models.voxtral import (
    MelConfig,
    MelSpec,
    VoxtralAudioConfig,
    VoxtralAudioEncoder,
    VoxtralAudioTower,
    forward,
    log_mel_rows,
    log_mel_spectrogram,
    plan,
    plan_log_mel,
)


def _rotate(items):
    cycle = itertools.cycle(items)
    return lambda: next(cycle)


def _mel_cases(device: str, size: str) -> list[BenchCase]:
    import torch

    fe = ref.whisper_fe(128)
    cfg = MelConfig.from_feature_extractor(fe)
    filters = torch.from_numpy(fe.mel_filters).to(device, torch.float32)
    n = 30 * _SR if size == "released" else 2 * _SR
    cases = []
    for b in (1, 4, 16, 32) if size == "released" else (1, 3):
        hosts = [_batch([n] * b, n, seed) for seed in range(3)]
        jx = _rotate([jax.device_put(h) for h in hosts])
        tx = _rotate([torch.from_numpy(h).to(device) for h in hosts])
        hx = _rotate(hosts)

        def jax_fn(jx=jx, b=b):  # HF batch semantics: per-example max over the 30 s rows
            return log_mel_spectrogram(jx(), [n] * b, config=cfg, floor="per_example",
                                       max_length=n).features  # fmt: skip

        def hf_torch(hx=hx):  # transformers' torch extractor on the GPU (host in, host out)
            return fe._torch_extract_fbank_features(hx(), device)

        def vllm(tx=tx):  # vLLM: per waveform, already on the device
            return torch.stack([ref.vllm_melspec(w, filters) for w in tx()])

        fns = {"transformers_torch_extractor": hf_torch, "vllm_post_pr": vllm}
        name = f"log_mel[{size},B={b}x{n // _SR}s]"
        cases.append(BenchCase(name, jax_fn, fns, b * n * 4))
        mel = plan_log_mel(np.full(b, n), n, b, cfg, floor="per_example", max_length=n)
        server = _log_mel_step(MelSpec(cfg, mel.frames, mel.floor_value), mel, jx)
        cases.append(BenchCase(f"{name} · server form", server, bytes_moved=b * n * 4))
    # Host waveforms in (the upload included), against the same torch extractor.
    b = 8 if size == "released" else 3
    hosts = [_batch([n] * b, n, seed) for seed in range(3)]
    hx = _rotate(hosts)

    def jax_host(hx=hx, b=b):
        return log_mel_spectrogram(hx(), [n] * b, config=cfg, floor="per_example",
                                   max_length=n).features  # fmt: skip

    def hf_host(hx=hx):
        return fe._torch_extract_fbank_features(hx(), device)

    fns = {"transformers_torch_extractor": hf_host}
    cases.append(BenchCase(f"log_mel[{size},B={b}x{n // _SR}s host]", jax_host, fns, b * n * 4))
    return cases


def encoder_flops(cfg: VoxtralAudioConfig, windows: int) -> float:
    """Matmul and attention FLOPs of one forward over `windows` 30 s windows (conv stem, layers,
    projector): what the encoder's TFLOP/s is computed from."""
    t, d, f = cfg.chunk_frames // 2, cfg.hidden_size, cfg.intermediate_size
    rows = windows * t
    layer = 2 * rows * (4 * d * d + 2 * d * f) + 4 * windows * t * t * d  # q,k,v,o, MLP, QK^T/PV
    stem = 2 * windows * cfg.chunk_frames * 3 * cfg.num_mel_bins * d + 2 * rows * 3 * d * d
    groups, v = rows // cfg.frames_per_token, cfg.text_hidden_size
    projector = 2 * groups * (cfg.frames_per_token * d * v + v * v)
    return float(cfg.num_hidden_layers * layer + stem + projector)


def _encoder_cases(device: str, size: str) -> list[BenchCase]:
    import torch

    if size == "released":
        from transformers import VoxtralConfig

        text = {"model_type": "llama", **ref.TINY_TEXT, "hidden_size": 3072, "head_dim": 128}
        hf_cfg = VoxtralConfig(text_config=text)
        dtype, tdtype, counts = jnp.bfloat16, torch.bfloat16, (1, 4, 8)
    else:
        hf_cfg, dtype, tdtype, counts = ref.tiny_hf_config(128), jnp.float32, torch.float32, (1, 3)
    cfg = VoxtralAudioConfig.from_hf_config(hf_cfg)
    hf_cfg._attn_implementation = "eager"
    from transformers import VoxtralForConditionalGeneration

    torch.manual_seed(0)
    with torch.device(device):
        hf = VoxtralForConditionalGeneration(hf_cfg).to(tdtype).eval()
    configs = {id(m.config): m.config for m in hf.modules() if hasattr(m, "config")}.values()
    model = VoxtralAudioTower(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
    emb = VoxtralAudioEncoder(model, MelConfig(num_mel_bins=cfg.num_mel_bins))
    step = server_runner(model, rows_only(forward))
    cases = []
    for c in counts:
        mels = [np.random.default_rng(s).uniform(-1, 2, (c, 128, cfg.chunk_frames)) for s in (0, 1)]
        jx = _rotate([jax.device_put(m.astype(np.float32)) for m in mels])
        tx = _rotate([torch.from_numpy(m).to(device, tdtype) for m in mels])

        def jax_fn(jx=jx):
            return emb(input_features=jx()).embeddings

        def hf_run(attn: str, tx=tx):
            def run():
                for conf in configs:  # transformers reads it at call time
                    conf._attn_implementation = attn
                with torch.no_grad():
                    return hf.get_audio_features(tx()).pooler_output

            return run

        name = f"audio_encoder[{size},C={c}x{cfg.chunk_frames}]"
        baselines = {"transformers_sdpa": hf_run("sdpa"), "transformers_eager": hf_run("eager")}
        cases.append(BenchCase(name, jax_fn, baselines, flops=encoder_flops(cfg, c)))
        # The entry's plan for device features: one audio per window, the array's own rows.
        server = step(plan([1] * c, cfg, buckets=(c,)), jx)
        cases.append(BenchCase(f"{name} · server form", server, flops=encoder_flops(cfg, c)))
    return cases


def _log_mel_step(spec: MelSpec, mel, waveforms):
    """`log_mel_rows` in a server's own jit, its plan's meta uploaded once."""
    meta = jaxsync.upload_packed(mel)
    jitted = jax.jit(functools.partial(log_mel_rows, spec=spec))

    def run():
        return jitted(waveforms(), meta)[0]

    jax.block_until_ready(run())  # compile outside the timed region
    return run


@register_bench("voxtral")
def _bench(device: str, size: str) -> list[BenchCase]:
    return _mel_cases(device, size) + _encoder_cases(device, size)
