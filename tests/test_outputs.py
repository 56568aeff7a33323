"""Embeddings' host metadata is validated: nothing truncated, nothing past the rows."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxsync


ROWS = jnp.zeros((6, 3))


@pytest.mark.parametrize("lengths", [[2.7, 1], [True, 2], [np.float32(2), 1], np.array([1.5])])
def test_lengths_that_would_be_truncated_are_refused(lengths):
    with pytest.raises(TypeError, match="lengths must hold integers"):
        jaxsync.Embeddings(ROWS, lengths)


def test_negative_counts_rows_past_the_end_and_mismatched_offsets_are_refused():
    with pytest.raises(ValueError, match="offsets must be >= 0"):
        jaxsync.Embeddings(ROWS, [2], offsets=[-1])
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        jaxsync.Embeddings(ROWS, [-2])
    with pytest.raises(ValueError, match=r"items \[1\] end past the 6 rows"):
        jaxsync.Embeddings(ROWS, [3, 4])
    with pytest.raises(ValueError, match="2 offsets for 1 lengths"):
        jaxsync.Embeddings(ROWS, [3], offsets=[0, 3])
    with pytest.raises(TypeError, match="host integers"):
        jaxsync.Embeddings(ROWS, jnp.array([3]))


def test_valid_layouts_split_as_given():
    out = jaxsync.Embeddings(ROWS, np.array([2, 0, 4]))  # numpy ints are exact
    assert out.lengths == (2, 0, 4) and out.offsets == (0, 2, 2)
    assert [x.shape for x in out.split()] == [(2, 3), (0, 3), (4, 3)]


def test_of_takes_the_plans_lengths_and_the_forwards_flags():
    encoded = jaxsync.Encoded(ROWS, jnp.array([True, False]), {"ids": jnp.arange(6)})

    class Plan:
        lengths = (4, 2)

    out = jaxsync.Embeddings.of(encoded, Plan())
    assert out.lengths == (4, 2) and out.finite is encoded.finite and "ids" in out.extras
    assert out.rows is ROWS
