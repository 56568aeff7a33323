"""Where the host time of one qwen3_omni forward goes (GPU exploration, not a test).

Prints, with ~30 ms of device work queued: the whole call, the host planning, the packed upload,
and the jitted program's dispatch alone (same inputs, then rotated inputs). Run it under different
XLA_FLAGS to compare XLA:GPU command-buffer settings.

  python tools/explore_dispatch.py [--tiny] [--per-layer] [--compile-only] [--packed] [--stages]
                                   [--variants [--pin]] [--profile]

The encoder measured passes one argument per state leaf (`pack_weights=None`); --packed adds
the encoders with packed weights (`AudioEncoder(pack_weights="rows"` (the default) / `"flat")`,
fewer jit arguments): their host dispatch, whole-call and device times next to it.

--stages times a whole call's steps one by one (plan lookup, dispatch, output wrapper), with
device work queued and with an idle device.

--variants (with --packed) times, interleaved sample by sample, the rows-packed encoder's whole
call (also without @entry_point, as the second of two back-to-back calls, with the collector
frozen, after 1 ms of busy Python or sleep), its jitted program (jit, AOT compiled) and trivial
programs of 1, 3 and 6 arguments or the encoder's own (the dispatch floor).

--pin (with --variants) runs the variants again with the calling thread pinned to one core
(the others keep their cores): does a call's cold-cache Python come from thread migration?

--dma-latency (with --variants) runs the variants again holding /dev/cpu_dma_latency at 0 (the
CPUs stay out of deep idle states while it is open; needs write access): is the cold call's cost
a core waking up? It prints the host's cpuidle states first.

--profile prints a cProfile of 200 whole calls (same input): the host time around the dispatch.

--per-layer builds the encoder with `scan_layers=False` (one array per layer weight) instead of
the default stacked weights run by one lax.scan: run it with and without for the A/B.
--compile-only prints the argument count and the lower/compile
times of the first call and stops (no execution; for slow hosts).
"""

from __future__ import annotations

import functools as ft
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

import jaxsync
from jaxsync.bench._timing import _Side, blocked_ms, measure
from jaxsync.models.qwen3_omni import _reference as ref
from jaxsync.models.qwen3_omni._model import AudioEmbeddings, AudioEncoder
from jaxsync.models.qwen3_omni._modules import Qwen3OmniAudioTower
from jaxsync.models.qwen3_omni._verify import BENCH_SECONDS, padded_inputs


def _blocked(side: _Side, fn, n: int = 7) -> float:
    return statistics.median(blocked_ms(fn, side) for _ in range(n))


def main() -> None:
    cfg = ref.TINY if "--tiny" in sys.argv else ref.RELEASED
    dtype = jnp.float32 if "--tiny" in sys.argv else jnp.bfloat16
    lens = [s * 100 for s in BENCH_SECONDS] if cfg is ref.RELEASED else [130, 57, 410, 260]
    scan = "--per-layer" not in sys.argv
    tower = Qwen3OmniAudioTower(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
    enc = AudioEncoder(tower, scan_layers=scan, pack_weights=None)  # one argument per leaf
    packs = ("rows", "flat") if "--packed" in sys.argv and scan else ()
    packed_encs = {how: AudioEncoder(tower, pack_weights=how) for how in packs}
    del tower  # with stacked layers the encoders hold their stacked copies only
    rotation = padded_inputs(cfg, [lens] * 3)
    side = _Side("jax")
    x, lengths = rotation[0]
    plan = enc.plan(tuple(x.shape), lengths)
    meta = jaxsync.upload_packed(plan.device_fields())
    t0 = time.perf_counter()
    lowered = enc._jitted.lower(enc._leaves, x, meta)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    text = compiled.as_text()
    # XLA:GPU forms command buffers (CUDA graphs) from the thunk sequence, after HLO: the text
    # shows the launches they group, not the graphs. A scan's loop body is counted once.
    launches = text.count(" fusion(") + text.count("custom-call(")
    print(
        f"scan_layers={scan} | state leaves {len(enc._leaves)} | jit args "
        f"{len(jax.tree.leaves(lowered.args_info))} | fusions + custom calls {launches} (static) | "
        f"lower {t1 - t0:.2f} s, compile {t2 - t1:.2f} s | StableHLO {len(lowered.as_text())} chars"
    )
    if "--compile-only" in sys.argv:
        return
    side.sync(enc(x, lengths).embeddings)
    it = iter(range(10**9))
    rows = {
        "whole call (rotated)": lambda: enc(*rotation[next(it) % 3]).embeddings,
        "whole call (same input)": lambda: enc(x, lengths).embeddings,
        "plan only": lambda: enc.plan(tuple(x.shape), lengths),
        "plan + upload": lambda: jaxsync.upload_packed(
            enc.plan(tuple(x.shape), lengths).device_fields()
        ),
        "jit dispatch (same args)": lambda: enc._forward(x, meta),
        "jit dispatch (rotated x)": lambda: enc._forward(rotation[next(it) % 3][0], meta),
    }
    many = jax.jit(lambda leaves: leaves[0] + 1)  # a trivial program with as many arguments
    side.sync(many(enc._leaves))
    rows[f"trivial jit, {len(enc._leaves)} args"] = lambda: many(enc._leaves)
    one = enc._leaves[0]
    rows["trivial jit, 1 arg"] = lambda: many([one])
    side.sync(many([one]))
    if packed_encs:  # the weights packed: all, the vectors only, or layer by layer in rows
        device = {"default": lambda: enc._forward(x, meta)}
        for how, penc in packed_encs.items():
            fn = device[how] = ft.partial(penc._forward, x, meta)
            side.sync(fn())
            rows[f"jit dispatch, pack {how}: {len(penc._leaves)} args"] = fn
            rows[f"whole call, pack {how}"] = lambda penc=penc: penc(x, lengths).embeddings
        for name, fn in device.items():
            m = measure(fn, side, repeat=3)
            print(f"device time, {name} weights: {m['device_ms']:.3f} ms/fwd")
    for name, fn in rows.items():
        print(f"{name:28s} {_blocked(side, fn):8.3f} ms host")
    if "--stages" in sys.argv:  # a whole call's host time split into its steps
        for how, e in {"default": enc, **packed_encs}.items():
            _stages(e, x, lengths, side, how)
    if "--variants" in sys.argv and "rows" in packed_encs:
        _variants(packed_encs["rows"], x, lengths, side)
        if "--pin" in sys.argv:  # the same with the calling thread kept on one core
            import os

            core = sorted(os.sched_getaffinity(0))[-1]
            os.sched_setaffinity(0, {core})  # Linux: pid 0 is the calling thread only
            print(f"== calling thread pinned to core {core}")
            _variants(packed_encs["rows"], x, lengths, side)
    if "--dma-latency" in sys.argv and "rows" in packed_encs:
        _with_dma_latency(lambda: _variants(packed_encs["rows"], x, lengths, side))
    if "--profile" in sys.argv:  # where a whole call's host time goes beyond the jit dispatch
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.enable()
        for _ in range(200):
            enc(x, lengths)
        profile.disable()
        side.sync()
        pstats.Stats(profile).sort_stats("tottime").print_stats(15)


def _with_dma_latency(run) -> None:
    """Runs `run()` with /dev/cpu_dma_latency held at 0 us, after printing the idle states."""
    import glob
    import pathlib
    import struct

    for state in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cpuidle/state*")):
        name, latency = (pathlib.Path(state, f).read_text().strip() for f in ("name", "latency"))
        print(f"cpuidle {pathlib.Path(state).name}: {name}, exit latency {latency} us")
    try:
        fd = open("/dev/cpu_dma_latency", "wb", buffering=0)  # noqa: SIM115 - held open below
        fd.write(struct.pack("i", 0))
    except OSError as err:
        print(f"== /dev/cpu_dma_latency not writable ({err}): variants not repeated")
        return
    try:
        print("== /dev/cpu_dma_latency held at 0")
        run()
    finally:
        fd.close()


def _stages(enc: AudioEncoder, x, lengths, side: _Side, how) -> None:
    """`AudioEncoder.__call__`'s steps timed one by one, with device work queued and without."""
    shape = tuple(x.shape)

    def call():
        t = [time.perf_counter()]
        planned = enc._planned(shape, lengths)
        t.append(time.perf_counter())
        out = enc._forward(x, planned.meta)
        t.append(time.perf_counter())
        emb = AudioEmbeddings(out, planned.tokens, planned.offsets)
        t.append(time.perf_counter())
        return emb.embeddings, [(b - a) * 1e3 for a, b in zip(t, t[1:], strict=False)]

    for queued in (True, False):
        samples = []
        for _ in range(9):
            side.sync()
            if queued:
                side.spin()
            t0 = time.perf_counter()
            out, parts = call()
            samples.append([(time.perf_counter() - t0) * 1e3, *parts])
            side.sync(out)
        med = [statistics.median(col) for col in zip(*samples, strict=True)]
        print(
            f"stages, pack {how}, {'queued' if queued else 'idle  '}: total {med[0]:.3f} | plan "
            f"lookup {med[1]:.3f} | dispatch {med[2]:.3f} | wrap {med[3]:.3f} ms"
        )


def _variants(enc: AudioEncoder, x, lengths, side: _Side, n: int = 31) -> None:
    """Ways to dispatch the rows-packed program and parts of a call, host ms (median of n,
    device work queued, the variants interleaved sample by sample so that drift of the host
    spreads over all of them); trivial programs taking 1, 3 or 6 arguments (the dispatch floor
    per argument count); the second of two back-to-back calls; the collector frozen and off;
    the call 1 ms after the queued work."""
    import gc

    shape = tuple(x.shape)
    planned = enc._planned(shape, lengths)
    args = (enc._leaves, x, planned.meta)
    compiled = enc._jitted.lower(*args).compile()
    trivial = jax.jit(lambda bufs, f, m: f[0, 0] + 1)  # the same arguments, no work
    unwrapped = type(enc).__call__.__wrapped__  # __call__ without @entry_point

    def lookup_then_jit():
        return enc._jitted(enc._leaves, x, enc._planned(shape, lengths).meta)

    fns = {
        "whole call": lambda: enc(x, lengths).embeddings,
        "whole call without @entry_point": lambda: unwrapped(enc, x, lengths).embeddings,
        "plan lookup + jit": lookup_then_jit,
        "jit": lambda: enc._jitted(*args),
        "AOT compiled": lambda: compiled(*args),
        f"trivial program, same {len(jax.tree.leaves(args))} args": lambda: trivial(*args),
        "plan lookup only": lambda: enc._planned(shape, lengths),
    }
    pool = [*enc._leaves, x, planned.meta.buffer, *(jnp.full(8, float(i)) for i in range(6))]
    first = jax.jit(lambda arrays: arrays[0].reshape(-1)[0] + 1)
    for k in (1, 3, 6):
        fns[f"trivial program, {k} args"] = ft.partial(first, pool[:k])

    def second_of_two(fn):
        side.sync()
        side.spin()
        fn()
        t0 = time.perf_counter()
        out = fn()
        ms = (time.perf_counter() - t0) * 1e3
        side.sync(out)
        return ms

    def after(fn, busy: bool):
        # 1 ms between the spin and the call, spent running Python or sleeping: is the cold
        # call's cost the thread's sleep in sync(), or the dispatches before it?
        side.sync()
        side.spin()
        t0 = time.perf_counter()
        if busy:
            while time.perf_counter() - t0 < 1e-3:
                pass
        else:
            time.sleep(1e-3)
        t0 = time.perf_counter()
        out = fn()
        ms = (time.perf_counter() - t0) * 1e3
        side.sync(out)
        return ms

    def frozen(fn):
        gc.freeze()
        gc.disable()
        try:
            return blocked_ms(fn, side)
        finally:
            gc.enable()
            gc.unfreeze()

    whole, jit = fns["whole call"], fns["jit"]
    timers = {name: ft.partial(blocked_ms, fn, side) for name, fn in fns.items()}
    timers["whole call, second of two"] = ft.partial(second_of_two, whole)
    timers["jit, second of two"] = ft.partial(second_of_two, jit)
    timers["whole call, gc frozen and off"] = ft.partial(frozen, whole)
    timers["whole call after 1 ms of busy Python"] = ft.partial(after, whole, True)
    timers["whole call after a 1 ms sleep"] = ft.partial(after, whole, False)
    timers["jit after 1 ms of busy Python"] = ft.partial(after, jit, True)
    for fn in fns.values():
        side.sync(fn())
    samples = {name: [] for name in timers}
    for _ in range(n):
        for name, timer in timers.items():
            samples[name].append(timer())
    for name, ms in samples.items():
        print(f"variant {name:40s} {statistics.median(ms):8.3f} ms host")


if __name__ == "__main__":
    main()
