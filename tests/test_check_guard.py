"""The runtime `sync_guard`: the reads and uploads it catches, per thread and per asyncio task."""

import asyncio
import contextlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsync import check
from jaxsync.check import SyncError


READS = {  # each takes (x, s): a vector and a scalar, both device arrays
    "int": lambda x, s: int(s),
    "float": lambda x, s: float(s),
    "bool": lambda x, s: bool(s),
    "index": lambda x, s: [0, 1, 2][s],
    "item": lambda x, s: s.item(),
    "tolist": lambda x, s: x.tolist(),
    "np.asarray": lambda x, s: np.asarray(x),
    "np.array": lambda x, s: np.array(x),
    "np.asarray(list)": lambda x, s: np.asarray([x, x]),
    "device_get": lambda x, s: jax.device_get(x),
    "copy_to_host_async": lambda x, s: x.copy_to_host_async(),
    "repr": lambda x, s: repr(x),
    "str": lambda x, s: str(x),
    "format": lambda x, s: f"{s:.2f}",
    "block_until_ready": lambda x, s: x.block_until_ready(),
    "jax.block_until_ready": lambda x, s: jax.block_until_ready(x),
}


@pytest.mark.parametrize("name", list(READS))
def test_guard_catches_reads(name):
    x = jnp.arange(3)
    s = x[1]
    READS[name](x, s)  # outside the guard: allowed
    with pytest.raises(SyncError, match="host sync"), check.sync_guard("error"):
        READS[name](x, s)
    READS[name](x, s)  # and allowed again afterwards


def test_guard_warn_mode_and_allow_sync():
    x = jnp.arange(3)
    s = x[1]
    with pytest.warns(check.SyncWarning), check.sync_guard("warn"):
        assert int(s) == 1
    with check.sync_guard("error"), check.allow_sync():
        assert x.tolist() == [0, 1, 2]
    with check.sync_guard("error"):
        with check.allow_sync():
            pass
        with pytest.raises(SyncError):
            int(s)


def test_guard_catches_implicit_upload():
    f = jax.jit(lambda a: a + 1)
    f(np.ones(3, np.float32))
    with pytest.raises(Exception, match="host-to-device"), check.sync_guard("error"):
        f(np.ones(3, np.float32))


def test_guard_allows_dispatch_and_explicit_uploads():
    f = jax.jit(lambda a, b: a @ b)
    a = jnp.ones((4, 4))
    f(a, a)
    with check.sync_guard("error"):
        out = f(a, a)
        up = jax.device_put(np.ones((4, 4), np.float32))
        out = f(out, up)
        assert out.shape == (4, 4)  # metadata is host data
    assert float(out[0, 0]) == 16.0


def test_guard_is_thread_local():
    x = jnp.arange(3)
    x0 = x[0]
    other_ok, errors = threading.Event(), []
    armed = threading.Event()
    done = threading.Event()

    def other():
        armed.wait()
        try:
            assert int(x[2]) == 2 and np.asarray(x).sum() == 3
            other_ok.set()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with check.sync_guard("error"):
        armed.set()
        done.wait(10)
        with pytest.raises(SyncError):
            int(x0)
    t.join()
    assert other_ok.is_set(), errors


def test_allow_sync_in_one_thread_does_not_open_another():
    x0 = jnp.arange(3)[0]
    inside, release, caught = threading.Event(), threading.Event(), []

    def allowed():
        with check.sync_guard("error"), check.allow_sync():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=allowed)
    t.start()
    inside.wait(10)
    with check.sync_guard("error"):
        try:
            int(x0)
        except SyncError:
            caught.append(1)
    release.set()
    t.join()
    assert caught == [1]


def _two_tasks(guarded_enters: bool):
    """Task A holds the guard (or not) across an await while sibling task B reads a device value;
    returns (B's error or None, whether A's own read raised)."""
    x0 = jnp.arange(3)[0]
    a_inside, b_done = asyncio.Event(), asyncio.Event()
    result = {}

    async def holder():
        with check.sync_guard("error") if guarded_enters else contextlib.nullcontext():
            a_inside.set()
            await b_done.wait()  # holds the guard across an await
            try:
                int(x0)
                result["a_raised"] = False
            except SyncError:
                result["a_raised"] = True

    async def sibling():
        await a_inside.wait()
        try:
            result["b"] = (int(x0), np.asarray(jnp.arange(3)).sum(), None)
        except SyncError as e:
            result["b"] = (None, None, e)
        b_done.set()

    async def main():
        await asyncio.gather(holder(), sibling())

    asyncio.run(main())
    return result["b"][2], result["a_raised"]


def test_guard_is_per_asyncio_task():
    error, a_raised = _two_tasks(guarded_enters=True)
    assert error is None, f"the guard leaked into a sibling task: {error}"
    assert a_raised  # the task that entered it is still guarded after the await


def test_guard_task_control_unguarded_holder_reads_freely():
    # Negative control: without the guard the holder's read passes, so the check above is live.
    error, a_raised = _two_tasks(guarded_enters=False)
    assert error is None and not a_raised


def test_task_created_inside_the_guard_inherits_it():
    x0 = jnp.arange(3)[0]

    async def read():
        int(x0)

    async def main():
        with check.sync_guard("error"):
            task = asyncio.create_task(read())  # copies the guarded context
        with pytest.raises(SyncError):
            await task

    asyncio.run(main())


def test_entry_point_env_switch(monkeypatch):
    x = jnp.arange(3)

    @check.entry_point
    def reads(v):
        return int(v)

    x = x[0]
    monkeypatch.setenv("JAXSYNC_SYNC_CHECK", "off")
    assert reads(x) == 0
    monkeypatch.setenv("JAXSYNC_SYNC_CHECK", "error")
    with pytest.raises(SyncError):
        reads(x)
    monkeypatch.setenv("JAXSYNC_SYNC_CHECK", "warn")
    with pytest.warns(check.SyncWarning):
        assert reads(x) == 0
    monkeypatch.setenv("JAXSYNC_SYNC_CHECK", "loud")
    with pytest.raises(ValueError, match="JAXSYNC_SYNC_CHECK"):
        reads(x)


def _implicit_upload_allowed() -> bool:
    """Whether this thread's JAX host->device guard lets an implicit upload through."""
    try:
        jnp.asarray(np.ones(3, np.float32)) + 1
        return True
    except Exception:  # JAX's transfer-guard error
        return False


async def _hold(scope, entered: asyncio.Event, leave: asyncio.Event) -> None:
    with scope:
        entered.set()
        await leave.wait()


def _interleave(first_scope, second_scope, first_exits_first: bool) -> bool:
    """Task A enters `first_scope`, task B `second_scope`, both hold it across an await, and they
    exit in the given order; returns whether the thread's implicit uploads pass afterwards."""

    async def main():
        a_in, b_in, a_go, b_go = (asyncio.Event() for _ in range(4))
        a = asyncio.create_task(_hold(first_scope, a_in, a_go))
        await a_in.wait()
        b = asyncio.create_task(_hold(second_scope, b_in, b_go))
        await b_in.wait()
        first, second = (a_go, b_go) if first_exits_first else (b_go, a_go)
        first.set()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        second.set()
        await asyncio.gather(a, b)
        return _implicit_upload_allowed()

    return asyncio.run(main())


@pytest.mark.parametrize("first_exits_first", [True, False])
def test_two_task_guards_restore_jax_levels_in_any_exit_order(first_exits_first):
    assert _implicit_upload_allowed()
    ok = _interleave(check.sync_guard(), check.sync_guard(), first_exits_first)
    assert ok, "JAX's transfer guard stayed 'disallow' after both tasks left their guards"
    assert _implicit_upload_allowed()


def test_allow_sync_outliving_another_tasks_guard_restores_jax_levels():
    ok = _interleave(check.sync_guard(), check.allow_sync(), first_exits_first=True)
    assert ok and _implicit_upload_allowed()


def test_jax_levels_follow_the_innermost_open_scope():
    # Negative control for the checks above: inside a guard the upload is refused, inside a nested
    # allow_sync it passes, and after the allow_sync the guard refuses again.
    with check.sync_guard():
        assert not _implicit_upload_allowed()
        with check.allow_sync():
            assert _implicit_upload_allowed()
        assert not _implicit_upload_allowed()
    assert _implicit_upload_allowed()


def test_guard_entered_before_an_outer_jax_level_restores_that_level():
    with jax.transfer_guard_host_to_device("disallow"):
        with check.sync_guard(), check.allow_sync():
            assert _implicit_upload_allowed()
        assert not _implicit_upload_allowed()
    assert _implicit_upload_allowed()
