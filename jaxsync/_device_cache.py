"""Per-placement cache of device copies of host-side constant tables.

vLLM's PR #51458 replaced per-forward `torch.tensor(table, device=...)` with a lazily built copy per
device. `DeviceCache` is that pattern for JAX: one explicit transfer per (name, placement), ever.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxsync._host import check_fits, refuse_masked, upload_dtype
from jaxsync._placement import Placement, resolve


HostTable = Any  # array-like accepted by np.array


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """Introspection record of one cached table.

    Attributes:
      name: the table's name.
      placement: the device or sharding it lives on.
      shape: array shape.
      dtype: array dtype.
      nbytes: bytes of the (global) device array.
    """

    name: str
    placement: jax.Device | jax.sharding.Sharding
    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int


class DeviceCache:
    """Lazily built device copies of host constant tables, keyed by (name, placement, dtype).

    A placement is a `jax.Device` or a `jax.sharding.Sharding`; a table replicated over a mesh
    (`NamedSharding(mesh, P())`) is one entry. The first `get` builds the host table, makes a
    private copy and moves it with one explicit `jax.device_put`; later calls return the same array.
    Concurrent first use from several threads builds once. A `dtype` is part of the key: asking
    for a cached name in another dtype builds that copy too.

    >>> import numpy as np
    >>> cache = DeviceCache()
    >>> table = cache.get("squares", lambda: np.arange(5) ** 2)
    >>> table.tolist()
    [0, 1, 4, 9, 16]
    >>> cache.get("squares", lambda: 1 / 0) is table  # never rebuilt
    True
    >>> len(cache), cache.nbytes  # 5 int32 (JAX stores int64 as int32 unless x64 is on)
    (1, 20)
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[str, Any, np.dtype | None], jax.Array] = {}
        self._lock = threading.Lock()
        self._key_locks: dict[tuple[str, Any, np.dtype | None], threading.Lock] = {}
        self._generation = 0  # bumped by clear(): a build that straddles it is not stored
        self.builds = 0  # number of host->device transfers made; tests use it

    def get(
        self,
        name: str,
        build: HostTable | Callable[[], HostTable],
        *,
        placement: Placement = None,
        dtype: Any = None,
    ) -> jax.Array:
        """Returns the device copy of table `name` at `placement`, building it on first use.

        Args:
          name: the table's identity. Two different tables must not share a name.
          build: the host table (array-like) or a zero-argument callable returning it.
          placement: a device, a sharding, or None for the default device.
          dtype: optional dtype the host table is converted to before the transfer; part of the
            key (None: the host table's own dtype).

        Returns:
          A committed `jax.Array` at `placement`.

        Raises:
          TypeError: the table is a numpy masked array (its mask would be dropped).
          ValueError: a value does not fit in the device dtype (an int64 beyond int32 or a
            float64 beyond float32's range with x64 off, or beyond `dtype`'s range).
        """
        target = resolve(placement)
        key = (name, target, None if dtype is None else np.dtype(dtype))
        hit = self._entries.get(key)
        if hit is not None:
            return hit
        with self._lock:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
            generation = self._generation
        with key_lock:
            hit = self._entries.get(key)
            if hit is not None:
                return hit
            host = build() if callable(build) else build
            refuse_masked(host, name=f"table {name!r}")
            src = np.asarray(host)
            check_fits(src, upload_dtype(src, dtype), name=f"table {name!r}")
            # A private copy: the caller may reuse its buffer, and device_put may alias ours.
            host = np.array(src, dtype=dtype, copy=True)
            # Safe under tracing: the cache must hold a concrete array, never a tracer.
            with jax.ensure_compile_time_eval():
                value = jax.device_put(host, target)
            with self._lock:
                self.builds += 1
                if generation == self._generation:  # not cleared while building: keep it
                    self._entries[key] = value
            return value

    def entries(self) -> list[CacheEntry]:
        """One record per cached (name, placement, dtype)."""
        return [
            CacheEntry(name, placement, tuple(v.shape), np.dtype(v.dtype), int(v.nbytes))
            for (name, placement, _), v in list(self._entries.items())
        ]

    @property
    def nbytes(self) -> int:
        """Total bytes held on devices by this cache."""
        return sum(int(v.nbytes) for v in list(self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple[str, Placement]) -> bool:
        """`(name, placement) in cache`: whether the table is cached there, in any dtype."""
        name, placement = key
        target = resolve(placement)
        return any(k[:2] == (name, target) for k in list(self._entries))

    def clear(self) -> None:
        """Drops every cached array (the next `get` transfers again). A build in flight in
        another thread still returns its array to its caller but does not store it."""
        with self._lock:
            self._entries.clear()
            self._key_locks.clear()
            self._generation += 1


default_cache = DeviceCache()
"""The process-wide cache that jaxsync paths use unless given their own."""
