"""Test helpers that watch what a call sends to the device: uploads, compiles and the jit
arguments of its program (re-exported by `jaxsync.testing`)."""

from __future__ import annotations

from typing import Any

import numpy as np


class DispatchCount:
    """What `count_dispatch` saw: `uploads` (calls of jaxsync.upload_packed / async_h2d and
    staged uploads through a `jaxsync.StagingRing`) and
    `compiles` (traces, lowerings and backend compiles, from `jaxsync.check.count_compiles`)."""

    uploads: int = 0
    compiles: int = 0


def count_dispatch():
    """A context manager counting uploads and compiles made inside it (tests proving that bad
    input is refused on the host, before anything is uploaded or compiled)."""
    import contextlib

    import jaxsync
    from jaxsync.check import count_compiles

    @contextlib.contextmanager
    def region():
        seen = DispatchCount()
        originals = {name: getattr(jaxsync, name) for name in ("upload_packed", "async_h2d")}

        def counted(fn):
            def wrapper(*args, **kwargs):
                seen.uploads += 1
                return fn(*args, **kwargs)

            return wrapper

        for name, fn in originals.items():
            setattr(jaxsync, name, counted(fn))
        acquire = jaxsync.StagingRing.acquire  # every staged upload, pinned or pageable
        jaxsync.StagingRing.acquire = counted(acquire)
        try:
            with count_compiles() as log:
                yield seen
        finally:
            for name, fn in originals.items():
                setattr(jaxsync, name, fn)
            jaxsync.StagingRing.acquire = acquire
            seen.compiles = log.count

    return region()


def assert_refused(error: Any, match: str, fn: Any, *args: Any, keep: Any = (), **kwargs: Any):
    """`fn(*args, **kwargs)` raises `error` matching `match`, with nothing uploaded or compiled
    and every array of `keep` alive and bit-identical (bad input refused on the host)."""
    import jax
    import pytest

    before = [np.asarray(x).copy() for x in jax.tree.leaves(keep)]
    with count_dispatch() as seen, pytest.raises(error, match=match):
        fn(*args, **kwargs)
    assert (seen.uploads, seen.compiles) == (0, 0), (seen.uploads, seen.compiles)
    after = jax.tree.leaves(keep)
    assert not any(x.is_deleted() for x in after)
    for a, b in zip(after, before, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


def main_arg_count(lowered: Any) -> int:
    """The number of arguments of a lowered program's entry function (a `jax.stages.Lowered`):
    what the host passes per call, after jit flattened the pytrees."""
    import re

    signature = re.search(r"func\.func public @main\((.*?)\)\s*(->|\{)", lowered.as_text(), re.S)
    return signature.group(1).count("%arg")


def watch_uploads(monkeypatch: Any, on_upload: Any = None) -> list:
    """Records every host->device transfer of host data while `monkeypatch` is active: the
    pageable uploads (`jaxsync._transfer._put`) and the staging ring's pinned transfers
    (`jaxsync._pinned.transfer`). `on_upload(*args)` runs first: raise there to refuse one.
    Returns the list of recorded argument tuples."""
    from jaxsync import _pinned, _transfer

    calls: list = []

    def watch(real: Any) -> Any:
        def watched(*args: Any) -> Any:
            if on_upload is not None:
                on_upload(*args)
            calls.append(args)
            return real(*args)

        return watched

    for module, name in ((_transfer, "_put"), (_pinned, "transfer")):
        monkeypatch.setattr(module, name, watch(getattr(module, name)))
    return calls
