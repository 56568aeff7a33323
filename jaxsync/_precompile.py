"""Ahead-of-serving compilation of a server's own encoders for every bucket, with progress.

JAX compiles on first call; a server that has not warmed up pays it on a live request.
`precompile` calls each encoder once per bucket, with an input of exactly that bucket, so later
calls in the bucket run the compiled program. Compiled programs belong to the object that owns
them: pass the encoder instances the server serves with. If the user configured JAX's persistent
compilation cache (`jax_compilation_cache_dir`), compiled programs are also written there and
reused by the next process.
"""

from __future__ import annotations

import dataclasses
import numbers
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
from tqdm import tqdm


@dataclasses.dataclass(frozen=True)
class Target:
    """Any entry point to precompile: a callable and how to make an input of a bucket.

    Attributes:
      name: the label of its progress and `Compiled` records.
      fn: the entry point, called as `fn(*args, **kwargs)`.
      make_inputs: `(bucket) -> argument tuple` of exactly that bucket; None: `fn` has no
        buckets and compiles once on `inputs[0]`.
      buckets: the buckets compiled when `precompile` is given none.
      inputs: argument tuples of one call (the first is used when there is no `make_inputs`).
      kwargs: keyword arguments of every call.
    """

    name: str
    fn: Callable[..., Any]
    make_inputs: Callable[[int], tuple] | None = None
    buckets: tuple[int, ...] = ()
    inputs: Sequence[tuple] = ()
    kwargs: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One precompiled (encoder, bucket) and how long its first call took."""

    path: str
    bucket: int | None
    seconds: float


def _check_buckets(buckets: Any) -> tuple[int, ...] | None:
    if buckets is None:
        return None
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Sequence):
        raise TypeError(f"buckets must be a sequence of sizes, got {type(buckets).__name__}")
    bad = [b for b in buckets if isinstance(b, bool) or not isinstance(b, numbers.Integral)]
    if bad:
        raise TypeError(f"buckets must be integers, got {bad!r}")
    sizes = tuple(int(b) for b in buckets)
    if not sizes or min(sizes) < 1:
        raise ValueError(f"buckets must be positive sizes, got {list(sizes)}")
    return sizes


def _target_items(t: Target, buckets: tuple[int, ...] | None) -> list[tuple]:
    if not callable(t.fn):
        raise TypeError(f"Target {t.name!r}: fn must be callable, got {type(t.fn).__name__}")
    chosen = buckets if buckets is not None else tuple(t.buckets)
    if t.make_inputs is not None and chosen:
        return [(t.name, b, t.fn, lambda b=b: (t.make_inputs(b), t.kwargs)) for b in chosen]
    if not t.inputs:
        raise ValueError(f"Target {t.name!r} has neither make_inputs with buckets nor inputs")
    return [(t.name, None, t.fn, lambda: (t.inputs[0], t.kwargs))]


def _encoder_items(enc: Any, buckets: tuple[int, ...] | None) -> list[tuple]:
    from jaxsync.models._bucket_inputs import bucket_inputs

    spec = bucket_inputs(enc)
    if spec is None:
        if isinstance(enc, str):
            raise TypeError(
                f"precompile takes encoder objects, got the name {enc!r} (registered paths are "
                "the harness's: `jaxsync precompile --paths NAME`)"
            )
        raise TypeError(
            "precompile takes the encoders of jaxsync.models (<Family><Modality>Encoder "
            f"instances) or jaxsync.Target, got {type(enc).__name__}"
        )
    name = type(enc).__name__
    chosen = buckets if buckets is not None else spec.default
    if not chosen:
        raise ValueError(f"{name} has no default buckets: pass buckets")
    for b in chosen:
        spec.check(b)
    return [(name, b, enc, lambda b=b: spec.make(b)) for b in chosen]


def _items(encoders: Any, buckets: Any) -> list[tuple]:
    """(name, bucket, fn, () -> (args, kwargs)) per program; every check runs here, before any
    input is made or any program compiled."""
    sizes = _check_buckets(buckets)
    if isinstance(encoders, (str, bytes)) or not isinstance(encoders, Sequence):
        encoders = [encoders]  # one encoder
    if not encoders:
        raise ValueError("precompile needs at least one encoder")
    items: list[tuple] = []
    for enc in encoders:
        if isinstance(enc, Target):
            items += _target_items(enc, sizes)
        else:
            items += _encoder_items(enc, sizes)
    return items


def precompile(
    encoders: Any,
    buckets: Sequence[int] | None = None,
    *,
    progress: bool = True,
) -> list[Compiled]:
    """Compiles each encoder for every bucket, ahead of serving.

    Each encoder is called once per bucket with a host input of exactly that bucket (zeros; see
    `jaxsync.models._bucket_inputs` for each family's bucket), so a later call in the bucket
    compiles nothing. With `jax_compilation_cache_dir` set, every compile is also written there
    and reused by later processes.

    >>> from jaxsync.models.glm4v import Glm4vVisionEncoder  # doctest: +SKIP
    >>> enc = Glm4vVisionEncoder(load_model(ckpt, cfg))  # doctest: +SKIP
    >>> jaxsync.precompile([enc], buckets=[256, 1024])  # doctest: +SKIP

    Args:
      encoders: the server's encoder instances (`<Family><Modality>Encoder` of
        `jaxsync.models`), one or a sequence; a `Target` for any other entry point.
      buckets: bucket sizes compiled for every encoder (each must be one of the encoder's own
        buckets); None compiles each encoder's own default buckets.
      progress: print a progress bar to stderr.

    Returns:
      One record per compiled (encoder, bucket).

    Raises:
      TypeError: an object that is not an encoder or a `Target`, or non-integer buckets.
      ValueError: no encoders, empty or non-positive buckets, or a bucket an encoder never pads
        to; all before anything is compiled.
    """
    items = _items(encoders, buckets)
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
        for name, b, fn, make in items:
            bar.set_postfix_str(name + (f" bucket={b}" if b is not None else ""))
            args, kwargs = make()
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args, **kwargs))
            done.append(Compiled(name, b, time.perf_counter() - t0))
            bar.update(1)
    return done
