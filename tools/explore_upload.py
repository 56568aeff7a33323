"""Host time of one small host->device upload, done different ways (GPU exploration, not a test).

Every per-call metadata upload (`jaxsync.upload_packed`: kv block ids, qwen3_omni's plan on a
new length mix, ...) costs ~0.4-0.5 ms of host time on an H200 host, most of a kv call's. This
times the ways to move the same packed words to the device, interleaved sample by sample with
~30 ms of device work queued (and idle), median of n:

  python tools/explore_upload.py [--words 256 4096] [--n 31] [--paths [--tiny]] [--profile]

- `async_h2d` (what jaxsync does today: a private host copy, then `jax.device_put`)
- `device_put` of the numpy buffer to a device / a `SingleDeviceSharding` / no target
- `device_put` of a list of one buffer (jax's batched path)
- the buffer passed to a jitted consumer as a numpy argument (jit's C++ argument upload), against
  the same consumer given a device array: what the implicit upload adds
- `device_put` to pinned host memory, and pinned host -> device
- the host copy alone (`np.array(copy=True)`)

--paths adds an A/B of whole calls with `_put`'s direct transfer on and off (interleaved, 30 ms
queued): kv `copy_blocks` (512 blocks of the `jaxsync bench kv` released caches, ids uploaded every
call) and a qwen3_omni call on a new length mix (released config; plan cache cleared first, so
each call plans and uploads its metadata). --tiny: the tiny sizes of both (CPU smoke runs).

--profile prints a cProfile of 300 `device_put`s: the Python share of an upload.
"""

from __future__ import annotations

import functools as ft
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.lib import guard_lib, xla_client as xc

import jaxsync
from jaxsync import _transfer
from jaxsync.bench._timing import _Side, blocked_ms


def _arg(name: str, default):
    if name not in sys.argv:
        return default
    i = sys.argv.index(name) + 1
    vals = []
    while i < len(sys.argv) and not sys.argv[i].startswith("--"):
        vals.append(int(sys.argv[i]))
        i += 1
    return vals


def _timed(fn, side: _Side, queued: bool) -> float:
    if queued:
        return blocked_ms(fn, side)
    side.sync()
    t0 = time.perf_counter()
    out = fn()
    ms = (time.perf_counter() - t0) * 1e3
    side.sync(out)
    return ms


def _ways(words: int) -> dict:
    dev = jax.devices()[0]
    single = jax.sharding.SingleDeviceSharding(dev)
    host = np.arange(words, dtype=np.uint32)
    consume = jax.jit(lambda w: w[:1] + 1)  # a trivial consumer of the uploaded words
    on_device = jax.device_put(host, dev)
    ident = jax.jit(lambda w: w)
    ident_to = jax.jit(lambda w: w, out_shardings=single)
    aval = jax.core.ShapedArray(host.shape, host.dtype)

    def explicit(fn):  # the jit argument upload counted as explicit by the transfer guard
        def run():
            state = guard_lib.thread_local_state()
            prev, state.explicit_device_put = state.explicit_device_put, True
            try:
                return fn()
            finally:
                state.explicit_device_put = prev

        return run

    ways = {
        "async_h2d (copy + device_put)": lambda: jaxsync.async_h2d(host),
        "host copy only": lambda: np.array(host, copy=True),
        "device_put(np, device)": lambda: jax.device_put(host, dev),
        "device_put(np, sharding)": lambda: jax.device_put(host, single),
        "device_put(np)": lambda: jax.device_put(host),
        "device_put([np], device)": lambda: jax.device_put([host], dev)[0],
        "jnp.asarray(np)": lambda: jnp.asarray(host),
        "jit(consumer)(device array)": lambda: consume(on_device),
        "jit(consumer)(np)": lambda: consume(host),
        "jit(consumer)(np), explicit": explicit(lambda: consume(host)),
        "identity jit(np), explicit": explicit(lambda: ident(host)),
        "identity jit(np) -> sharding, explicit": explicit(lambda: ident_to(host)),
        "xc.batched_device_put (C++)": lambda: xc.batched_device_put(
            aval, single, [host], [dev], True
        ),
    }
    try:
        pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
        staged = jax.device_put(host, pinned)
        jax.block_until_ready(staged)
        ways["device_put(np, pinned_host)"] = lambda: jax.device_put(host, pinned)
        ways["device_put(pinned array, device)"] = lambda: jax.device_put(staged, single)
    except Exception as err:  # noqa: BLE001 - an exploration: report and go on
        print(f"pinned_host not available: {type(err).__name__}: {err}")
    return ways


def _leaks(ways: dict, words: int, trials: int = 20) -> None:
    """Alias safety: does a host write right after the call reach the uploaded array?"""
    for name in (
        "device_put(np, device)",
        "identity jit(np), explicit",
        "jit(consumer)(np), explicit",
    ):
        leaked = 0
        for _ in range(trials):
            host = np.arange(words, dtype=np.uint32)
            out = ways[name](host)
            host[:] = 7
            leaked += int(np.asarray(out)[0] == 7)  # element 0 is 0 unless the write leaked
        print(f"{words:8d} words: {name:34s} host write leaked in {leaked} of {trials}")


def _ab(name: str, fn, side: _Side, n: int, prep=None) -> None:
    """Host ms of `fn()` with the direct transfer on and off, interleaved, 30 ms queued."""
    direct = _transfer._batched_device_put
    samples = {"direct": [], "device_put": []}
    try:
        for _ in range(n):
            for how in samples:
                _transfer._batched_device_put = direct if how == "direct" else None
                if prep is not None:
                    prep()
                samples[how].append(_timed(fn, side, True))
    finally:
        _transfer._batched_device_put = direct
    med = {how: statistics.median(ms) for how, ms in samples.items()}
    print(f"A/B {name:40s} direct {med['direct']:.3f} | device_put {med['device_put']:.3f} ms")


def _kv_ab(side: _Side, n: int) -> None:
    from jaxsync.kv import copy_blocks
    from jaxsync.kv._bench import SIZES

    cfg = SIZES["tiny" if "--tiny" in sys.argv else "released"]
    layout, names = cfg["layout"], [f"layer{i:02d}" for i in range(cfg["layers"])]
    src = layout.random(names, jax.random.key(0))
    state = {"dst": layout.random(names, jax.random.key(1))}
    rng = np.random.default_rng(0)
    blocks = min(512, layout.num_blocks // 2)
    ids = [(rng.choice(layout.num_blocks, blocks, replace=False),
            rng.choice(layout.num_blocks, blocks, replace=False)) for _ in range(4)]  # fmt: skip
    turn = iter(range(1 << 30))

    def copy():
        s, d = ids[next(turn) % 4]
        state["dst"] = copy_blocks(src, state["dst"], s, d)
        return state["dst"]

    side.sync(copy())
    _ab(f"kv copy_blocks, {blocks} blocks", copy, side, n)


def _qwen3_omni_ab(side: _Side, n: int) -> None:
    from flax import nnx

    from jaxsync.models.qwen3_omni import _reference as ref
    from jaxsync.models.qwen3_omni._model import AudioEncoder
    from jaxsync.models.qwen3_omni._modules import Qwen3OmniAudioTower
    from jaxsync.models.qwen3_omni._verify import BENCH_SECONDS, padded_inputs

    qcfg, bf16 = (ref.TINY if "--tiny" in sys.argv else ref.RELEASED), jnp.bfloat16
    tower = Qwen3OmniAudioTower(qcfg, rngs=nnx.Rngs(0), dtype=bf16, param_dtype=bf16)
    enc = AudioEncoder(tower)
    del tower
    x, lengths = padded_inputs(qcfg, [[s * 100 for s in BENCH_SECONDS]])[0]
    side.sync(enc(x, lengths).embeddings)
    _ab("qwen3_omni call, new length mix", lambda: enc(x, lengths).embeddings, side, n,
        prep=enc._plans.clear)  # fmt: skip
    _ab("qwen3_omni call, cached length mix", lambda: enc(x, lengths).embeddings, side, n)


def main() -> None:
    n = _arg("--n", [31])[0]
    side = _Side("jax")
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    for words in _arg("--words", [256, 4096]):
        ways = _ways(words)
        for fn in ways.values():
            side.sync(fn())
        for queued in (True, False):
            samples = {name: [] for name in ways}
            for _ in range(n):
                for name, fn in ways.items():
                    samples[name].append(_timed(fn, side, queued))
            state = "30 ms queued" if queued else "device idle"
            for name, ms in samples.items():
                print(f"{words:6d} words, {state}: {name:34s} {statistics.median(ms):8.3f} ms")
    dev = jax.devices()[0]
    ident, consume = jax.jit(lambda w: w), jax.jit(lambda w: w[:1] + 0)
    state = guard_lib.thread_local_state()
    state.explicit_device_put = True
    for words in (256, 1 << 22):
        _leaks(
            {
                "device_put(np, device)": lambda h: jax.device_put(h, dev),
                "identity jit(np), explicit": ident,
                "jit(consumer)(np), explicit": consume,
            },
            words,
        )
    state.explicit_device_put = False
    if "--paths" in sys.argv:
        _kv_ab(side, n)
        _qwen3_omni_ab(side, n)
    if "--profile" in sys.argv:
        import cProfile
        import pstats

        host = np.arange(256, dtype=np.uint32)
        dev = jax.devices()[0]
        put = ft.partial(jax.device_put, host, dev)
        side.sync(put())
        profile = cProfile.Profile()
        profile.enable()
        outs = [put() for _ in range(300)]
        profile.disable()
        side.sync(outs[-1])
        pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
