"""Host time of a tower entry at released width, cold and in a stream, next to what bounds it.

`entry` builds the voxtral encoder at its released width (random bf16 weights) at each depth of
`--depths` and times, behind ~30 ms of queued device work (the bench's harness):

- the entry call, its `TowerProgram` called directly on the same packed arguments, and a
  do-nothing jit taking those same arguments;
- the same program over the tower's flat stacked leaves (`packed=False`, the server form's
  arguments) and a do-nothing jit taking those: what packing the state buys per call;
- "cold": one call right after the thread waited for the device; "stream": calls 2..k of k
  back-to-back calls, median.

With `--command-buffers` the program is also compiled with XLA command buffers for its layer
loop (per-jit compiler options), and its device time is printed next to the plain program's.

`programs` times synthetic jits (big outputs, long kernel chains, loops, attention,
convolution, sort) the same way: which program features cost the calling thread.

    jaxsync bench host-time entry --depths 2 8 32 [--command-buffers]
    jaxsync bench host-time programs
    jaxsync bench host-time entry --smoke   # tiny width, few samples: a CPU check
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsync._tower import TowerProgram
from jaxsync.harness.bench._timing import _Side, blocked_ms, measure, stream_ms


# XLA's default command-buffer kinds plus the loop kinds, so a layer scan is one CUDA graph.
COMMAND_BUFFERS = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE",
    "xla_gpu_graph_min_graph_size": 1,
}


def host_us(fn: Callable[[], Any], side: _Side, *, samples: int = 15, k: int = 8) -> tuple:
    """(cold µs, stream µs) of `fn` behind queued work: medians of `samples` cold calls and of
    calls 2..k of `samples // 3` bursts."""
    side.sync(fn())
    cold = statistics.median(blocked_ms(fn, side) for _ in range(samples)) * 1e3
    return cold, stream_ms(fn, side, repeat=max(1, samples // 3), k=k) * 1e3


def _samples(args: argparse.Namespace) -> int:
    return 3 if args.smoke else 15


def _voxtral(depth: int, smoke: bool):
    from jaxsync.models.voxtral import (
        MelConfig,
        VoxtralAudioConfig,
        VoxtralAudioEncoder,
        VoxtralAudioTower,
    )

    cfg = VoxtralAudioConfig()
    if smoke:
        cfg = dataclasses.replace(cfg, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                                  max_source_positions=200)  # fmt: skip
    cfg = dataclasses.replace(cfg, num_hidden_layers=depth)
    tower = VoxtralAudioTower(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    enc = VoxtralAudioEncoder(tower, MelConfig(num_mel_bins=cfg.num_mel_bins))
    windows = 1 if smoke else 4
    mel = np.random.default_rng(0).uniform(-1, 2, (windows, cfg.num_mel_bins, cfg.chunk_frames))
    return tower, enc, jax.device_put(mel.astype(np.float32))


def _program_inputs(enc: Any, mel: jax.Array) -> tuple:
    """The arguments the entry hands its program (recorded from one call)."""
    program = enc.program
    seen = {}
    jitted = program._jitted  # a tool's private access: wrapped for one call

    def record(state, *inputs):
        seen["inputs"] = inputs
        return jitted(state, *inputs)

    program._jitted = record
    try:
        enc._calls.clear()  # the full path, which builds the kept call around `record`
        jax.block_until_ready(enc(input_features=mel).embeddings)
    finally:
        program._jitted = jitted
        enc._calls.clear()
    return program, seen["inputs"]


def entry(args: argparse.Namespace) -> None:
    side = _Side("jax")
    for depth in args.depths:
        tower, enc, mel = _voxtral(depth, args.smoke)
        program, inputs = _program_inputs(enc, mel)
        # The same forward and jit options over the flat leaves (a tool's private access).
        stacked = TowerProgram(tower, program._forward, packed=False, **program._jit_kwargs)
        nothing = jax.jit(lambda state, *rest: rest[0][0, 0, 0])
        fns = {
            "entry": lambda enc=enc, mel=mel: enc(input_features=mel).embeddings,
            "its program": lambda p=program, i=inputs: p._jitted(p.leaves, *i),
            "do-nothing, same args": lambda p=program, i=inputs, f=nothing: f(p.leaves, *i),
            f"program, {stacked.num_state_args} leaves": (
                lambda p=stacked, i=inputs: p._jitted(p.leaves, *i)
            ),
            "do-nothing, leaves": lambda p=stacked, i=inputs, f=nothing: f(p.leaves, *i),
        }
        for name, fn in fns.items():
            cold, stream = host_us(fn, side, samples=_samples(args))
            print(f"depth {depth:2d}  {name:22s} cold {cold:7.1f} us   stream {stream:7.1f} us")
        if args.command_buffers:
            plain = measure(fns["entry"], side, repeat=3)["device_ms"]
            # The entry's program recompiled with command buffers (a tool's private access).
            enc.program._jitted = jax.jit(
                enc.program._jitted.__wrapped__, compiler_options=COMMAND_BUFFERS
            )
            cold, stream = host_us(fns["entry"], side, samples=_samples(args))
            graphs = measure(fns["entry"], side, repeat=3)["device_ms"]
            print(f"depth {depth:2d}  entry, command buffers  cold {cold:7.1f} us   stream "
                  f"{stream:7.1f} us   device {graphs:.2f} ms (plain {plain:.2f} ms)")  # fmt: skip


def _chain(k: int) -> Callable:
    def f(a):
        for _ in range(k):
            a = jnp.tanh(a @ a * 0.01)
        return a

    return jax.jit(f)


def programs(args: argparse.Namespace) -> None:
    side = _Side("jax")
    n = 64 if args.smoke else 1024
    x = jnp.ones((n, n), jnp.bfloat16)
    big = jnp.ones((1024,) if args.smoke else (64 << 20,), jnp.float32)
    q = jnp.ones((4, 16 if args.smoke else 1536, 20, 64), jnp.bfloat16)
    conv_in = jnp.ones((4, 300 if args.smoke else 3000, 128), jnp.bfloat16)
    conv_w = jnp.ones((3, 128, 1280), jnp.bfloat16)
    chains = (1, 10) if args.smoke else (1, 10, 50, 200)
    impls = ["xla"] if jax.default_backend() != "gpu" else ["cudnn", "xla"]

    def attention(impl):
        return lambda q: jax.nn.dot_product_attention(q, q, q, implementation=impl)

    def attention_loop(impl):
        once = attention(impl)
        return lambda q: jax.lax.fori_loop(0, 32, lambda i, q: once(q), q)

    cases: dict[str, tuple[Callable, tuple]] = {
        "do-nothing": (jax.jit(lambda a: a[:1]), (big,)),
        f"elementwise over {big.nbytes >> 20} MiB": (jax.jit(lambda a: a + 1), (big,)),
        **{f"chain of {k} matmul + tanh": (_chain(k), (x,)) for k in chains},
        "200-step fori_loop": (
            jax.jit(lambda a: jax.lax.fori_loop(0, 200, lambda i, a: jnp.tanh(a @ a * 0.01), a)),
            (x,),
        ),
        **{f"attention ({impl})": (jax.jit(attention(impl)), (q,)) for impl in impls},
        **{
            f"32 attentions ({impl}) in a loop": (
                jax.jit(attention_loop(impl)),
                (q,),
            )
            for impl in impls
        },
        "conv1d 128 -> 1280": (
            jax.jit(
                lambda c, w: jax.lax.conv_general_dilated(
                    c, w, (1,), ((1, 1),), dimension_numbers=("NWC", "WIO", "NWC")
                )
            ),
            (conv_in, conv_w),
        ),  # fmt: skip
        "sort": (jax.jit(lambda a: jnp.sort(a.reshape(-1))[:4]), (x,)),
    }
    for name, (fn, fn_args) in cases.items():
        cold, stream = host_us(lambda fn=fn, a=fn_args: fn(*a), side, samples=_samples(args))
        print(f"{name:34s} cold {cold:7.1f} us   stream {stream:7.1f} us")
    # Donation: each call consumes the previous call's output (a kv cache's calling pattern).
    cache = (1024, 16, 8, 128) if not args.smoke else (16, 4, 2, 8)  # blocks, block, heads, dim
    ids = jnp.asarray(np.random.default_rng(0).permutation(cache[0])[: cache[0] // 2], jnp.int32)
    chains = {
        "donated pass-through": jax.jit(lambda c, i: c, donate_argnums=0),
        "donated one-block write": jax.jit(lambda c, i: c.at[i[0]].set(c[i[1]]), donate_argnums=0),
        f"donated {len(ids)}-block scatter": jax.jit(
            lambda c, i: c.at[i].set(c[jnp.roll(i, 1)]), donate_argnums=0
        ),
        "same scatter, not donated": jax.jit(lambda c, i: c.at[i].set(c[jnp.roll(i, 1)])),
    }
    for name, fn in chains.items():
        state = {"c": jnp.zeros(cache, jnp.bfloat16)}

        def step(fn=fn, state=state):
            state["c"] = fn(state["c"], ids)
            return state["c"]

        cold, stream = host_us(step, side, samples=_samples(args))
        print(f"{name:34s} cold {cold:7.1f} us   stream {stream:7.1f} us")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="jaxsync bench host-time", description=__doc__.splitlines()[0]
    )
    sub = ap.add_subparsers(dest="mode", required=True)
    e = sub.add_parser("entry", help="the voxtral entry at each depth")
    e.add_argument("--depths", type=int, nargs="+", default=[2, 32])
    e.add_argument("--command-buffers", action="store_true")
    e.add_argument("--smoke", action="store_true", help="tiny width, few samples (a CPU check)")
    p = sub.add_parser("programs", help="synthetic programs")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, few samples (a CPU check)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    (entry if args.mode == "entry" else programs)(args)
    print(f"({time.perf_counter() - t0:.0f} s, {jax.devices()[0].device_kind})")
    return 0
