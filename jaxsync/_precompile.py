"""Ahead-of-serving compilation of every bucket of every chosen path, with progress.

JAX compiles on first call; a server that has not warmed up pays it on a live request. `precompile`
runs each path once per bucket so later calls hit the in-memory cache. If the user configured JAX's
persistent compilation cache (`jax_compilation_cache_dir`), compiled programs are also written there
and reused by the next process.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
from tqdm import tqdm


@dataclasses.dataclass(frozen=True)
class Target:
    """A named PathCase to precompile (e.g. a server's own model instance)."""

    name: str
    case: Any


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One precompiled (path, bucket) and how long its first call took."""

    path: str
    bucket: int | None
    seconds: float


def _items(targets: Sequence[str | Any] | None, buckets: Sequence[int] | None):
    from jaxsync.harness import registry

    named = [t for t in targets or () if isinstance(t, str)]
    cases = [(t.name, t.case) for t in targets or () if isinstance(t, Target)]
    cases += [(getattr(t.fn, "__qualname__", "path"), t) for t in targets or ()
              if isinstance(t, registry.PathCase)]  # fmt: skip
    if targets is None or named:
        cases += [(spec.name, spec.build(None)) for spec in registry.paths(named or None)]
    items = []
    for name, case in cases:
        chosen = tuple(buckets) if buckets else case.buckets
        if case.make_inputs is not None and chosen:
            for b in chosen:
                items.append((name, b, case.fn, case.make_inputs(b), case.kwargs))
        else:
            for args in case.inputs[:1]:
                items.append((name, None, case.fn, args, case.kwargs))
    return items


def precompile(
    paths: Sequence[str | Any] | None = None,
    buckets: Sequence[int] | None = None,
    *,
    progress: bool = True,
) -> list[Compiled]:
    """Compiles every bucket of every chosen path (all registered paths by default).

    Compiled programs belong to the objects that own them: a registered name builds the registry's
    tiny instance, so a server passes the `PathCase` of its *own* entry point (its `make_inputs`
    gives one input per bucket). With `jax_compilation_cache_dir` set, every compile is also
    written there and reused by later processes and other instances.

    Args:
      paths: registered path names or families, `PathCase`s, or `Target(name, case)`s; None
        for every registered path.
      buckets: bucket sizes to compile for paths that can make inputs per bucket; None uses each
        path's own default buckets.
      progress: print a progress bar to stderr.

    Returns:
      One record per compiled (path, bucket).
    """
    items = _items(paths, buckets)
    done: list[Compiled] = []
    if jax.config.jax_compilation_cache_dir and progress:
        print(
            f"persistent compilation cache: {jax.config.jax_compilation_cache_dir}", file=sys.stderr
        )
    bar = tqdm(
        total=len(items),
        desc="precompile",
        unit="program",
        bar_format="{desc} {n_fmt}/{total_fmt} [{bar:30}] {elapsed}{postfix}",
        ascii=" #",
        file=sys.stderr,
        disable=not progress,
    )
    with bar:
        for name, b, fn, args, kwargs in items:
            bar.set_postfix_str(name + (f" bucket={b}" if b is not None else ""))
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args, **kwargs))
            done.append(Compiled(name, b, time.perf_counter() - t0))
            bar.update(1)
    return done
