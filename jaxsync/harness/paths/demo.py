"""A demonstration path: gather rows of a cached constant table by host-provided ids.

It is the img2bpe pattern in miniature (a per-placement cached table, ids uploaded once, an
on-device gather) and keeps `jaxsync verify` meaningful on a bare install.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jaxsync
from jaxsync.check import entry_point
from jaxsync.harness.registry import Parity, PathCase, register_path


_TABLE_ROWS, _TABLE_COLS = 97, 13  # primes: a transposed axis cannot line up by accident


def _table() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((_TABLE_ROWS, _TABLE_COLS)).astype(np.float32)


@jax.jit
def _gather(table: jax.Array, ids: jax.Array, valid: jax.Array) -> jax.Array:
    # [N] ids, padded to a bucket; padded rows are zero.
    rows = jnp.take(table, ids, axis=0, mode="clip")
    return jnp.where(valid[:, None], rows, jnp.zeros_like(rows))


@entry_point
def table_gather(ids: list[int] | np.ndarray) -> jax.Array:
    """Rows `ids` of the demo table: [bucket(N), 13] float32, rows >= N zero.

    Args:
      ids: host ids in [0, 97).
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= _TABLE_ROWS):
        raise ValueError(f"ids must be in [0, {_TABLE_ROWS}); got min {ids.min()}, max {ids.max()}")
    n = jaxsync.bucket(ids.size)
    padded = np.zeros(n, np.int32)
    padded[: ids.size] = ids
    up = jaxsync.upload_packed({"ids": padded, "valid": np.arange(n) < ids.size})
    table = jaxsync.default_cache.get("demo.table", _table)
    return _gather_packed(table, up)


@functools.partial(jax.jit)
def _gather_packed(table: jax.Array, up: jaxsync.Packed) -> jax.Array:
    return _gather(table, up["ids"], up["valid"])


def _parity() -> Parity:
    import torch

    ids = [5, 96, 0, 41, 41]
    ours = np.asarray(table_gather(ids))[: len(ids)]
    ref = torch.from_numpy(_table())[torch.tensor(ids)].numpy()
    return Parity(float(np.max(np.abs(ours - ref))), 0.0, "abs", "torch indexing")


@register_path(
    "core.table_gather", "cached table + packed ids -> on-device gather (demo)", checkpoints=False
)
def _build(checkpoint: str | None) -> PathCase:
    if checkpoint is not None:
        raise ValueError("core.table_gather has no checkpoint")
    return PathCase(
        table_gather,
        [([1, 2, 3],), ([7] * 8,), ([96, 0],)],
        _parity,
        make_inputs=lambda b: (list(range(b)),),
        buckets=(8, 16, 32),
    )
