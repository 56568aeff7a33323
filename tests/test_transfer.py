"""The direct upload under async_h2d / upload_packed: same arrays as jax.device_put, explicit."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxsync
from jaxsync import _compat, _transfer
from jaxsync.testing import device_mesh, two_devices


def _no_device_put(monkeypatch):
    """Makes jax.device_put fail inside _transfer: the direct C++ transfer must serve the call."""

    def fail(*args, **kwargs):
        raise AssertionError("jax.device_put called: the direct transfer was not taken")

    monkeypatch.setattr(_transfer.jax, "device_put", fail)


def test_direct_transfer_available_on_supported_jax():
    # jax 0.10, 0.11 and 0.12 all have it: a silent fallback would cost
    # ~0.3 ms of host time per upload on a GPU host.
    assert _compat.DIRECT_PUT, _compat.missing()


def _placement(where: str):
    # Built inside the test: two_devices / device_mesh skip it where one device is visible.
    if where == "default":
        return None
    if where == "single sharding":
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if where == "device":
        return two_devices()[1]
    return NamedSharding(device_mesh(), P())  # replicated over the mesh


@pytest.mark.parametrize("where", ["default", "single sharding", "device", "replicated"])
@pytest.mark.parametrize(
    "host",
    [
        np.arange(7, dtype=np.int32),
        np.arange(5, dtype=np.int64),  # canonicalised to int32 as device_put does (x64 off)
        np.linspace(0, 1, 11),  # float64
        np.array([True, False, True]),
        np.arange(12, dtype=np.uint32).reshape(3, 4),
        np.zeros((0,), np.uint32),
    ],
    ids=["int32", "int64", "float64", "bool", "2d", "empty"],
)
def test_put_matches_device_put(monkeypatch, where, host):
    placement = _placement(where)
    want = jax.device_put(host, jaxsync._placement.resolve(placement))
    _no_device_put(monkeypatch)
    got = _transfer._put(host, placement)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.sharding == want.sharding and got.committed == want.committed
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_uploads_take_the_direct_transfer(monkeypatch):
    _no_device_put(monkeypatch)
    x = jaxsync.async_h2d([3, 1, 2])
    packed = jaxsync.upload_packed({"ids": np.array([4, 5], np.int32)})
    assert x.tolist() == [3, 1, 2] and packed["ids"].tolist() == [4, 5]


def test_detector_fires_on_device_put(monkeypatch):
    # Negative control for _no_device_put: a split sharding needs jax.device_put.
    mesh = device_mesh()
    _no_device_put(monkeypatch)
    with pytest.raises(AssertionError, match="direct transfer was not taken"):
        jaxsync.async_h2d(np.arange(mesh.size), placement=NamedSharding(mesh, P("x")))


def test_copy_false_uploads_the_buffer_itself():
    host = np.arange(5, dtype=np.int32)
    np.testing.assert_array_equal(np.asarray(jaxsync.async_h2d(host, copy=False)), host)


def test_split_sharding_falls_back_to_device_put():
    mesh = device_mesh()
    split = NamedSharding(mesh, P(mesh.axis_names[0]))
    host = np.arange(mesh.size * 3, dtype=np.int32)
    x = jaxsync.async_h2d(host, placement=split)
    assert x.sharding == split
    np.testing.assert_array_equal(np.asarray(x), host)


def test_upload_is_explicit_under_the_guard_and_the_flag_is_restored():
    host = np.arange(4, dtype=np.int32)
    with jax.transfer_guard_host_to_device("disallow"):
        x = jaxsync.async_h2d(host)  # explicit: allowed
        with pytest.raises(Exception, match="[Dd]isallowed"):
            jax.jit(lambda a: a + 1)(host)  # an implicit upload still raises afterwards
    assert x.tolist() == [0, 1, 2, 3]


def test_flag_restored_when_the_transfer_raises(monkeypatch):
    def boom(*args):
        raise RuntimeError("transfer failed")

    monkeypatch.setattr(_compat, "_batched_device_put", boom)
    state = _compat._guard_state()
    with pytest.raises(RuntimeError, match="transfer failed"):
        _transfer._put(np.arange(3, dtype=np.int32), None)
    assert state.explicit_device_put is False


def test_traced_upload_takes_device_put():
    # jaxsync.check traces entry points: an upload inside a trace must give a tracer.
    jaxpr = jax.make_jaxpr(lambda: jaxsync.async_h2d(np.arange(3, dtype=np.int32)) + 1)()
    assert "device_put" in str(jaxpr)


def test_pinned_host_placement():
    dev = jax.devices()[0]
    if "pinned_host" not in {m.kind for m in dev.addressable_memories()}:
        pytest.skip("no pinned_host memory on this backend")
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    host = np.arange(6, dtype=np.int32)
    x = jaxsync.async_h2d(host, placement=pinned)
    assert x.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(x), host)


def test_default_device_given_as_a_platform_name():
    with jax.default_device(jax.devices()[0].platform):  # jax takes "cpu", "gpu", ... there
        x = jaxsync.async_h2d([1, 2])
    assert x.devices() == {jax.devices()[0]} and x.tolist() == [1, 2]
