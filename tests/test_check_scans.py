"""Static jaxpr/HLO scans for host callbacks and reads, and the `assert_sync_free` report."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

from jaxsync import check
from jaxsync.check import SyncFreeError


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


def test_donating_entry_point_is_refused_with_a_clear_error():
    f = jax.jit(lambda v: v * 2, donate_argnums=0)
    with pytest.raises(TypeError, match="donated"):
        check.check_sync_free(f, jnp.ones(16), probe=False, static=False)
