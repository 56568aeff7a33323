"""Large host copies and finiteness checks split over threads (jaxsync._fill)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from jaxsync import _fill


BIG = (9, 262_147)  # 9.4 MB of float32: above the split threshold, a prime row width


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def test_large_work_is_split_small_work_is_not():
    assert len(_fill._spans(BIG[0] * BIG[1], 4 * BIG[0] * BIG[1])) == min(_fill._WORKERS, 9)
    assert _fill._spans(1000, 4000) == [(0, 1000)]


@pytest.mark.parametrize("dst_dtype", [np.float32, ml_dtypes.bfloat16])
def test_copy_into_equals_assignment(rng, dst_dtype):
    src = rng.standard_normal(BIG)  # float64: cast while copying, as `dst[...] = src` does
    want = np.empty(BIG, dst_dtype)
    want[...] = src
    got = np.full(BIG, 5, dst_dtype)
    _fill.copy_into(got, src)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_copy_into_from_a_strided_source(rng):
    src = rng.standard_normal((BIG[1], BIG[0])).astype(np.float32).T  # not contiguous
    got = np.zeros(BIG, np.float32)
    _fill.copy_into(got, src)
    np.testing.assert_array_equal(got, src)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, BIG[0] * BIG[1] // 2, BIG[0] * BIG[1] - 1])
def test_all_finite_finds_a_bad_value_in_any_slice(rng, bad, where):
    x = rng.standard_normal(BIG).astype(np.float32)
    assert _fill.all_finite(x)  # control: the clean array passes
    x.reshape(-1)[where] = bad
    assert not _fill.all_finite(x)
    row = where // BIG[1]
    assert _fill.all_finite(x[::2]) == (row % 2 == 1)  # a strided view sees only even rows


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, ml_dtypes.bfloat16])
def test_all_finite_is_exact_where_a_sum_overflows(dtype):
    # Finite values whose sum overflows are still finite; +inf and -inf together sum to NaN.
    big = np.full(BIG, ml_dtypes.finfo(dtype).max, dtype)
    assert _fill.all_finite(big)
    big.reshape(-1)[7] = np.inf
    big.reshape(-1)[-7] = -np.inf
    assert not _fill.all_finite(big)


def test_all_finite_ignores_integers_and_empty():
    assert _fill.all_finite(np.arange(10))
    assert _fill.all_finite(np.zeros((0, 3), np.float32))


@pytest.mark.parametrize("shape", [(9, 4001, 128), (1, 30_011, 96), (3, 4, 200_003)])
def test_copy_into_a_padded_corner_is_split_and_exact(rng, shape, monkeypatch):
    # The data corner of a padded staging buffer is strided: it is split along an axis long
    # enough for every worker instead of copied on one thread.
    monkeypatch.setattr(_fill, "_WORKERS", 4)
    tasks = []
    real_run = _fill._run
    monkeypatch.setattr(_fill, "_run", lambda ts: tasks.append(len(ts)) or real_run(ts))
    src = rng.standard_normal(shape).astype(np.float32)
    out = np.full((shape[0] + 2, shape[1] + 5, shape[2] + 1), np.nan, np.float32)
    _fill.fill_padded(out, src)
    want = np.zeros(out.shape, np.float32)
    want[: shape[0], : shape[1], : shape[2]] = src
    np.testing.assert_array_equal(out, want)
    assert tasks == [4]  # one part per worker, along the first axis of length >= 4
    tasks.clear()
    _fill.copy_into(out[:1, :1, :1], src[:1, :1, :1])  # control: small work is not split
    assert tasks == [1]


def test_fill_padded_zero_pads_every_axis(rng):
    data = rng.standard_normal((5, 7, 3)).astype(np.float32)
    out = np.full((8, 11, 3), np.nan, np.float32)
    _fill.fill_padded(out, data)
    want = np.zeros((8, 11, 3), np.float32)
    want[:5, :7] = data
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("shape", [(3, 11), BIG])
def test_fill_rows_pads_each_row(rng, shape):
    src = rng.standard_normal(shape).astype(np.float32)
    lengths = [shape[1] - 3 * i for i in range(shape[0])]
    src[2, lengths[2] + 1] = np.inf  # past row 2's length: never copied
    out = np.full((shape[0] + 2, shape[1] + 5), 9.0, np.float32)
    _fill.fill_rows(out, src, lengths)
    want = np.zeros_like(out)
    for i, n in enumerate(lengths):
        want[i, :n] = src[i, :n]
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("shape", [(3, 11), BIG, (1, 2_000_003)])
def test_fill_rows_checked_names_the_rows_with_a_bad_real_sample(rng, shape):
    src = rng.standard_normal(shape).astype(np.float32)
    lengths = [shape[1] - 3 * i for i in range(shape[0])]
    out = np.full((shape[0] + 1, shape[1] + 5), 9.0, np.float32)
    assert _fill.fill_rows(out, src, lengths, check_finite=True) == []  # control: clean
    want = np.zeros_like(out)
    for i, n in enumerate(lengths):
        want[i, :n] = src[i, :n]
    np.testing.assert_array_equal(out, want)  # the checked copy writes what the plain one does
    last = shape[0] - 1
    src[last, lengths[last] - 1] = np.nan  # a row's last real sample (the last span's end)
    src[0, lengths[0] // 2] = -np.inf
    if shape[0] > 2:
        src[1, lengths[1]] = np.inf  # past row 1's length: padding, never read
    assert _fill.fill_rows(out, src, lengths, check_finite=True) == sorted({0, last})
    assert _fill.fill_rows(out, src, lengths) == []  # unchecked: nothing is reported


def test_fill_rows_checked_sees_float32_overflow_and_takes_row_lists(rng):
    rows = [rng.standard_normal(n) for n in (7, 0, 5)]  # float64 rows of a list, one empty
    rows[2][4] = 1e39  # finite in float64, inf once cast into the float32 buffer
    out = np.full((4, 9), 5.0, np.float32)
    assert _fill.fill_rows(out, rows, [7, 0, 5], check_finite=True) == [2]
    assert not out[1].any() and not out[3].any()  # the empty row and the row past src: zeros
    rows[2][4] = 3.0
    assert _fill.fill_rows(out, rows, [7, 0, 5], check_finite=True) == []


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_fill_padded_checked(rng, dtype):
    data = rng.standard_normal((5, 7, 3)).astype(dtype)
    out = np.empty((8, 11, 3), dtype)
    assert _fill.fill_padded(out, data, check_finite=True)  # control: clean
    data[4, 6, 2] = np.nan
    assert not _fill.fill_padded(out, data, check_finite=True)
    assert _fill.fill_padded(out, data)  # unchecked
    ints = np.arange(6).reshape(2, 3)
    assert _fill.fill_padded(np.empty((3, 3), np.int32), ints, check_finite=True)  # no floats


def test_copy_into_checked_finds_a_bad_value_in_a_split_corner(rng, monkeypatch):
    monkeypatch.setattr(_fill, "_WORKERS", 4)
    monkeypatch.setattr(_fill, "_BLOCK_BYTES", 4096)  # many blocks per part
    out = np.zeros((9, 4001, 128), np.float32)
    src = rng.standard_normal((7, 3001, 128)).astype(np.float32)
    corner = out[:7, :3001]
    assert _fill.copy_into(corner, src, check_finite=True)
    src[6, 3000, 127] = np.inf  # the very last element of the last block
    assert not _fill.copy_into(corner, src, check_finite=True)
