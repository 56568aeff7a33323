"""jaxsync.stack_layers / scan_layers / split_layers on a tiny NNX stack."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsync
from jaxsync.testing import assert_same_math


def _relu(x):
    return jax.nn.relu(x)


class Block(nnx.Module):
    """Pre-norm residual MLP: the shape of a transformer layer, small."""

    def __init__(self, d, *, rngs, act=_relu, hidden=8):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.up, self.down = nnx.Linear(d, hidden, rngs=rngs), nnx.Linear(hidden, d, rngs=rngs)
        self.act = act

    def __call__(self, x, mask):
        return x + mask[..., None] * self.down(self.act(self.up(self.norm(x))))


class Stack(nnx.Module):
    def __init__(self, n, d=4, *, rngs):
        self.embed = nnx.Linear(3, d, rngs=rngs)
        self.layers = nnx.List([Block(d, rngs=rngs) for _ in range(n)])


def _inputs():
    x = jax.random.normal(jax.random.key(1), (2, 5, 4))
    mask = (jnp.arange(5) < 3).astype(jnp.float32)[None].repeat(2, 0)  # [B, T]
    return x, mask


def test_scan_equals_python_loop_bitwise():
    # Bitwise on XLA:CPU, not a tolerance: each step runs the same float32 ops on the same values;
    # the loop only changes where a layer's weights come from (an exact dynamic slice). A GPU
    # compiler fuses the two programs differently: there, 1e-5 relative (assert_same_math).
    model = Stack(5, rngs=nnx.Rngs(0))
    graphdef, stacked = jaxsync.stack_layers(model.layers)
    x, mask = _inputs()

    @jax.jit
    def loop(x, mask):
        for layer in model.layers:
            x = layer(x, mask)
        return x

    scanned = jax.jit(jaxsync.scan_layers, static_argnums=0)(graphdef, stacked, x, mask)
    assert scanned.shape == x.shape and scanned.dtype == x.dtype
    assert_same_math(scanned, loop(x, mask))
    # the stacked leaves are the layers' leaves along a new leading axis
    first = jax.tree.leaves(nnx.state(model.layers[0]))
    for leaf, one in zip(jax.tree.leaves(stacked), first, strict=True):
        assert leaf.shape == (5, *one.shape)
        np.testing.assert_array_equal(np.asarray(leaf[0]), np.asarray(one))


def test_rejects_layers_of_other_structure():
    rngs = nnx.Rngs(0)
    with pytest.raises(ValueError, match="at least one"):
        jaxsync.stack_layers([])
    with pytest.raises(ValueError, match="layer 1 .*structure"):
        jaxsync.stack_layers([Block(4, rngs=rngs), nnx.Linear(4, 4, rngs=rngs)])
    # same class, other static attribute: a fresh lambda per layer does not stack
    with pytest.raises(ValueError, match="layer 1 .*static"):
        jaxsync.stack_layers([Block(4, rngs=rngs, act=lambda x: x) for _ in range(2)])
    with pytest.raises(ValueError, match="layer 2 .*structure"):
        jaxsync.stack_layers(
            [Block(4, rngs=rngs), Block(4, rngs=rngs), Block(4, rngs=rngs, hidden=6)]
        )


class Bare(nnx.Module):  # its static attributes do not record the parameter's shape
    def __init__(self, shape):
        self.w = nnx.Param(jnp.zeros(shape))


def test_rejects_other_leaf_shapes():
    with pytest.raises(ValueError, match="layer 1 has other leaf shapes"):
        jaxsync.stack_layers([Bare((2,)), Bare((3,))])


def test_split_layers_shrinks_jit_arguments_and_keeps_the_module():
    model = Stack(6, rngs=nnx.Rngs(0))
    before = jax.tree.leaves(nnx.state(model))
    parts = jaxsync.split_layers(model)
    assert len(model.layers) == 6 and len(jax.tree.leaves(nnx.state(model))) == len(before)
    own, stacked = jax.tree.leaves(parts.state), jax.tree.leaves(parts.layer_state)
    assert len(own) == 2 and len(stacked) == 6  # embed (2) + one layer's leaves (6)
    assert len(before) == 2 + 6 * 6
    assert own[0] is before[0] or own[0] is before[1]  # the module's arrays, not copies
    assert len(nnx.merge(parts.graphdef, parts.state).layers) == 0

    x, mask = _inputs()

    def run(own, stacked, x, mask):
        module = nnx.merge(parts.graphdef, jax.tree.unflatten(jax.tree.structure(parts.state), own))
        layers = jax.tree.unflatten(jax.tree.structure(parts.layer_state), stacked)
        return (
            jaxsync.scan_layers(parts.layer_graphdef, layers, x, mask)
            + module.embed.bias[None, None]
        )

    lowered = jax.jit(run).lower(own, stacked, x, mask)
    assert len(jax.tree.leaves(lowered.args_info)) == 2 + 6 + 2
    assert lowered.as_text().count("dot_general") == 2  # one traced layer, not six
    np.testing.assert_array_equal(
        np.asarray(lowered.compile()(own, stacked, x, mask)),
        np.asarray(jax.jit(run)(own, stacked, x, mask)),
    )
