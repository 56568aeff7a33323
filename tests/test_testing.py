"""The test helpers themselves: each comparison fires on the difference it exists to catch."""

from unittest import mock

import jax
import numpy as np
import pytest

from jaxsync.testing import assert_close, assert_same_math, two_devices


A = np.float32([1.0, -2.0, 3.0])


def test_same_math_is_bitwise_on_cpu():
    with mock.patch.object(jax, "default_backend", lambda: "cpu"):  # also when run on a GPU
        assert_same_math(A, A.copy())
        with pytest.raises(AssertionError):
            assert_same_math(A, A + np.float32(2e-7))  # one ulp-scale step


def test_same_math_takes_a_tight_tolerance_elsewhere():
    with mock.patch.object(jax, "default_backend", lambda: "gpu"):
        assert_same_math(A, A + np.float32(2e-7))
        with pytest.raises(AssertionError, match="rel err"):
            assert_same_math(A, A * np.float32(1.0001))  # 1e-4 relative


def test_assert_close_refuses_nan_and_shape_changes():
    with pytest.raises(AssertionError, match="NaN"):
        assert_close(np.float32([np.nan]), np.float32([0.0]), rtol=1.0)
    with pytest.raises(AssertionError, match="shape"):
        assert_close(A[:2], A, rtol=1.0)


def test_two_devices_are_distinct():
    d0, d1 = two_devices()
    assert d0 != d1 and d0.platform == d1.platform
