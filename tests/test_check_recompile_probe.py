"""The `no_recompile` detector and the host-blocking probe, each against a negative control."""

import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxsync import check


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


@pytest.fixture
def busy_cores():
    """Both cores busy (two spinning processes) while the test runs."""
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 2)
    ]
    yield
    for p in procs:
        p.kill()
        p.wait()


_f = jax.jit(lambda v: (v * 2).sum())


def _reads(v):
    return _f(v).item()


def _waits(v):
    out = _f(v)
    out.block_until_ready()
    return out


@pytest.mark.parametrize("loaded", [False, True])
def test_probe_passes_a_sync_free_call_and_fails_blocking_ones(loaded, request):
    if loaded:
        request.getfixturevalue("busy_cores")
    x = jnp.ones(1024)
    clean = check.measure_blocking(_f, x, timeout_s=3)
    assert clean.ok is True and clean.method == "gate", clean
    for blocking in (_reads, _waits):  # negative controls
        report = check.measure_blocking(blocking, x, timeout_s=1)
        assert report.ok is False and report.detail.startswith("blocked"), report
        assert report.fraction > 0.9


def test_probe_row_says_which_check_failed():
    report = check.check_sync_free(_waits, jnp.ones(8), static=False)
    row = report.row("dispatch probe")
    assert row.ok is False and "blocked: returned only after the gate opened" in row.detail


def test_gate_program_is_not_part_of_the_scans():
    report = check.check_sync_free(_f, jnp.ones(8))
    assert [r.ok for r in report.rows] == [True] * 5, report


def test_work_that_escapes_the_gate_is_never_a_pass(monkeypatch):
    # Negative control of the "outputs pending" check: gate another device than the one the call
    # runs on; its work is then not held, so even a blocking call returns while the gate is closed.
    from jaxsync.check import _probe

    other = jax.devices()[1]
    monkeypatch.setattr(_probe, "_devices", lambda tree: [other])
    for fn in (_f, _waits):
        report = check.measure_blocking(fn, jnp.ones(8), timeout_s=3)
        assert report.ok is None and report.detail.startswith("not proven"), report


def test_calls_spanning_several_cpu_devices_are_not_proven():
    mesh = jax.make_mesh((len(jax.devices()),), ("d",))
    x = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P("d")))
    report = check.measure_blocking(jax.jit(jnp.tanh), x)
    assert report.ok is None and "several CPU devices" in report.detail


def test_a_gate_that_cannot_be_queued_falls_back_to_timing(monkeypatch):
    from jaxsync.check import _gate

    monkeypatch.setattr(_gate.Gate, "queued", False, raising=False)
    monkeypatch.setattr(_gate.Gate, "__setattr__", _keep_queued_false)
    report = check.measure_blocking(_f, jnp.ones(8), queue_ms=20)
    assert report.method == "timed" and str(report).startswith("timed"), report


def _keep_queued_false(self, name, value):
    object.__setattr__(self, name, False if name == "queued" else value)


def test_probe_with_sleep_is_not_confused():
    # Host-only work (no device wait) is not a sync: a sleep shows as host time, and the call
    # still returns while the gate holds the queue.
    f = jax.jit(lambda v: v + 1)

    def slow_host(v):
        time.sleep(0.002)
        return f(v)

    b = check.measure_blocking(slow_host, jnp.ones(8), timeout_s=5)
    assert b.ok is True and 1.5 < b.blocked_ms < 1000, b
