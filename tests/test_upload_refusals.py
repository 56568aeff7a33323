"""Uploads refuse host data they would change silently: masked arrays (the mask would be
dropped) and numbers the device dtype cannot hold (wrapped integers, floats turned into inf)."""

import jax
import numpy as np
import pytest

import jaxsync


def _cache_get(x, **kw):
    return jaxsync.DeviceCache().get("t", x, **kw)


def _packed(x):
    return jaxsync.upload_packed({"f": x})


UPLOADS = {"async_h2d": jaxsync.async_h2d, "upload_packed": _packed, "DeviceCache": _cache_get}


@pytest.mark.parametrize("upload", list(UPLOADS))
def test_masked_arrays_are_refused(upload):
    masked = np.ma.masked_array(np.arange(4, dtype=np.int32), mask=[0, 1, 0, 0])
    with pytest.raises(TypeError, match="masked array"):
        UPLOADS[upload](masked)


def test_masked_table_built_by_a_callable_is_refused():
    masked = np.ma.masked_array(np.ones(3, np.float32), mask=[1, 0, 0])
    with pytest.raises(TypeError, match="masked array"):
        jaxsync.DeviceCache().get("t", lambda: masked)


@pytest.mark.parametrize("upload", list(UPLOADS))
@pytest.mark.parametrize("value", [2**40, -(2**31) - 1, 2**31])
def test_integers_beyond_int32_are_refused_with_x64_off(upload, value):
    with pytest.raises(ValueError, match="does not fit in int32"):
        UPLOADS[upload](np.array([1, value], np.int64))


@pytest.mark.parametrize("upload", list(UPLOADS))
def test_floats_beyond_float32_are_refused_with_x64_off(upload):
    with pytest.raises(ValueError, match=r"1e\+300.*float32"):
        UPLOADS[upload](np.array([0.5, np.nan, 1e300]))


@pytest.mark.parametrize("upload", list(UPLOADS))
def test_values_at_the_limits_upload_unchanged(upload):
    # Negative control: what fits passes, and NaN / inf already present are not "too large".
    ints = np.array([-(2**31), 2**31 - 1], np.int64)
    floats = np.array([np.finfo(np.float32).max, -np.inf, np.nan, 1.5])
    for x, want in ((ints, ints.astype(np.int32)), (floats, floats.astype(np.float32))):
        out = UPLOADS[upload](x)
        got = out["f"] if isinstance(out, jaxsync.Packed) else out
        got = np.asarray(jax.jit(lambda v: v)(got))
        np.testing.assert_array_equal(got, want)


def test_python_lists_and_scalars_are_checked_too():
    with pytest.raises(ValueError, match="does not fit in int32"):
        jaxsync.async_h2d([1, 2**40])
    with pytest.raises(ValueError, match="float32"):
        jaxsync.async_h2d(1e300)


def test_an_explicit_narrow_dtype_is_checked_against_its_own_range():
    with pytest.raises(ValueError, match="float16"):
        jaxsync.async_h2d(np.array([70000.0], np.float32), dtype=np.float16)
    with pytest.raises(ValueError, match="uint32"):
        _cache_get(np.array([-1]), dtype=np.uint32)
    assert jaxsync.async_h2d(np.array([60000.0]), dtype=np.float16).dtype == np.float16


def test_with_x64_on_64_bit_values_upload_as_they_are():
    with jax.enable_x64(True):
        x = jaxsync.async_h2d(np.array([2**40]))
        assert x.dtype == np.int64 and int(x[0]) == 2**40
        assert float(_cache_get(np.array([1e300]))[0]) == 1e300
