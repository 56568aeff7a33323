"""Accelerator-only proofs: JAX's device->host guard and the dispatch probe on real hardware.

On CPU these skip (the CPU backend never guards reads); `tools/gpu_check.sh` runs them on a GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsync import check


pytestmark = pytest.mark.gpu


def _busy_value():
    x = jnp.ones((2048, 2048))
    return (x @ x).sum()


@pytest.mark.parametrize(
    "read",
    [lambda v: np.asarray(v), lambda v: v.item(), lambda v: int(v)],
    ids=["np.asarray", "item", "int"],
)
def test_jax_transfer_guard_raises_on_reads(read):
    v = _busy_value()
    read(v)  # outside the guard: fine
    v = _busy_value()
    with pytest.raises(Exception, match="(?i)disallowed device-to-host|host sync"):
        with check.sync_guard("error"):
            read(v)


def test_jax_guard_alone_catches_buffer_protocol_reads():
    # Without our Python-level interceptors (allowed), JAX's own guard still fires on GPU for a
    # read NumPy makes through the C buffer protocol — the read the CPU backend cannot intercept.
    v = _busy_value()
    with pytest.raises(Exception, match="(?i)disallowed device-to-host"):
        with jax.transfer_guard_device_to_host("disallow"):
            np.asarray(v)


def test_probe_on_gpu():
    f = jax.jit(lambda x: jnp.tanh(x) * 2)

    def reads(x):
        return f(x).sum().item()

    x = jnp.ones((1024, 1024))
    blocked = check.measure_blocking(reads, x, queue_ms=30)
    clean = check.measure_blocking(f, x, queue_ms=30)
    print(f"\nprobe on {jax.devices()[0].device_kind}: item() {blocked}; clean {clean}")
    assert blocked.fraction >= 0.9, blocked
    assert clean.blocked_ms < 1.0, clean
