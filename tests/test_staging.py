"""The pinned staging ring: exact, alias-safe, never reusing a buffer a transfer may read."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsync
import jaxsync.check
import jaxsync.testing
from jaxsync import _pinned


SHAPE = (37, 13)  # odd, prime-ish sizes


def _ring(**kw) -> jaxsync.StagingRing:
    ring = jaxsync.StagingRing(min_bytes=0, **kw)
    assert ring.reserve(SHAPE, np.float32, count=kw.get("per_key", 4)) >= 1
    return ring


def _data(seed: int, shape=SHAPE, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _pointer(view: np.ndarray) -> int:
    return view.__array_interface__["data"][0]


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int32])
def test_round_trip_is_bit_exact_and_padded(dtype):
    ring = jaxsync.StagingRing(min_bytes=0)
    assert ring.reserve((41, 7, 3), dtype) == 1
    data = _data(1, (29, 5, 3), dtype)
    want = np.zeros((41, 7, 3), dtype)
    want[:29, :5] = data
    x = ring.put(data, (41, 7, 3))
    data[:] = 0  # the caller reuses its source at once
    assert ring.stats["pinned"] == 1 and ring.stats["fallback"] == 0
    assert x.sharding.memory_kind == "device" and x.dtype == dtype
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8), want.view(np.uint8))


def test_back_to_back_uploads_never_share_a_buffer_in_flight():
    # Real transfers: large enough that the CPU copy is still running when the next call comes.
    shape = (4 << 20,)
    ring = jaxsync.StagingRing(per_key=2, min_bytes=0)
    ring.reserve(shape, np.float32, count=2)
    outs, sources = [], []
    for i in range(6):
        sources.append(np.full(shape, i, np.float32))
        outs.append(ring.put(sources[-1]))
    for out, src in zip(outs, sources, strict=True):
        np.testing.assert_array_equal(np.asarray(out), src)


def _track(monkeypatch, ready):
    """Fakes the readiness query: a transfer output is ready only when `ready(out)` says so."""
    monkeypatch.setattr(_pinned, "is_ready", ready)


def _reused_while_busy(view, busy_pointers) -> bool:
    """The detector: the buffer handed out is one a (fake) unfinished transfer still reads."""
    return _pointer(view) in busy_pointers


def test_busy_buffer_is_not_reused_then_bound_falls_back(monkeypatch):
    ring = _ring(per_key=2)
    busy: dict[int, int] = {}  # id(out) -> pointer of the buffer its transfer reads
    _track(monkeypatch, lambda out: id(out) not in busy)

    v1 = ring.acquire(SHAPE, np.float32)
    v1[:] = 1
    x1 = ring.upload(v1)
    busy[id(x1)] = _pointer(v1)
    v2 = ring.acquire(SHAPE, np.float32)
    assert not _reused_while_busy(v2, busy.values())
    v2[:] = 2
    x2 = ring.upload(v2)
    busy[id(x2)] = _pointer(v2)
    v3 = ring.acquire(SHAPE, np.float32)  # both buffers busy, per_key reached: pageable
    assert not _reused_while_busy(v3, busy.values())
    assert ring.stats["fallback"] == 1 and ring.stats["pinned"] == 2
    v3[:] = 3
    x3 = ring.upload(v3)
    del busy[id(x1)]  # the first transfer lands: its buffer comes back
    v4 = ring.acquire(SHAPE, np.float32)
    assert _pointer(v4) == _pointer(v1)
    ring.release(v4)
    for x, value in ((x1, 1), (x2, 2), (x3, 3)):
        np.testing.assert_array_equal(np.asarray(x), np.full(SHAPE, value, np.float32))


def test_negative_control_detector_sees_reuse_without_readiness_check(monkeypatch):
    ring = _ring(per_key=2)
    _track(monkeypatch, lambda out: True)  # the check disabled
    v1 = ring.acquire(SHAPE, np.float32)
    v1[:] = 1
    x1 = ring.upload(v1)
    v2 = ring.acquire(SHAPE, np.float32)
    assert _reused_while_busy(v2, {_pointer(v1)})  # the detector fires
    ring.release(v2)
    del x1


def test_donated_output_retires_its_buffer():
    ring = _ring(per_key=1)
    x = ring.put(_data(2))
    before = ring.nbytes
    x.delete()  # as a program donating it would: whether the copy finished is unknowable
    y = ring.put(_data(3))
    assert ring.stats["retired"] == 1 and ring.nbytes <= before
    np.testing.assert_array_equal(np.asarray(y), _data(3))


def test_no_recompile_under_sync_guard():
    ring = _ring()
    # Warm the transfer, and let it land: four slots then serve the four puts below, so none
    # has to wait on (or fall back from) a transfer still reading its buffer.
    jax.block_until_ready(ring.put(_data(4)))
    with jaxsync.check.no_recompile(), jaxsync.check.sync_guard(), jax.transfer_guard("disallow"):
        outs = [ring.put(_data(i)) for i in range(5, 9)]
    assert ring.stats["fallback"] == 0
    for i, out in zip(range(5, 9), outs, strict=True):
        np.testing.assert_array_equal(np.asarray(out), _data(i))


def test_placements_without_pinned_path_fall_back():
    ring = jaxsync.StagingRing(min_bytes=0)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    assert ring.reserve(SHAPE, np.float32, replicated) == 0
    x = ring.put(_data(9), placement=replicated)
    assert x.sharding == replicated and ring.stats["fallback"] == 1
    np.testing.assert_array_equal(np.asarray(x), _data(9))
    traced = jax.jit(lambda: ring.put(_data(10)) * 2)()  # under a trace: an ordinary upload
    np.testing.assert_array_equal(np.asarray(traced), _data(10) * 2)


def test_byte_cap_evicts_least_recently_used_idle_keys():
    small = (16, 16)
    ring = jaxsync.StagingRing(max_bytes=2 * 16 * 16 * 4, min_bytes=0)
    for k in range(3):
        ring.reserve(small, np.float32, jax.devices()[k])
        assert ring.nbytes <= ring.max_bytes
    assert ring.stats["retired"] == 1
    too_big = jaxsync.StagingRing(max_bytes=100, min_bytes=0)
    np.testing.assert_array_equal(np.asarray(too_big.put(_data(11))), _data(11))
    assert too_big.stats["fallback"] == 1 and too_big.nbytes == 0


def test_threads_get_their_own_data():
    ring = _ring()
    outs: dict[int, list] = {i: [] for i in range(4)}

    def work(i):
        for j in range(10):
            outs[i].append((100 * i + j, ring.put(_data(100 * i + j))))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for pairs in outs.values():
        for seed, out in pairs:
            np.testing.assert_array_equal(np.asarray(out), _data(seed))


def test_jitted_copy_form_passes_the_guard_without_recompiles():
    # The transfer form GPUs take, run here on the CPU's pinned memory.
    device = jax.devices()[0]
    pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    target = jax.sharding.SingleDeviceSharding(device)
    stages = [jax.block_until_ready(jax.device_put(_data(i), pinned)) for i in range(3)]
    _pinned.copy_program(target)(stages[0])
    with jaxsync.check.no_recompile(), jaxsync.check.sync_guard(), jax.transfer_guard("disallow"):
        outs = [_pinned.copy_program(target)(s) for s in stages]
    for i, out in enumerate(outs):
        assert out.sharding.memory_kind == "device"
        np.testing.assert_array_equal(np.asarray(out), _data(i))


def test_backend_without_host_pointers_falls_back(monkeypatch):
    monkeypatch.setattr(_pinned, "UNUSABLE", set())

    def no_pointer(*a):
        raise RuntimeError("no host pointer to this memory")

    monkeypatch.setattr(_pinned, "view", no_pointer)
    ring = jaxsync.StagingRing(min_bytes=0)
    ring.reserve(SHAPE, np.float32)
    np.testing.assert_array_equal(np.asarray(ring.put(_data(13))), _data(13))
    assert ring.stats["fallback"] == 1 and ring.nbytes == 0
    assert ring.reserve(SHAPE, np.float32) == 0  # the device is off the pinned path now


def test_failing_pinned_transfer_falls_back(monkeypatch):
    monkeypatch.setattr(_pinned, "UNUSABLE", set())

    def broken(*a):
        raise RuntimeError("cannot move pinned memory here")

    monkeypatch.setattr(_pinned, "transfer", broken)
    ring = _ring()
    data = _data(14)
    np.testing.assert_array_equal(np.asarray(ring.put(data)), data)
    assert ring.stats["pinned"] == 1
    np.testing.assert_array_equal(np.asarray(ring.put(data * 2)), data * 2)
    assert ring.stats["pinned"] == 1 and ring.stats["fallback"] == 1  # off the pinned path


def test_small_uploads_take_the_pageable_path():
    ring = jaxsync.StagingRing(min_bytes=1 << 20)
    assert ring.reserve(SHAPE, np.float32) == 0
    np.testing.assert_array_equal(np.asarray(ring.put(_data(12))), _data(12))
    assert ring.stats["fallback"] == 1 and ring.nbytes == 0


def test_bad_calls_raise():
    ring = jaxsync.StagingRing(min_bytes=0)
    with pytest.raises(ValueError, match="does not fit"):
        ring.put(np.zeros((5, 3)), (4, 3))
    with pytest.raises(ValueError, match="does not fit"):
        ring.put(np.zeros((5,)), (5, 1))
    with pytest.raises(ValueError, match="acquire"):
        ring.upload(np.zeros(3))
    with pytest.raises(TypeError, match="dimension"):
        ring.acquire((4.0, 3), np.float32)
    with pytest.raises(ValueError, match="dimension"):
        ring.acquire((-1, 3), np.float32)
    with pytest.raises(TypeError, match="per_key"):
        jaxsync.StagingRing(per_key=2.5)
    with pytest.raises(ValueError, match="per_key"):
        jaxsync.StagingRing(per_key=0)


def test_a_transfer_that_stays_in_host_memory_is_refused(monkeypatch):
    # A runtime may return the pinned array itself (or a host-memory copy) for a transfer to an
    # unnamed memory kind; a device program then fails on the mixed memory spaces. The ring
    # checks where the result landed (host metadata) and takes the pageable path instead.
    monkeypatch.setattr(_pinned, "UNUSABLE", set())
    ring = _ring()
    data = _data(15)
    assert ring.put(data).sharding.memory_kind == "device"  # control: a real transfer
    monkeypatch.setattr(_pinned, "transfer", lambda stage, target, form=None: stage)
    out = ring.put(data * 3)
    assert out.sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(out), data * 3)
    assert ring.stats["fallback"] == 0 and ring.stats["pinned"] == 2  # the pinned try, refused
    assert ring.reserve(SHAPE, np.float32) == 0  # the device is off the pinned path now


def test_the_target_names_device_memory():
    device = jax.devices()[0]
    for placement in (None, device, jax.sharding.SingleDeviceSharding(device)):
        assert _pinned.single_device(placement).memory_kind == "device"


@pytest.mark.parametrize(("value", "dtype", "match"), [
    (np.nan, np.float32, r"px holds a non-finite value \(first at index \[3, 4\]\)"),
    (-np.inf, jnp.bfloat16, r"px holds a non-finite value \(first at index \[3, 4\]\)"),
    (1e39, np.float32, r"px holds a value too large for float32 \(first at index \[3, 4\]\)"),
])  # fmt: skip
def test_put_refuses_non_finite_data_while_copying(monkeypatch, value, dtype, match):
    ring = _ring()
    data = _data(5).astype(np.float64)
    want = np.asarray(ring.put(data, dtype=np.float32, finite="px"))  # control: clean data
    np.testing.assert_array_equal(want, data.astype(np.float32))
    data[3, 4] = value
    uploads = jaxsync.testing.watch_uploads(monkeypatch)
    with pytest.raises(ValueError, match=match):
        ring.put(data, dtype=dtype, finite="px")
    assert uploads == []
    assert not any(s.filling for slots in ring._keys.values() for s in slots)  # given back
