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
goes up through the pageable `async_h2d` path instead: never a wait.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxsync import _compat
from jaxsync._placement import Placement, resolve
from jaxsync._transfer import async_h2d


def _is_ready(out: jax.Array) -> bool:
    """Whether the transfer that produced `out` has finished reading its pinned source."""
    return out.is_ready()


@functools.cache
def _pinned(device: jax.Device) -> jax.sharding.Sharding | None:
    """The device's pinned host memory as a sharding, or None where it has none."""
    kinds = {m.kind for m in device.addressable_memories()}
    if "pinned_host" not in kinds:
        return None
    return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")


def _single_device(placement: Placement) -> jax.sharding.Sharding | None:
    """The device-memory sharding of a one-device placement, or None (several devices, or not
    device memory): those take the pageable path."""
    target = resolve(placement)
    if isinstance(target, jax.Device):
        return jax.sharding.SingleDeviceSharding(target)
    if len(target.device_set) != 1 or target.memory_kind not in (None, "device"):
        return None
    (device,) = target.device_set
    return jax.sharding.SingleDeviceSharding(device)


@functools.cache
def _copy_program(target: jax.sharding.Sharding) -> Any:
    # Identity with the device placement as its output: XLA emits the pinned->device DMA.
    return jax.jit(lambda x: x, out_shardings=target)


def transfer(stage: jax.Array, target: jax.sharding.Sharding) -> jax.Array:
    """The pinned->device transfer of `stage`, in the form with the least host time per backend.

    GPUs: a cached jitted identity with `out_shardings` (the host is back in tens of
    microseconds). CPU: `jax.device_put`, whose host time there is a fraction of the jitted
    copy's (a CPU program copies before it returns). Both are explicit for the transfer guard.
    """
    if next(iter(target.device_set)).platform == "cpu":
        return jax.device_put(stage, target)
    return _copy_program(target)(stage)


@dataclasses.dataclass(eq=False)
class _Slot:
    stage: jax.Array  # the pinned buffer (a jax array in pinned_host memory)
    nbytes: int
    view: np.ndarray | None = None  # writable numpy view of `stage`, made once it is ready
    busy: jax.Array | None = None  # the output of the last transfer reading `stage`
    filling: bool = False  # handed out by `acquire`, not yet uploaded


def _view(stage: jax.Array, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    raw = (ctypes.c_byte * stage.nbytes).from_address(stage.unsafe_buffer_pointer())
    return np.frombuffer(raw, dtype).reshape(shape)


class StagingRing:
    """Reused pinned host buffers for large uploads, per (shape, dtype, placement).

    >>> import numpy as np
    >>> ring = StagingRing(min_bytes=0)  # default: uploads from 1 MiB
    >>> data = np.arange(6, dtype=np.float32).reshape(2, 3)
    >>> x = ring.put(data, (4, 3))  # zero padded to 4 rows, uploaded
    >>> data[:] = -1  # the caller may reuse its buffer at once
    >>> x.tolist()
    [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]

    Args:
      per_key: most pinned buffers per key (transfers of one key in flight at once).
      max_bytes: most pinned bytes over all keys; least recently used idle buffers are freed
        first to make room.
      min_bytes: smaller uploads take the pageable path: their transfer is short either way,
        and the ring's bookkeeping would cost more host time than the DMA saves.
    """

    def __init__(self, *, per_key: int = 4, max_bytes: int = 1 << 30, min_bytes: int = 1 << 20):
        self.per_key, self.max_bytes, self.min_bytes = per_key, max_bytes, min_bytes
        self._keys: collections.OrderedDict[tuple, list[_Slot]] = collections.OrderedDict()
        self._handed: dict[int, tuple[np.ndarray, _Slot | None, Any]] = {}
        self._lock = threading.Lock()
        self.nbytes = 0  # pinned bytes held
        self.stats = collections.Counter()  # "pinned", "allocated", "fallback", "retired"

    def acquire(self, shape: tuple[int, ...], dtype: Any, placement: Placement = None):
        """A writable `[shape]` host buffer for one upload: a pinned one no transfer reads, or
        a fresh pageable one. Its contents are undefined: write every element, then `upload` it.
        """
        shape, dtype = tuple(int(d) for d in shape), np.dtype(dtype)
        target = _single_device(placement)
        slot = None
        big = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize >= self.min_bytes
        if big and target is not None and not _compat.tracing():
            slot = self._claim((shape, dtype, target), shape, dtype)
        if slot is None:
            self.stats["fallback"] += 1
            view = np.empty(shape, dtype)
            self._handed[id(view)] = (view, None, placement)
            return view
        self.stats["pinned"] += 1
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
        out = transfer(slot.stage, where)
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
            placement: Placement = None) -> jax.Array:  # fmt: skip
        """Uploads host `data` zero padded at the end of each axis to `shape` (default: its own).

        Raises:
          ValueError: `data` of another rank, or larger than `shape` along an axis.
        """
        data = np.asarray(data)
        shape = data.shape if shape is None else tuple(shape)
        if len(shape) != data.ndim or any(n > m for n, m in zip(data.shape, shape, strict=True)):
            raise ValueError(f"data of shape {data.shape} does not fit in {shape}")
        dtype = data.dtype if dtype is None else dtype
        return self.stage(shape, dtype, lambda out: fill_padded(out, data), placement=placement)

    def stage(self, shape: tuple[int, ...], dtype: Any, write: Callable[[np.ndarray], Any], *,
              placement: Placement = None) -> jax.Array:  # fmt: skip
        """`acquire`, `write(buffer)` (which must set every element), `upload`; the buffer goes
        back unused if `write` raises."""
        view = self.acquire(shape, dtype, placement)
        try:
            write(view)
        except BaseException:
            self.release(view)
            raise
        return self.upload(view)

    def reserve(self, shape: tuple[int, ...], dtype: Any, placement: Placement = None,
                count: int = 1) -> int:  # fmt: skip
        """Allocates up to `count` pinned buffers of a key and waits until they are usable (a
        start-up call, like `jaxsync.precompile`). Returns how many the key holds."""
        shape, dtype = tuple(int(d) for d in shape), np.dtype(dtype)
        target = _single_device(placement)
        small = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize < self.min_bytes
        if small or target is None or _pinned(next(iter(target.device_set))) is None:
            return 0
        key = (shape, dtype, target)
        for _ in range(count):
            with self._lock:
                if len(self._keys.get(key, ())) >= min(count, self.per_key):
                    break
                slot = self._allocate(key, shape, dtype)
            if slot is None:
                break
            jax.block_until_ready(slot.stage)
        return len(self._keys.get(key, ()))

    def _claim(self, key: tuple, shape: tuple[int, ...], dtype: np.dtype) -> _Slot | None:
        with self._lock:
            slots = self._keys.get(key)
            if slots is not None:
                self._keys.move_to_end(key)
                for slot in list(slots):
                    if not slot.filling and self._settled(key, slot):
                        return self._hand_out(slot, shape, dtype)
            if slots is not None and len(slots) >= self.per_key:
                return None
            slot = self._allocate(key, shape, dtype)
            if slot is None or not self._settled(key, slot):
                return None  # pinned memory being set up: this call goes pageable
            return self._hand_out(slot, shape, dtype)

    def _hand_out(self, slot: _Slot, shape: tuple[int, ...], dtype: np.dtype) -> _Slot:
        if slot.view is None:
            slot.view = _view(slot.stage, shape, dtype)
        slot.filling = True
        return slot

    def _settled(self, key: tuple, slot: _Slot) -> bool:
        """Whether no transfer reads the slot's buffer (dropping the reference to its output)."""
        out = slot.busy
        if out is None:
            return True
        if out.is_deleted():  # donated: whether its transfer finished is unknowable
            self._retire(key, slot)  # freed by the runtime once its readers are done
            return False
        if not _is_ready(out):
            return False
        slot.busy = None
        return True

    def _allocate(self, key: tuple, shape: tuple[int, ...], dtype: np.dtype) -> _Slot | None:
        pinned = _pinned(next(iter(key[2].device_set)))
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if pinned is None or not self._make_room(nbytes):
            return None
        stage = jax.device_put(np.zeros(shape, dtype), pinned)  # ready once its copy lands
        slot = _Slot(stage, nbytes, busy=stage)
        self._keys.setdefault(key, []).append(slot)
        self._keys.move_to_end(key)
        self.nbytes += nbytes
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


def fill_padded(out: np.ndarray, data: np.ndarray) -> None:
    """Writes `data` at the leading corner of `out` and zeros the rest, each element once."""
    corner: tuple[slice, ...] = ()
    for n in data.shape:
        out[(*corner, slice(n, None))] = 0
        corner = (*corner, slice(0, n))
    out[corner] = data


default_staging = StagingRing()
"""The process-wide ring the model entries upload their padded host batches through."""
