"""JAX's own transfer guards, held per guarded context and restored in any order of exits.

JAX keeps its transfer-guard levels per thread, and its context managers restore, on exit, the
level they found on entry. That is right for properly nested `with` blocks, and wrong for asyncio
tasks sharing one thread: when task A enters a guard, task B enters one, and A exits first, A
restores "allow" while B still holds its guard; B then "restores" the "disallow" it found, and
the thread stays guarded after both have left. An `allow_sync` of one task that outlives another
task's guard ends the same way.

Here every holder (a `sync_guard` or `allow_sync` scope) registers its levels with its thread's
record, and the thread's JAX levels are recomputed from the record on every entry and exit: the
most recently entered holder still open decides them, and when the last one leaves, the levels the
thread had before the first one entered come back. Each application goes through JAX's public
per-direction context managers; at most one of them is open per direction at any time (the
previous one is exited first, which restores the thread's original level), so nothing
accumulates however long holders keep overlapping.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import jax


_DIRECTIONS = (
    jax.transfer_guard_host_to_device,
    jax.transfer_guard_device_to_device,
    jax.transfer_guard_device_to_host,
)


class _Record:
    """One thread's holders and the JAX context managers currently applied for them."""

    def __init__(self) -> None:
        # holder token -> (h2d, d2d, d2h) levels, None meaning "leave as found"; insertion order
        # is entry order, so the last item is the most recently entered holder still open.
        self.holders: dict[object, tuple[str | None, ...]] = {}
        self.applied: list[Any] = []  # the open JAX context managers, one per direction at most
        self.thread = threading.get_ident()


_local = threading.local()


def _record() -> _Record:
    record = getattr(_local, "record", None)
    if record is None:
        record = _local.record = _Record()
    return record


def _apply(record: _Record) -> None:
    # Exiting the open managers (reverse order) restores the thread's levels from before the
    # first holder; the most recent holder's levels then go on top.
    while record.applied:
        record.applied.pop().__exit__(None, None, None)
    if not record.holders:
        return
    levels = next(reversed(record.holders.values()))
    for direction, level in zip(_DIRECTIONS, levels, strict=True):
        if level is not None:
            manager = direction(level)
            manager.__enter__()
            record.applied.append(manager)


@contextlib.contextmanager
def held(h2d: str | None, d2h: str | None, d2d: str | None = None) -> Iterator[None]:
    """Holds JAX's transfer-guard levels on this thread while the block runs.

    Exits may come in any order relative to other holders of the same thread (asyncio tasks): the
    thread's levels always follow the most recently entered holder still open, and return to
    what they were before the first holder once none is left.

    Args:
      h2d: host->device level ("allow", "log", "disallow"), or None to leave it as found.
      d2h: device->host level, or None.
      d2d: device->device level, or None.
    """
    record = _record()
    token = object()
    record.holders[token] = (h2d, d2d, d2h)
    _apply(record)
    try:
        yield
    finally:
        record.holders.pop(token, None)
        # JAX's levels are per thread: only the entering thread can set its own. A holder closed
        # from another thread leaves them to that thread's next entry or exit.
        if threading.get_ident() == record.thread:
            _apply(record)
