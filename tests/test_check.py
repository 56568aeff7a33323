"""The proof harness: every detector fires on its negative control and passes clean code."""

import asyncio
import contextlib
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

from jaxsync import check
from jaxsync.check import SyncError, SyncFreeError


def _pure_cb(x):
    return jax.pure_callback(lambda v: np.asarray(v) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def _io_cb(x):
    return io_callback(lambda v: np.asarray(v), jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def _debug_print(x):
    jax.debug.print("x = {}", x)
    return x + 1


def _debug_callback(x):
    jax.debug.callback(lambda v: None, x)
    return x + 1


def _cb_in_cond(x):
    return jax.lax.cond(x.sum() > 0, _pure_cb, lambda v: v, x)


def _cb_in_scan(x):
    def body(c, _):
        return _io_cb(c), None

    return jax.lax.scan(body, x, None, length=3)[0]


def _cb_in_while(x):
    return jax.lax.while_loop(lambda c: c.sum() < 100, _pure_cb, x + 1)


def _cb_in_remat(x):
    return jax.checkpoint(_pure_cb)(x)


def _cb_in_nested_jit(x):
    return jax.jit(lambda v: jax.jit(_debug_print)(v) * 2)(x)


@jax.custom_jvp
def _custom(x):
    return _pure_cb(x)


_custom.defjvp(lambda p, t: (_custom(p[0]), t[0]))


def _clean(x):
    return jax.lax.cond(x.sum() > 0, lambda v: v * 2, lambda v: v - 1, x)


DIRTY = {
    "pure_callback": (_pure_cb, "pure_callback"),
    "io_callback": (_io_cb, "io_callback"),
    "debug.print": (_debug_print, "debug_print"),
    "debug.callback": (_debug_callback, "debug_callback"),
    "cond": (_cb_in_cond, "pure_callback"),
    "scan": (_cb_in_scan, "io_callback"),
    "while": (_cb_in_while, "pure_callback"),
    "remat": (_cb_in_remat, "pure_callback"),
    "nested jit": (_cb_in_nested_jit, "debug_print"),
    "custom_jvp": (_custom, "pure_callback"),
}


@pytest.mark.parametrize("name", list(DIRTY))
def test_jaxpr_scan_finds_callbacks_anywhere(name):
    fn, prim = DIRTY[name]
    findings = check.scan_jaxpr(fn, jnp.ones(4))
    assert [f.what for f in findings] == [prim], findings
    assert findings[0].check == "jaxpr"


@pytest.mark.parametrize("name", ["pure_callback", "io_callback", "debug.print", "cond", "scan"])
def test_hlo_scan_finds_host_transfers(name):
    fn, _ = DIRTY[name]
    findings = check.scan_hlo(fn, jnp.ones(4))
    assert {f.check for f in findings} == {"lowered", "compiled"}, findings
    assert all(f.what == "python callback custom call" for f in findings)


def test_hlo_text_patterns():
    # TPU callbacks lower to host send/recv; old JAX to outfeed.
    text = "a = send(x), is_host_transfer=true\nb = outfeed(y)\nc = add(x, y)"
    found = check.scan_hlo_text(text, "compiled")
    assert [f.what for f in found] == ["host send/recv", "infeed/outfeed"]


def test_clean_function_passes_static_scans():
    assert check.scan_jaxpr(_clean, jnp.ones(4)) == []
    assert check.scan_hlo(_clean, jnp.ones(4)) == []


def test_static_scan_reports_device_reads_at_trace_time():
    def reads(x):
        return x * int(x[0])

    (finding,) = check.scan_jaxpr(reads, jnp.ones(4))
    assert finding.what == "device->host read"


def test_static_scan_keeps_host_values_static():
    def f(x, ids):
        assert max(ids) < 10  # host validation on a Python list must keep working
        return x[np.asarray(ids)]

    assert check.scan_jaxpr(f, jnp.arange(10.0), [1, 2]) == []


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


def test_no_recompile_fires_on_new_shape_and_passes_cached():
    f = jax.jit(lambda v: v * 3)
    a, b, c = jnp.ones(5), jnp.zeros(5), jnp.ones(6)
    f(a)
    with check.no_recompile() as log:
        f(b)
    assert log.count == 0
    with pytest.raises(check.RecompileError, match="trace"), check.no_recompile():
        f(c)


def test_no_recompile_immediate_uses_chex():
    from chex._src.restrict_backends import RestrictedBackendError

    f = jax.jit(lambda v: v - 1)
    with pytest.raises(RestrictedBackendError), check.no_recompile(immediate=True):
        f(jnp.ones(7))


def test_probe_separates_blocking_from_clean():
    f = jax.jit(lambda v: (v * 2).sum())

    def blocking(v):
        return f(v).item()

    def waits(v):
        out = f(v)
        out.block_until_ready()
        return out

    x = jnp.ones(1024)
    clean = check.measure_blocking(f, x, queue_ms=40)
    blocked = check.measure_blocking(blocking, x, queue_ms=40)
    waited = check.measure_blocking(waits, x, queue_ms=40)
    assert clean.gated_inputs == 1
    assert clean.fraction < 0.25, clean
    assert blocked.fraction > 0.7, blocked
    assert waited.fraction > 0.7, waited


def test_assert_sync_free_passes_clean_and_reports_each_failure():
    f = jax.jit(lambda v: jnp.tanh(v) * 2)
    report = check.assert_sync_free(f, jnp.ones(16), inputs=[(jnp.zeros(16),)], queue_ms=10)
    assert report.ok and len(report.rows) == 5
    assert "PASS" in str(report)

    def reads(v):
        return f(v) * int(v[0])

    with pytest.raises(SyncFreeError) as e:
        check.assert_sync_free(reads, jnp.ones(16), queue_ms=10)
    assert "jaxpr: no host callback  FAIL" in str(e.value)

    with pytest.raises(SyncFreeError) as e:
        check.assert_sync_free(jax.jit(_pure_cb), jnp.ones(16), queue_ms=10, probe=False)
    assert "hlo: no host transfer    FAIL" in str(e.value)

    with pytest.raises(SyncFreeError) as e:
        check.assert_sync_free(f, jnp.ones(16), inputs=[(jnp.ones(17),)], probe=False)
    assert "no recompile             FAIL" in str(e.value)


def test_assert_sync_free_runtime_row_catches_untraceable_read():
    # A read the static scan cannot see (not in the traced path): the runtime guard still fires.
    calls = {"n": 0}
    f = jax.jit(lambda v: v + 1)

    def sometimes(v):
        calls["n"] += 1
        out = f(v)
        if calls["n"] > 2 and not isinstance(v, jax.core.Tracer):
            np.asarray(out)
        return out

    report = check.check_sync_free(sometimes, jnp.ones(4), probe=False)
    assert report.row("runtime: sync_guard").ok is False


def test_probe_with_sleep_is_not_confused():
    # Host-only work (no device wait) is not a sync: a sleep shows as blocked time, but the guard
    # stays silent. Documented limitation of the probe: it measures wall time to return.
    f = jax.jit(lambda v: v + 1)

    def slow_host(v):
        time.sleep(0.002)
        return f(v)

    b = check.measure_blocking(slow_host, jnp.ones(8), queue_ms=40)
    assert 1.5 < b.blocked_ms < 30, b


def test_donating_entry_point_is_refused_with_a_clear_error():
    f = jax.jit(lambda v: v * 2, donate_argnums=0)
    with pytest.raises(TypeError, match="donated"):
        check.check_sync_free(f, jnp.ones(16), probe=False, static=False)
