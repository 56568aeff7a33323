"""Host input helpers: integers stay integers, torch CPU tensors go in, non-finite data stops."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxsync._host import check_finite, host_array, host_int, host_ints


@pytest.mark.parametrize(
    "bad", [[True, 5], [[1, 2], [3, False]], [1, 2.0], (np.float32(3),), np.array([1.5]), [1, "2"]]
)
def test_host_ints_refuses_non_integers_even_inside_lists(bad):
    with pytest.raises(TypeError, match="integers"):
        host_ints(bad, name="ids", ndim=None)


def test_host_ints_accepts_integers_of_any_kind():
    for good in ([1, 2], (np.int32(1), 2), np.arange(3), [[1, 2], [3, 4]], []):
        out = host_ints(good, name="ids", ndim=None)
        assert out.dtype == np.int64


def test_host_ints_refuses_ragged_negative_and_device_data():
    with pytest.raises(ValueError, match="ragged"):
        host_ints([[1, 2], [3]], name="ids", ndim=None)
    with pytest.raises(ValueError, match=">= 0"):
        host_ints([1, -1], name="ids")
    with pytest.raises(TypeError, match="host data"):
        host_ints(jnp.arange(3), name="ids")


def test_host_int_refuses_bools_and_floats():
    assert host_int(np.int16(7), name="n") == 7
    for bad in (True, 7.0, "7", None):
        with pytest.raises(TypeError):
            host_int(bad, name="n")


def test_torch_cpu_tensors_convert_without_importing_torch_here():
    torch = pytest.importorskip("torch")
    x = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    out = host_array(x, name="x")
    assert out.dtype == np.float32 and out.shape == (2, 3)
    np.testing.assert_array_equal(out, np.arange(6, dtype=np.float32).reshape(2, 3))
    assert host_ints(torch.tensor([[1, 2, 3]]), name="grid", ndim=2).tolist() == [[1, 2, 3]]
    with pytest.raises(TypeError, match="integers"):
        host_ints(torch.tensor([1.0, 2.0]), name="grid")


def test_check_finite_names_the_first_bad_index():
    check_finite(np.ones(3, np.float32), name="x")  # negative control: passes
    with pytest.raises(ValueError, match=r"index \[1, 0\]"):
        check_finite(np.array([[0.0, 1.0], [np.nan, 2.0]]), name="x")
