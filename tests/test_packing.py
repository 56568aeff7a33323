"""PackedLeaves: state arrays as one flat buffer per dtype, sliced back inside jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsync._packing import PackedLeaves
from jaxsync.testing import device_mesh


def test_round_trip_keeps_order_shapes_dtypes_and_bits():
    key = jax.random.key(0)
    leaves = [
        jax.random.normal(key, (3, 5)),
        jnp.arange(7, dtype=jnp.int32),
        jax.random.normal(key, (2, 2, 3)).astype(jnp.bfloat16),
        jnp.float32(2.5),  # a scalar leaf
        jax.random.normal(key, (11,)),
    ]
    pack = PackedLeaves(leaves)
    assert [b.dtype for b in pack.buffers] == [jnp.bfloat16, jnp.float32, jnp.int32]
    assert [b.size for b in pack.buffers] == [12, 15 + 1 + 11, 7]
    out = jax.jit(pack.unpack)(pack.buffers)
    for a, b in zip(out, leaves, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_one_program_argument_per_dtype():
    pack = PackedLeaves([jnp.ones((4, 4)) for _ in range(29)])
    lowered = jax.jit(lambda bufs: sum(x.sum() for x in pack.unpack(bufs))).lower(pack.buffers)
    assert len(jax.tree.leaves(lowered.args_info)) == 1


def test_refuses_what_packing_would_break():
    with pytest.raises(ValueError, match="nothing to pack"):
        PackedLeaves([])
    with pytest.raises(TypeError, match="jax.Arrays"):
        PackedLeaves([np.ones(3)])
    mesh = device_mesh("x")
    split = jax.device_put(
        jnp.ones((8, 2)), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    )
    with pytest.raises(ValueError, match="one placement, replicated"):
        PackedLeaves([split])
    elsewhere = jax.device_put(jnp.ones(2), jax.devices()[1])
    with pytest.raises(ValueError, match="one placement"):
        PackedLeaves([jnp.ones(2), elsewhere])


def test_rows_pack_each_layer_into_one_row_sliced_by_a_scan():
    key = jax.random.key(1)
    layers = 5  # stacked layer leaves [L, ...], two dtypes
    leaves = [
        jax.random.normal(key, (layers, 3, 7)),
        jax.random.normal(key, (layers, 11)).astype(jnp.bfloat16),
        jnp.arange(layers * 2, dtype=jnp.float32).reshape(layers, 2),
        jax.random.normal(key, (layers, 4, 4)),
    ]
    pack = PackedLeaves(leaves, rows=True)
    assert [b.shape for b in pack.buffers] == [(layers, 11), (layers, 21 + 2 + 16)]
    for a, b in zip(jax.jit(pack.unpack)(pack.buffers), leaves, strict=True):  # all layers
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

    def step(carry, row):  # one layer's row of each buffer -> that layer's leaves
        return carry, [x.astype(jnp.float32).sum() for x in pack.unpack(row)]

    _, sums = jax.jit(lambda bufs: jax.lax.scan(step, 0, bufs))(pack.buffers)
    for got, x in zip(sums, leaves, strict=True):
        want = np.asarray(x, np.float32).reshape(layers, -1).sum(1)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    with pytest.raises(ValueError, match="one leading"):
        PackedLeaves([jnp.ones((2, 3)), jnp.ones((3, 3))], rows=True)
    with pytest.raises(ValueError, match="one leading"):
        PackedLeaves([jnp.float32(1.0)], rows=True)
