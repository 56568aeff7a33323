"""qwen3_omni with the layer scan unrolled: host dispatch, device time, compile time (GPU
exploration, not a test).

Under the default GPU client XLA launches every kernel of a program from the calling thread, and
the encoder's while loop over 32 layers costs ~0.8 ms of host time per call. An unrolled scan is
straight-line code that XLA can put into fewer, longer command buffers (CUDA graphs). For each
unroll factor this builds the released-size encoder (rows-packed weights, the default), traces
it with `jax.lax.scan(..., unroll=k)`, and prints compile seconds, device ms per forward, and the
host ms of the jitted program and of a whole call with ~30 ms of device work queued (median of
15). Run it under both runtime clients.

  python tools/explore_unroll.py [--unroll 1 4 32] [--tiny]
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsync.bench._timing import _Side, blocked_ms, measure
from jaxsync.models.qwen3_omni import _reference as ref
from jaxsync.models.qwen3_omni._model import AudioEncoder
from jaxsync.models.qwen3_omni._modules import Qwen3OmniAudioTower
from jaxsync.models.qwen3_omni._verify import BENCH_SECONDS, padded_inputs


def _factors() -> list[int]:
    if "--unroll" not in sys.argv:
        return [1, 4, 32]
    rest = sys.argv[sys.argv.index("--unroll") + 1 :]
    return [int(a) for a in rest if a.isdigit()]


def main() -> None:
    tiny = "--tiny" in sys.argv
    cfg, dtype = (ref.TINY, jnp.float32) if tiny else (ref.RELEASED, jnp.bfloat16)
    lens = [130, 57, 410, 260] if tiny else [s * 100 for s in BENCH_SECONDS]
    tower = Qwen3OmniAudioTower(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
    x, lengths = padded_inputs(cfg, [lens])[0]
    side = _Side("jax")
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    reference = None
    scan = jax.lax.scan
    for k in _factors():
        enc = AudioEncoder(tower)

        def unrolled(*args, _k=k, **kwargs):
            kwargs.setdefault("unroll", _k)
            return scan(*args, **kwargs)

        jax.lax.scan = unrolled  # only while this encoder traces (its first call)
        try:
            t0 = time.perf_counter()
            out = jax.block_until_ready(enc(x, lengths).embeddings)
            compile_s = time.perf_counter() - t0
        finally:
            jax.lax.scan = scan
        if reference is None:
            reference = out
        same = bool(jnp.array_equal(out, reference))
        meta = enc._planned(tuple(x.shape), lengths).meta
        program = lambda enc=enc, meta=meta: enc._jitted(enc._leaves, x, meta)  # noqa: E731
        whole = lambda enc=enc: enc(x, lengths).embeddings  # noqa: E731
        device = measure(whole, side, repeat=3)["device_ms"]
        jit_ms = statistics.median(blocked_ms(program, side) for _ in range(15))
        call_ms = statistics.median(blocked_ms(whole, side) for _ in range(15))
        print(
            f"unroll {k:3d}: first call {compile_s:6.1f} s | device {device:7.3f} ms/fwd | "
            f"jit {jit_ms:.3f} ms host | whole call {call_ms:.3f} ms host | "
            f"bit-identical to unroll {_factors()[0]}: {same}",
            flush=True,
        )
        del enc


if __name__ == "__main__":
    main()
