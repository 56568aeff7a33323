"""Device time of one layer scan with its weights stored five ways: does the packing cost time?

A scan over L layers at the voxtral encoder's width (rows x d, MLP f) reads each layer's
weights (four [d, d], one [d, f], one [f, d]) from:

- "stacked":       one [L, ...] array per weight (the layout a plain `nnx.scan` state has);
- "rows, slice":   one [L, N] buffer, row i sliced statically per weight (`jaxsync.PackedTower`);
- "rows, dynamic": the same buffer, each weight a `dynamic_slice` of (i, offset);
- "size groups":   one [L, G, S] buffer per weight size, `dynamic_slice` of (i, g, 0);
- "kind-major":    one 1-D buffer, weight k of layer i at offset_k + i * size_k.

Each form computes the same thing (checked bit for bit); the table prints device ms per call.

    python tools/layer_slices.py            # released width, 32 layers (a GPU)
    python tools/layer_slices.py --unrolled # also each form as a Python loop (constant slices)
    python tools/layer_slices.py --smoke    # tiny sizes: a CPU check of the tool
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def _layer(x, w, small):
    h = jnp.tanh(x @ w["q"] + x @ w["k"] + x @ w["v"]) @ w["o"]
    h2 = jax.nn.relu(x @ w["fc1"]) @ w["fc2"]
    return (x + (h + h2) * small[0][None] + small[1][None]).astype(x.dtype)  # [rows, d]


def forms(layers: int, d: int, f: int, seed: int = 0) -> dict[str, tuple[Callable, list]]:
    """name -> (weights_of(buffers, i) -> {name: array}, buffers) for each storage form."""
    shapes = {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d), "fc1": (d, f), "fc2": (f, d)}
    key = jax.random.key(seed)
    stacked = {
        n: jax.random.normal(jax.random.fold_in(key, j), (layers, *s), jnp.bfloat16) * 0.02
        for j, (n, s) in enumerate(shapes.items())
    }
    names = list(shapes)
    size = {n: int(np.prod(shapes[n])) for n in names}
    offset = dict(zip(names, np.cumsum([0] + [size[n] for n in names]).tolist(), strict=False))
    rows = jnp.concatenate([stacked[n].reshape(layers, -1) for n in names], axis=1)  # [L, N]
    groups = {s: [n for n in names if size[n] == s] for s in sorted(set(size.values()))}
    grouped = [jnp.stack([stacked[n].reshape(layers, -1) for n in g], 1) for g in groups.values()]
    where = {n: (gi, g.index(n)) for gi, g in enumerate(groups.values()) for n in g}
    kind = jnp.concatenate([stacked[n].reshape(-1) for n in names])
    kind_at = dict(zip(names, np.cumsum([0] + [layers * size[n] for n in names]).tolist(),
                       strict=False))  # fmt: skip

    def row_slices(b, i):
        row = jax.lax.dynamic_index_in_dim(b[0], i, keepdims=False)
        return {n: row[offset[n] : offset[n] + size[n]].reshape(shapes[n]) for n in names}

    def row_dynamic(b, i):
        return {
            n: jax.lax.dynamic_slice(b[0], (i, offset[n]), (1, size[n])).reshape(shapes[n])
            for n in names
        }

    def by_size(b, i):
        return {
            n: jax.lax.dynamic_slice(b[where[n][0]], (i, where[n][1], 0), (1, 1, size[n])).reshape(
                shapes[n]
            )
            for n in names
        }

    def kind_major(b, i):
        return {
            n: jax.lax.dynamic_slice(b[0], (kind_at[n] + i * size[n],), (size[n],)).reshape(
                shapes[n]
            )
            for n in names
        }

    return {
        "stacked": (
            lambda b, i: {
                n: jax.lax.dynamic_index_in_dim(b[j], i, keepdims=False)
                for j, n in enumerate(names)
            },
            [stacked[n] for n in names],
        ),  # fmt: skip
        "rows, slice": (row_slices, [rows]),
        "rows, dynamic": (row_dynamic, [rows]),
        "size groups": (by_size, grouped),
        "kind-major": (kind_major, [kind]),
    }


def scan_program(weights_of: Callable, layers: int) -> Callable:
    def run(x, small, *buffers):
        def step(h, i):
            w = weights_of(buffers, i)
            return _layer(h, w, jax.lax.dynamic_index_in_dim(small, i, keepdims=False)), None

        return jax.lax.scan(step, x, jnp.arange(layers))[0]

    return jax.jit(run)


def unrolled_program(weights_of: Callable, layers: int) -> Callable:
    """The same layers as a Python loop: every slice index a constant."""

    def run(x, small, *buffers):
        for i in range(layers):
            x = _layer(x, weights_of(buffers, i), small[i])
        return x

    return jax.jit(run)


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU check of the tool)")
    ap.add_argument("--unrolled", action="store_true", help="also each form without a loop")
    args = ap.parse_args(argv)
    layers, rows, d, f = (3, 16, 8, 24) if args.smoke else (32, 6000, 1280, 5120)
    x = jax.random.normal(jax.random.key(1), (rows, d), jnp.bfloat16)
    small = jnp.ones((layers, 2, d), jnp.bfloat16)
    times, first = {}, None
    programs = [("", scan_program)] + ([(" unrolled", unrolled_program)] if args.unrolled else [])
    for (name, (weights_of, buffers)), (suffix, build) in (
        (form, p) for form in forms(layers, d, f).items() for p in programs
    ):
        name += suffix
        fn = build(weights_of, layers)
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(x, small, *buffers))
        compile_s = time.perf_counter() - t0
        first = out if first is None else first
        if not bool(jnp.array_equal(out, first)):
            raise AssertionError(f"{name} computes something else than the stacked form")
        samples = []
        for _ in range(3 if args.smoke else 7):
            t0 = time.perf_counter()
            jax.block_until_ready([fn(x, small, *buffers) for _ in range(5)])
            samples.append((time.perf_counter() - t0) / 5 * 1e3)
        times[name] = statistics.median(samples)
        print(f"{name:23s} {times[name]:8.3f} ms per call  (first call {compile_s:.1f} s)",
              flush=True)  # fmt: skip
    return times


if __name__ == "__main__":
    main()
