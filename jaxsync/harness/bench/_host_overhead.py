"""Host time of every entry call against a do-nothing jit with as many arguments (CPU or GPU).

Each entry runs at a tiny config on device-resident inputs already padded to its bucket, on a
plan-cache hit (the same shape mix as the previous call). For each entry it prints the mean
host time per call (median of repeats), the host time of a do-nothing `jax.jit` taking the same
number of array arguments as the entry's main program, and the difference. Where the entry runs
a `jaxsync.TowerProgram`, it also prints that program's jit call alone on the same arguments
("program us": on CPU a real program costs more to dispatch than a do-nothing one) and the
entry's time with that dispatch replaced by returning earlier outputs ("python us": the
checks, plans and output the entry adds, free of the runtime's noise).

    jaxsync bench host-overhead                          # every entry
    jaxsync bench host-overhead --only glm4v kv          # entries whose name starts so
    jaxsync bench host-overhead --profile glm4v.vision_tower  # cProfile of one entry's hot path
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxsync
from jaxsync._calls import CallCache
from jaxsync.harness.bench._programs import main_program_args
from jaxsync.harness.bench._timing import _noop


def _glm4v():
    from jaxsync.harness.paths.glm4v import reference as ref
    from jaxsync.models.glm4v import Glm4vVisionConfig, Glm4vVisionEncoder, Glm4vVisionTower

    enc = Glm4vVisionEncoder(Glm4vVisionTower(Glm4vVisionConfig(**ref.TINY), rngs=nnx.Rngs(0)))
    grid = [[1, 4, 6], [1, 6, 6]]
    plan = enc.plan(grid, 60)
    pixels = jnp.zeros((plan.padded_patches, enc.cfg.patch_dim), enc.dtype)
    return lambda: enc(pixels, grid)


def _voxtral():
    from jaxsync.harness.paths.voxtral import reference as ref
    from jaxsync.models.voxtral import (
        MelConfig,
        VoxtralAudioConfig,
        VoxtralAudioEncoder,
        VoxtralAudioTower,
    )

    cfg = VoxtralAudioConfig(**ref.TINY_ENCODER)
    enc = VoxtralAudioEncoder(VoxtralAudioTower(cfg, rngs=nnx.Rngs(0)), MelConfig())
    feats = jnp.zeros((4, cfg.num_mel_bins, cfg.chunk_frames), jnp.float32)
    counts = [1, 2]
    return lambda: enc(input_features=feats, num_chunks=counts)


def _gemma3n():
    from jaxsync.harness.paths.gemma3n import reference as ref
    from jaxsync.models.gemma3n import Gemma3nAudioEncoder, Gemma3nAudioModel

    cfg = ref.tiny_config()
    enc = Gemma3nAudioEncoder(Gemma3nAudioModel(cfg, rngs=nnx.Rngs(0)), frame_buckets=64)
    feats = jnp.zeros((3, 57, cfg.input_feat_size), jnp.float32)
    mask = np.arange(57)[None, :] < np.array([57, 40, 13])[:, None]  # [3, 57] real frames
    return lambda: enc(feats, mask)


def _chameleon_encoder():
    from jaxsync.harness.paths.chameleon import reference as ref
    from jaxsync.models.chameleon import ChameleonImageEncoder

    return ChameleonImageEncoder(ref.tiny_tower(), buckets=(4,))


def _chameleon_tokens():
    enc = _chameleon_encoder()
    pixels = jnp.zeros((4, *enc.image_shape), jnp.float32)
    return lambda: enc(pixels)


def _chameleon_mask():
    enc = _chameleon_encoder()
    logits = jnp.zeros((5, enc.cfg.vocab_size), jnp.float32)
    return lambda: enc.mask_image_logits(logits)


def _chameleon_merge():
    enc = _chameleon_encoder()
    text = jnp.zeros((2, 41, enc.cfg.hidden_size), jnp.float32)
    image = jnp.zeros((13, enc.cfg.hidden_size), jnp.float32)
    positions = np.arange(30, 39, dtype=np.int32)

    def call():
        return enc.merge_image_embeddings(text, image, positions=positions, num_image_tokens=9)

    return call


def _qwen3_omni():
    from jaxsync.harness.paths.qwen3_omni import reference as ref
    from jaxsync.harness.paths.qwen3_omni.verify import ONE_BUCKET_MIXES, padded_inputs
    from jaxsync.models.qwen3_omni import Qwen3OmniAudioEncoder, Qwen3OmniAudioTower

    enc = Qwen3OmniAudioEncoder(Qwen3OmniAudioTower(ref.TINY, rngs=nnx.Rngs(0)))
    feats, lens = padded_inputs(ref.TINY, ONE_BUCKET_MIXES[:1])[0]
    return lambda: enc(feats, lens)


def _kv_layout():
    from jaxsync import kv

    layout = kv.KVLayout(kind="packed", num_blocks=64, block_size=4, num_kv_heads=2, head_dim=8,
                         stacked=True)  # fmt: skip
    return kv, layout.random([f"layer{i}" for i in range(4)], jax.random.key(0))


def _kv_copy():
    kv, cache = _kv_layout()
    state = {"cache": cache}
    src, dst = [1, 2, 3], [10, 11, 12]

    def call():  # a copy within one cache: the output replaces the donated input
        state["cache"] = kv.copy_blocks(state["cache"], state["cache"], src, dst)
        return state["cache"]

    return call


def _kv_extract():
    kv, cache = _kv_layout()
    slots = [5, 6, 7, 40, 41]
    return lambda: kv.extract_kv(cache, slots)


def _kv_inject():
    kv, cache = _kv_layout()
    slots = [5, 6, 7, 40, 41]
    state = {"cache": cache, "rows": kv.extract_kv(cache, slots)}

    def call():
        state["cache"] = kv.inject_kv(state["cache"], state["rows"], slots)
        return state["cache"]

    return call


ENTRIES: dict[str, Callable[[], Callable[[], object]]] = {
    "glm4v.vision_tower": _glm4v,
    "voxtral.features": _voxtral,
    "gemma3n.audio": _gemma3n,
    "chameleon.tokens": _chameleon_tokens,
    "chameleon.mask": _chameleon_mask,
    "chameleon.merge": _chameleon_merge,
    "qwen3_omni.audio": _qwen3_omni,
    "kv.copy_blocks": _kv_copy,
    "kv.extract_kv": _kv_extract,
    "kv.inject_kv": _kv_inject,
}


def per_call_us(
    fn: Callable[[], object], calls: int, repeats: int, stat=statistics.median
) -> float:
    """`stat` (median) over `repeats` of the mean host time of one call, in us.

    Each call is timed alone and its outputs are waited for before the next one: the device
    is idle when a call starts, so the time is the host's (dispatch, checks, plans), not the
    device's. Slow programs get fewer calls (about 2 s per repeat).
    """
    jax.block_until_ready(fn())
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    calls = max(20, min(calls, int(2.0 / max(time.perf_counter() - t0, 1e-6))))
    means = []
    for _ in range(repeats):
        total = 0.0
        for _ in range(calls):
            t0 = time.perf_counter()
            out = fn()
            total += time.perf_counter() - t0
            jax.block_until_ready(out)
        means.append(total / calls * 1e6)
    return stat(means)


def _main_program(call: Callable[[], object]):
    """(TowerProgram, inputs) of the entry's program dispatch in one call, or None."""
    seen = []
    original, original_prepared = jaxsync.TowerProgram.__call__, jaxsync.TowerProgram.prepared

    def spy(self, *inputs):
        seen.append((self, inputs))
        return original(self, *inputs)

    def spy_prepared(self, *rest, **kwargs):  # an entry's kept call: see its first input
        run = original_prepared(self, *rest, **kwargs)

        def recorded(x):
            if not seen:
                seen.append((self, (x, *rest)))
            return run(x)

        return recorded

    find = CallCache.find
    CallCache.find = lambda self, x, *m: (None, find(self, x, *m)[1])  # the full path
    jaxsync.TowerProgram.__call__ = spy
    jaxsync.TowerProgram.prepared = spy_prepared
    try:
        jax.block_until_ready(call())
    finally:
        jaxsync.TowerProgram.__call__ = original
        jaxsync.TowerProgram.prepared = original_prepared
        CallCache.find = find
    return seen[0] if seen else None


def program_call(call: Callable[[], object]) -> Callable[[], object] | None:
    """The entry's main `TowerProgram` dispatch alone, on the arguments one call passes it
    (None for an entry without one): the runtime's own cost of that program, no checks."""
    found = _main_program(call)
    if found is None:
        return None
    program, inputs = found
    return lambda: program._jitted(program.leaves, *inputs)


def python_us(call: Callable[[], object], calls: int, repeats: int, stat) -> float | None:
    """Host time of the entry with its program's dispatch replaced by returning the outputs
    of an earlier dispatch: its own Python alone (None without a `TowerProgram`)."""
    found = _main_program(call)
    if found is None:
        return None
    program, inputs = found
    jitted = program._jitted
    outputs = jitted(program.leaves, *inputs)
    program._jitted = lambda *args: outputs  # this instance only, restored below
    try:
        return per_call_us(call, calls, repeats, stat)
    finally:
        program._jitted = jitted


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="jaxsync bench host-overhead", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--only", nargs="*", help="entry name prefixes (default: all)")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--profile", choices=list(ENTRIES), help="cProfile this entry's hot path instead"
    )
    ap.add_argument(
        "--stat", choices=("median", "min"), default="median",
        help="over the repeats (min: steadier on a loaded machine)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.profile:
        call = ENTRIES[args.profile]()
        jax.block_until_ready(call())
        prof = cProfile.Profile()
        for _ in range(args.calls):  # the device idle at each call, as timed
            jax.block_until_ready(prof.runcall(call))
        pstats.Stats(prof).sort_stats("cumtime").print_stats(40)
        return 0
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; jaxsync {jaxsync.__name__}")
    print(f"{'entry':22} {'entry us':>9} {'floor us (same args)':>21} {'overhead us':>12} "
          f"{'jit args':>9} {'program us':>11} {'python us':>10}")  # fmt: skip
    stat = min if args.stat == "min" else statistics.median
    for name, build in ENTRIES.items():
        if args.only and not any(name.startswith(p) for p in args.only):
            continue
        n = main_program_args(build())  # traced on its own copy: a chain keeps no tracer
        call = build()
        entry = per_call_us(call, args.calls, args.repeats, stat)
        floor = per_call_us(_noop(n), args.calls, args.repeats, stat)
        raw = program_call(call)
        prog = "" if raw is None else f"{per_call_us(raw, args.calls, args.repeats, stat):11.1f}"
        own = python_us(call, args.calls, args.repeats, stat)
        own = "" if own is None else f"{own:10.1f}"
        print(f"{name:22} {entry:9.1f} {floor:21.1f} {entry - floor:12.1f} {n:9d} {prog:>11} "
              f"{own:>10}", flush=True)  # fmt: skip
    return 0
