"""A floor under the voxtral encoder's device time: its matmuls and its attention alone.

At the released width and `--windows` 30 s windows, in one process on one GPU:

- the encoder + projector as `jaxsync bench` runs it, next to transformers' sdpa forward;
- every matmul of the encoder layers, chained with nothing else (weights as separate arrays,
  the layer loop unrolled: no slices, no bias, LayerNorm, GELU or residual passes);
- the layers' attention alone, L chained calls on `[W, T, H, Dh]`: cuDNN's flash attention
  through `jax.nn.dot_product_attention`, and torch's `scaled_dot_product_attention` under each
  backend it offers;
- a bf16 8192³ matmul (the ceiling the bench's TFLOP/s are quoted against).

The floor is the chained matmuls plus the fastest attention plus the conv stem and projector at
the chain's rate: what an encoder with these kernels takes before any other pass runs.

    jaxsync bench roofline [--windows 4] [--out roofline.json]
    jaxsync bench roofline --smoke   # tiny width, jax only: a CPU check
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxsync.harness.bench._timing import _Side, matmul_tflops, measure


def layer_matmuls(cfg: Any, windows: int, dtype: Any) -> tuple[Callable[[], Any], float]:
    """(a call of every encoder-layer matmul chained, its FLOPs): per layer q, k, v, o
    [R, d] @ [d, d], then [R, d] @ [d, f] and [R, f] @ [f, d], R = windows * T."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    rows = windows * (cfg.chunk_frames // 2)
    keys = iter(jax.random.split(jax.random.key(0), 6 * cfg.num_hidden_layers + 1))

    def weight(n: int, m: int) -> jax.Array:  # unit-scale products: no overflow in the chain
        return (jax.random.normal(next(keys), (n, m), jnp.float32) / n**0.5).astype(dtype)

    shapes = [(d, d)] * 4 + [(d, f), (f, d)]
    weights = [weight(*s) for _ in range(cfg.num_hidden_layers) for s in shapes]
    x = jax.random.normal(next(keys), (rows, d), dtype)

    @jax.jit
    def chain(x, weights):
        for w in weights:
            x = x @ w
        return x

    flops = 2.0 * rows * cfg.num_hidden_layers * (4 * d * d + 2 * d * f)
    return (lambda: chain(x, weights)), flops


def attention_shape(cfg: Any, windows: int) -> tuple[int, int, int, int]:
    """(W, T, H, Dh): every window attends over its own T positions."""
    heads = cfg.num_attention_heads
    return windows, cfg.chunk_frames // 2, heads, cfg.hidden_size // heads


def attention_flops(cfg: Any, windows: int) -> float:
    w, t, h, dh = attention_shape(cfg, windows)
    return 4.0 * w * t * t * h * dh * cfg.num_hidden_layers  # QK^T and PV per layer


def jax_attention(cfg: Any, windows: int, dtype: Any, impl: str) -> Callable[[], Any]:
    """L chained attentions (the output is the next query), one program."""
    shape = attention_shape(cfg, windows)
    q, k, v = (jax.random.normal(jax.random.key(i), shape, dtype) for i in range(3))

    @jax.jit
    def layers(q, k, v):
        for _ in range(cfg.num_hidden_layers):
            q = jax.nn.dot_product_attention(q, k, v, implementation=impl)
        return q

    return lambda: layers(q, k, v)


def torch_attention(cfg: Any, windows: int) -> dict[str, Callable[[], Any]]:
    """The same under each of torch's sdpa backends that accepts it."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    w, t, h, dh = attention_shape(cfg, windows)
    q, k, v = (torch.randn(w, h, t, dh, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    runs = {}
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            continue

        def run(backend=backend):
            with sdpa_kernel(backend), torch.no_grad():
                out = q
                for _ in range(cfg.num_hidden_layers):
                    out = sdpa(out, k, v)
                return out

        try:
            run()
        except RuntimeError:  # this backend refuses the shape or the GPU
            continue
        runs[f"torch sdpa {name.lower()}"] = run
    return runs


def encoder_rows(windows: int) -> dict[str, Callable[[], Any]]:
    """The bench row of `windows` windows: jaxsync's entry and transformers' sdpa forward."""
    from jaxsync.harness.paths.voxtral import bench

    case = next(c for c in bench._encoder_cases("cuda", "released") if f"C={windows}x" in c.name)
    sdpa = case.torch_fns["transformers_sdpa"]
    return {
        "jaxsync encoder + projector": case.jax_fn,
        "transformers sdpa encoder + projector": sdpa,
    }


def main(argv: list[str] | None = None) -> int:
    return 0 if floor_ms(argv) else 2


def _wall_ms(fn: Callable[[], Any], calls: int = 5) -> float:
    """Median wall ms of one blocking call (after a warm one): the smoke run's timer."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def floor_ms(argv: list[str] | None = None) -> dict[str, float]:
    """The figures of one run (ms per part, and the floor); empty when refused."""
    ap = argparse.ArgumentParser(prog="jaxsync bench roofline", description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--out", default=None, help="write the figures here as JSON")
    ap.add_argument("--smoke", action="store_true", help="tiny width, jax side only")
    args = ap.parse_args(argv)
    if not args.smoke:
        from jaxsync.harness.bench._cli import _accelerator_or_reason

        reason = _accelerator_or_reason()
        if reason:
            print(f"jaxsync bench roofline: {reason} (--smoke runs a tiny width on any device)")
            return {}

    from jaxsync.models.voxtral import VoxtralAudioConfig

    cfg = VoxtralAudioConfig()
    if args.smoke:
        cfg = dataclasses.replace(cfg, hidden_size=64, intermediate_size=128,
                                  num_attention_heads=2, num_hidden_layers=2)  # fmt: skip
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    jax_side = _Side("jax")
    ms: dict[str, float] = {}

    def timed(label: str, fn: Callable[[], Any], side: _Side) -> None:
        if args.smoke:  # a CPU check: tiny calls sink below the busy work's noise, so wall time
            ms[label] = _wall_ms(fn)
        else:
            ms[label] = measure(fn, side, repeat=3)["device_ms"]
        print(f"  {label:42s} {ms[label]:8.3f} ms", flush=True)

    ceiling = matmul_tflops(512 if args.smoke else 8192)
    print(f"voxtral encoder, {args.windows} windows; bf16 matmul {ceiling:.0f} TFLOP/s")
    chain, chain_flops = layer_matmuls(cfg, args.windows, dtype)
    timed("layer matmuls, chained", chain, jax_side)
    impl = None if args.smoke else "cudnn"
    timed(
        f"attention, jax {impl or 'xla'}", jax_attention(cfg, args.windows, dtype, impl), jax_side
    )
    if not args.smoke:
        torch_side = _Side("torch")
        for label, fn in torch_attention(cfg, args.windows).items():
            timed(f"attention, {label}", fn, torch_side)
        for label, fn in encoder_rows(args.windows).items():
            timed(label, fn, torch_side if label.startswith("transformers") else jax_side)

    from jaxsync.harness.paths.voxtral.bench import encoder_flops

    total = encoder_flops(cfg, args.windows)
    rest_flops = total - chain_flops - attention_flops(cfg, args.windows)  # conv stem, projector
    rate = chain_flops / (ms["layer matmuls, chained"] * 1e-3)
    attention = min(v for k, v in ms.items() if k.startswith("attention"))
    ms["floor"] = ms["layer matmuls, chained"] + attention + rest_flops / rate * 1e3
    print(f"  layer matmuls at {rate / 1e12:.0f} TFLOP/s ({rate / 1e12 / ceiling:.0%} of the "
          f"ceiling); fastest attention {attention_flops(cfg, args.windows) / attention / 1e9:.0f}"
          f" TFLOP/s")  # fmt: skip
    print(f"  floor (matmuls + fastest attention + stem and projector): {ms['floor']:.3f} ms")
    baseline = ms.get("transformers sdpa encoder + projector")
    if baseline:
        print(f"  floor / transformers sdpa = {ms['floor'] / baseline:.2f}; jaxsync / sdpa = "
              f"{ms['jaxsync encoder + projector'] / baseline:.2f}")  # fmt: skip
    if args.out:
        result = {"windows": args.windows, "matmul_tflops": ceiling, "ms": ms}
        if not args.smoke:  # the versions and card the figures belong to
            from jaxsync.harness.bench._cli import _environment

            result = {**_environment(), **result}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return ms
