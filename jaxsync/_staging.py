"""Large host inputs at link speed: padded batches written straight into reused pinned buffers.

A pageable `device_put` of a big host batch runs at a fraction of the link (the driver stages it
through its own pinned bounce buffer), while a `pinned_host` jax array moves to the device by
DMA at close to link speed, with the host back at once. Allocating pinned memory per call costs
more than it saves (cudaHostAlloc), so `StagingRing` keeps a few pinned buffers per
(shape, dtype, placement) and hands out a writable numpy view of one no transfer is reading:
the entry's padding copy writes into it directly, then `upload` starts the pinned->device
transfer.

Alias safety: a buffer goes back into service only once its last transfer's output reports
`is_ready()` (a non-blocking query; a transfer may read its source after returning). When every
buffer of a key is busy and the bounds allow no more, or where pinned memory is not available
(a backend without `pinned_host`, a placement that spans several devices, a trace), the batch
goes up through the pageable `async_h2d` path instead: never a wait. The pinned-memory plumbing
(which devices have it, the pinned->device transfer, views of a buffer) is `jaxsync._pinned`.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxsync import _compat, _pinned
from jaxsync._fill import fill_padded
from jaxsync._host import host_int, non_finite_error
from jaxsync._placement import Placement
from jaxsync._transfer import async_h2d


@dataclasses.dataclass(eq=False)
class _Slot:
    stage: jax.Array  # the pinned buffer (a jax array in pinned_host memory)
    nbytes: int
    view: np.ndarray | None = None  # writable numpy view of `stage`, made once it is ready
    busy: jax.Array | None = None  # the output of the last transfer reading `stage`
    filling: bool = False  # handed out by `acquire`, not yet uploaded


def _shape(shape: Any) -> tuple[int, ...]:
    """A buffer shape as ints >= 0; floats and bools are a TypeError, never truncated."""
    return tuple(host_int(d, name="each dimension of shape", minimum=0) for d in shape)


def _nbytes(key: tuple) -> int:
    shape, dtype, _ = key
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


class StagingRing:
    """Reused pinned host buffers for large uploads, per (shape, dtype, placement).

    >>> import numpy as np
    >>> ring = StagingRing(min_bytes=0)  # default: uploads from 8 MiB
    >>> data = np.arange(6, dtype=np.float32).reshape(2, 3)
    >>> x = ring.put(data, (4, 3))  # zero padded to 4 rows, uploaded
    >>> data[:] = -1  # the caller may reuse its buffer at once
    >>> x.tolist()
    [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]

    A buffer keeps a reference to its last transfer's output until it is next handed out and
    found ready, so up to `per_key` device copies per key may outlive their callers that long.
    Thread-safe; a buffer from `acquire` belongs to the caller until `upload` or `release`.

    Args:
      per_key: most pinned buffers per key (transfers of one key in flight at once).
      max_bytes: most pinned bytes over all keys; least recently used idle buffers are freed
        first to make room.
      min_bytes: smaller uploads take the pageable path. A pinned buffer's transfer costs the
        calling thread a fixed price (the memory-kind transfer and the ring's bookkeeping)
        that a pageable upload of a few MiB undercuts; the pinned path pays off only from
        about ten megabytes (docs/benchmarks.md).
    """

    def __init__(self, *, per_key: int = 4, max_bytes: int = 1 << 30, min_bytes: int = 8 << 20):
        self.per_key = host_int(per_key, name="per_key", minimum=1)
        self.max_bytes = host_int(max_bytes, name="max_bytes", minimum=0)
        self.min_bytes = host_int(min_bytes, name="min_bytes", minimum=0)
        self._keys: collections.OrderedDict[tuple, list[_Slot]] = collections.OrderedDict()
        self._handed: dict[int, tuple[np.ndarray, _Slot | None, Any]] = {}
        self._lock = threading.Lock()
        self._growing = collections.Counter()  # buffers being allocated, per key
        self.nbytes = 0  # pinned bytes held
        self.stats = collections.Counter()  # "pinned", "allocated", "fallback", "retired"

    def acquire(self, shape: tuple[int, ...], dtype: Any, placement: Placement = None):
        """A writable `[shape]` host buffer for one upload: a pinned one no transfer reads, or
        a fresh pageable one. Its contents are undefined: write every element, then `upload` it.
        """
        shape, dtype = _shape(shape), np.dtype(dtype)
        target = _pinned.single_device(placement)
        slot = None
        big = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize >= self.min_bytes
        if big and target is not None and not _compat.tracing():
            if _pinned.memory(next(iter(target.device_set))) is not None:
                slot = self._claim((shape, dtype, target))
        if slot is None:
            view = np.empty(shape, dtype)
            self._handed[id(view)] = (view, None, placement)
            with self._lock:
                self.stats["fallback"] += 1
            return view
        self._handed[id(slot.view)] = (slot.view, slot, target)
        return slot.view

    def upload(self, view: np.ndarray) -> jax.Array:
        """Starts the transfer of a buffer from `acquire` and returns its device array."""
        handed = self._handed.pop(id(view), None)
        if handed is None or handed[0] is not view:
            raise ValueError("upload takes a buffer returned by this ring's acquire")
        _, slot, where = handed
        if slot is None:
            return async_h2d(view, placement=where, copy=False)  # ours alone: no copy
        try:
            out = _pinned.transfer(slot.stage, where)
            if out.sharding.memory_kind != "device":  # host metadata: never a wait
                raise RuntimeError(f"the transfer landed in {out.sharding.memory_kind} memory")
        except Exception:  # a runtime that lists pinned memory but cannot move it: pageable
            _pinned.UNUSABLE.add(next(iter(where.device_set)))
            data = np.array(view)  # the buffer stays the ring's: upload a private copy
            with self._lock:
                slot.filling = False
            return async_h2d(data, placement=where, copy=False)
        with self._lock:
            slot.busy, slot.filling = out, False
        return out

    def release(self, view: np.ndarray) -> None:
        """Returns an acquired buffer unused (e.g. when filling it failed)."""
        handed = self._handed.pop(id(view), None)
        if handed is not None and handed[1] is not None:
            with self._lock:
                handed[1].filling = False

    def put(self, data: Any, shape: tuple[int, ...] | None = None, *, dtype: Any = None,
            placement: Placement = None, finite: str | None = None) -> jax.Array:  # fmt: skip
        """Uploads host `data` zero padded at the end of each axis to `shape` (default: its own).

        With `finite` (the data's name), NaN and inf are refused as `jaxsync._host.check_finite`
        refuses them, checked while the data is copied (one pass over memory, not two) and
        before anything is uploaded; so is a value that overflows `dtype`.

        Raises:
          ValueError: `data` of another rank, or larger than `shape` along an axis; a
            non-finite value (with `finite`).
        """
        data = np.asarray(data)
        shape = data.shape if shape is None else tuple(shape)
        if len(shape) != data.ndim or any(n > m for n, m in zip(data.shape, shape, strict=True)):
            raise ValueError(f"data of shape {data.shape} does not fit in {shape}")
        dtype = data.dtype if dtype is None else dtype

        def write(out: np.ndarray) -> None:
            if not fill_padded(out, data, check_finite=finite is not None):
                raise non_finite_error(data, name=finite, dtype=out.dtype)

        return self.stage(shape, dtype, write, placement=placement)

    def stage(self, shape: tuple[int, ...], dtype: Any, write: Callable[[np.ndarray], Any], *,
              placement: Placement = None) -> jax.Array:  # fmt: skip
        """`fill` then `upload`."""
        return self.upload(self.fill(shape, dtype, write, placement=placement))

    def fill(self, shape: tuple[int, ...], dtype: Any, write: Callable[[np.ndarray], Any], *,
             placement: Placement = None) -> np.ndarray:  # fmt: skip
        """`acquire`, then `write(buffer)` (which must set every element; it may check the data
        it copies and raise). Returns the filled buffer for `upload` (or `release`); the buffer
        goes back unused if `write` raises."""
        view = self.acquire(shape, dtype, placement)
        try:
            write(view)
        except BaseException:
            self.release(view)
            raise
        return view

    def reserve(self, shape: tuple[int, ...], dtype: Any, placement: Placement = None,
                count: int = 1) -> int:  # fmt: skip
        """Allocates up to `count` pinned buffers of a key and waits until they are usable (a
        start-up call, like `jaxsync.precompile`). Returns how many the key holds."""
        shape, dtype = _shape(shape), np.dtype(dtype)
        target = _pinned.single_device(placement)
        small = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize < self.min_bytes
        if small or target is None or _pinned.memory(next(iter(target.device_set))) is None:
            return 0
        key = (shape, dtype, target)
        for _ in range(count):
            with self._lock:
                if len(self._keys.get(key, ())) >= min(count, self.per_key):
                    break
                if not self._admit(key):
                    break
            slot = self._create(key)
            if slot is None:
                break
            jax.block_until_ready(slot.stage)
        return len(self._keys.get(key, ()))

    def _claim(self, key: tuple) -> _Slot | None:
        with self._lock:
            slots = self._keys.get(key, [])
            if slots:
                self._keys.move_to_end(key)
                for slot in list(slots):
                    if not slot.filling and self._settled(key, slot):
                        return self._hand_out(key, slot)
            if len(slots) + self._growing[key] >= self.per_key or not self._admit(key):
                return None
            self._growing[key] += 1
        # Allocating pinned memory is slow (cudaHostAlloc): done off the caller's thread, while
        # this call goes pageable; the new buffer serves a later one.
        _pinned.grower().submit(self._grow, key)
        return None

    def _grow(self, key: tuple) -> None:
        try:
            self._create(key)
        finally:
            with self._lock:
                self._growing[key] -= 1

    def _hand_out(self, key: tuple, slot: _Slot) -> _Slot | None:
        if slot.view is None:
            try:
                slot.view = _pinned.view(slot.stage, key[0], key[1])
            except Exception:  # a backend without host pointers to pinned buffers
                self._retire(key, slot)
                _pinned.UNUSABLE.add(next(iter(key[2].device_set)))
                return None
        slot.filling = True
        self.stats["pinned"] += 1
        return slot

    def _settled(self, key: tuple, slot: _Slot) -> bool:
        """Whether no transfer reads the slot's buffer (dropping the reference to its output)."""
        out = slot.busy
        if out is None:
            return True
        if out.is_deleted():  # donated: whether its transfer finished is unknowable
            self._retire(key, slot)  # freed by the runtime once its readers are done
            return False
        if not _pinned.is_ready(out):
            return False
        slot.busy = None
        return True

    def _admit(self, key: tuple) -> bool:
        """Books the bytes of one more buffer of `key` (under the lock), or says it cannot."""
        pinned = _pinned.memory(next(iter(key[2].device_set)))
        if pinned is None or not self._make_room(_nbytes(key)):
            return False
        self.nbytes += _nbytes(key)
        return True

    def _create(self, key: tuple) -> _Slot | None:
        """Allocates one booked buffer of `key` (outside the lock); None if the runtime fails."""
        shape, dtype, target = key
        device = next(iter(target.device_set))
        try:  # the buffer is ready once copied
            stage = jax.device_put(np.zeros(shape, dtype), _pinned.memory(device))
        except Exception:  # pinned memory the runtime lists but cannot allocate: pageable
            _pinned.UNUSABLE.add(device)
            with self._lock:
                self.nbytes -= _nbytes(key)
            return None
        slot = _Slot(stage, _nbytes(key), busy=stage)
        with self._lock:
            self._keys.setdefault(key, []).append(slot)
            self._keys.move_to_end(key)
            self.stats["allocated"] += 1
        return slot

    def _make_room(self, nbytes: int) -> bool:
        """Frees idle buffers of the least recently used keys until `nbytes` more fit."""
        if nbytes > self.max_bytes:
            return False
        for key in list(self._keys):
            for slot in list(self._keys.get(key, ())):
                if self.nbytes + nbytes <= self.max_bytes:
                    return True
                if not slot.filling and self._settled(key, slot):
                    self._retire(key, slot)
        return self.nbytes + nbytes <= self.max_bytes

    def _retire(self, key: tuple, slot: _Slot) -> None:
        slots = self._keys[key]
        slots.remove(slot)
        if not slots:
            del self._keys[key]
        self.nbytes -= slot.nbytes
        self.stats["retired"] += 1


default_staging = StagingRing()
"""The process-wide ring the model entries upload their padded host batches through."""
