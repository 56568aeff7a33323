"""The `no_recompile` detector and the host-blocking probe, each against a negative control."""

import time

import jax
import jax.numpy as jnp
import pytest

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


def test_probe_with_sleep_is_not_confused():
    # Host-only work (no device wait) is not a sync: a sleep shows as blocked time, but the guard
    # stays silent. Documented limitation of the probe: it measures wall time to return.
    f = jax.jit(lambda v: v + 1)

    def slow_host(v):
        time.sleep(0.002)
        return f(v)

    b = check.measure_blocking(slow_host, jnp.ones(8), queue_ms=40)
    assert 1.5 < b.blocked_ms < 30, b
