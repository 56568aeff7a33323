"""`jaxsync.PackedLeaves`: state arrays as one flat buffer per dtype, sliced back inside jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsync
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
    pack = jaxsync.PackedLeaves(leaves)
    assert [b.dtype for b in pack.buffers] == [jnp.bfloat16, jnp.float32, jnp.int32]
    assert [b.size for b in pack.buffers] == [12, 15 + 1 + 11, 7]
    out = jax.jit(pack.unpack)(pack.buffers)
    for a, b in zip(out, leaves, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_one_program_argument_per_dtype():
    pack = jaxsync.PackedLeaves([jnp.ones((4, 4)) for _ in range(29)])
    lowered = jax.jit(lambda bufs: sum(x.sum() for x in pack.unpack(bufs))).lower(pack.buffers)
    assert len(jax.tree.leaves(lowered.args_info)) == 1


def test_refuses_what_packing_would_break():
    with pytest.raises(ValueError, match="nothing to pack"):
        jaxsync.PackedLeaves([])
    with pytest.raises(TypeError, match="jax.Arrays"):
        jaxsync.PackedLeaves([np.ones(3)])
    mesh = device_mesh("x")
    split = jax.device_put(
        jnp.ones((8, 2)), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    )
    with pytest.raises(ValueError, match="one placement, replicated"):
        jaxsync.PackedLeaves([split])
    elsewhere = jax.device_put(jnp.ones(2), jax.devices()[1])
    with pytest.raises(ValueError, match="one placement"):
        jaxsync.PackedLeaves([jnp.ones(2), elsewhere])


def test_rows_pack_each_layer_into_one_row_sliced_by_a_scan():
    key = jax.random.key(1)
    layers = 5  # stacked layer leaves [L, ...], two dtypes
    leaves = [
        jax.random.normal(key, (layers, 3, 7)),
        jax.random.normal(key, (layers, 11)).astype(jnp.bfloat16),
        jnp.arange(layers * 2, dtype=jnp.float32).reshape(layers, 2),
        jax.random.normal(key, (layers, 4, 4)),
    ]
    pack = jaxsync.PackedLeaves(leaves, rows=True)
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
        jaxsync.PackedLeaves([jnp.ones((2, 3)), jnp.ones((3, 3))], rows=True)
    with pytest.raises(ValueError, match="one leading"):
        jaxsync.PackedLeaves([jnp.float32(1.0)], rows=True)


def test_tower_puts_layers_and_the_other_leaves_in_one_buffer_per_dtype():
    key = jax.random.key(2)
    layers = 3  # a row is 7 + 5 = 12 float32 words; the float32 own leaves need 2 tail rows
    stacked = [
        jax.random.normal(key, (layers, 7)),
        jax.random.normal(key, (layers, 5)),
        jax.random.normal(key, (layers, 2, 3)).astype(jnp.bfloat16),
    ]
    own = [
        jax.random.normal(key, (13,)),
        jnp.arange(4, dtype=jnp.int32),  # a dtype the layers do not have: its own flat buffer
        jax.random.normal(key, (2, 2)).astype(jnp.bfloat16),
        jnp.float32(-1.5),
    ]
    tower = jaxsync.PackedTower(own, stacked)
    assert [(b.dtype, b.shape) for b in tower.buffers] == [
        (jnp.bfloat16, (layers + 1, 6)),
        (jnp.float32, (layers + 2, 12)),
        (jnp.int32, (4,)),
    ]
    for a, b in zip(jax.jit(tower.own)(tower.buffers), own, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

    def run(bufs):  # what a scan over layer indices sees: each layer's leaves from its row
        def step(carry, i):
            return carry, tower.layer(bufs, i)

        return jax.lax.scan(step, 0, jnp.arange(tower.num_layers))[1]

    per_layer = jax.jit(run)(tower.buffers)
    for got, x in zip(per_layer, stacked, strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(x, np.float32))
    lowered = jax.jit(run).lower(tower.buffers)
    assert len(jax.tree.leaves(lowered.args_info)) == 3  # one argument per dtype

    only_layers = jaxsync.PackedTower([], stacked)  # no other leaves: the rows alone
    assert [b.shape for b in only_layers.buffers] == [(layers, 6), (layers, 12)]
    assert only_layers.own(only_layers.buffers) == []
