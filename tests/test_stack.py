"""jaxsync.LayerStack: stacked layers, one scan, per-layer views, and loading per-layer keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from safetensors.numpy import save_file

import jaxsync
import jaxsync.check
from jaxsync.weights import Rule, WeightError, linear, load_weights


class Block(nnx.Module):
    def __init__(self, d: int, *, rngs: nnx.Rngs):
        self.proj = nnx.Linear(d, d, rngs=rngs)
        self.scale = nnx.Param(jnp.ones((d,)))

    def __call__(self, x: jax.Array, gain: jax.Array) -> jax.Array:
        return x + jnp.tanh(self.proj(x)) * self.scale[None, :] * gain


class Tower(nnx.Module):
    def __init__(self, depth: int, d: int = 6, *, rngs: nnx.Rngs):
        self.blocks = jaxsync.LayerStack(lambda r: Block(d, rngs=r), depth, rngs=rngs)
        self.head = nnx.Linear(d, 3, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(self.blocks(x, jnp.float32(0.5)))


def _loop(tower: Tower, x: jax.Array) -> jax.Array:
    for i in range(len(tower.blocks)):
        x = tower.blocks.at(i)(x, jnp.float32(0.5))
    return tower.head(x)


@pytest.mark.parametrize("depth", [1, 3, 7])
def test_scan_equals_a_loop_over_layer_views(depth):
    tower = Tower(depth, rngs=nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(0), (5, 6))
    np.testing.assert_allclose(tower(x), _loop(tower, x), rtol=1e-6, atol=1e-6)


def test_leaf_count_does_not_grow_with_depth():
    counts = {d: len(jax.tree.leaves(nnx.state(Tower(d, rngs=nnx.Rngs(0))))) for d in (1, 4, 32)}
    assert set(counts.values()) == {5}, counts


def test_layers_initialise_differently_and_a_span_runs_a_run_of_layers():
    tower = Tower(4, rngs=nnx.Rngs(2))
    kernels = np.asarray(tower.blocks.layer.proj.kernel[...])
    assert not np.allclose(kernels[0], kernels[1])
    x = jnp.ones((2, 6))
    whole = tower.blocks(x, jnp.float32(0.5))
    parts = tower.blocks(
        tower.blocks(x, jnp.float32(0.5), span=(0, 1)), jnp.float32(0.5), span=(1, 4)
    )
    np.testing.assert_allclose(whole, parts, rtol=1e-6)
    with pytest.raises(ValueError, match="span"):
        tower.blocks(x, jnp.float32(0.5), span=(2, 5))


def test_zero_layers_is_the_identity_and_a_stack_is_not_iterable():
    tower = Tower(0, rngs=nnx.Rngs(0))
    x = jnp.arange(12.0).reshape(2, 6)
    np.testing.assert_array_equal(tower.blocks(x, jnp.float32(1.0)), x)
    with pytest.raises(TypeError):
        iter(tower.blocks)
    with pytest.raises(IndexError):
        tower.blocks.at(0)


def test_of_stacks_existing_layers_and_refuses_other_structures():
    layers = [Block(6, rngs=nnx.Rngs(i)) for i in range(3)]
    stack = jaxsync.LayerStack.of(layers)
    x = jnp.ones((2, 6))
    y = x
    for layer in layers:
        y = layer(y, jnp.float32(0.5))
    np.testing.assert_allclose(stack(x, jnp.float32(0.5)), y, rtol=1e-6)
    with pytest.raises(ValueError, match="structure|shapes"):
        jaxsync.LayerStack.of([Block(6, rngs=nnx.Rngs(0)), Block(5, rngs=nnx.Rngs(0))])


def test_server_jit_sees_a_new_state_without_recompiling():
    tower = Tower(3, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(tower)
    step = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    x = jnp.ones((2, 6))
    before = step(state, x)
    other = nnx.state(Tower(3, rngs=nnx.Rngs(9)))
    with jaxsync.check.no_recompile():
        after = step(other, x)
    assert not np.allclose(before, after)


RULES = (
    Rule(r"blocks\.(\d+)\.proj\.weight", r"blocks.\1.proj.kernel", linear),
    Rule(r"blocks\.(\d+)\.proj\.bias", r"blocks.\1.proj.bias"),
    Rule(r"blocks\.(\d+)\.scale", r"blocks.\1.scale"),
    Rule(r"head\.weight", "head.kernel", linear),
    Rule(r"head\.bias", "head.bias"),
)


def _checkpoint(path, depth: int, skip: str | None = None) -> tuple[str, dict]:
    rng = np.random.default_rng(0)
    tensors = {}
    for i in range(depth):
        tensors[f"blocks.{i}.proj.weight"] = rng.standard_normal((6, 6), np.float32)
        tensors[f"blocks.{i}.proj.bias"] = rng.standard_normal(6, np.float32)
        tensors[f"blocks.{i}.scale"] = rng.standard_normal(6, np.float32)
    tensors["head.weight"] = rng.standard_normal((3, 6), np.float32)
    tensors["head.bias"] = rng.standard_normal(3, np.float32)
    tensors.pop(skip, None)
    file = str(path / "model.safetensors")
    save_file(tensors, file)
    return file, tensors


def test_loader_fills_stacked_slices_from_per_layer_keys(tmp_path):
    file, tensors = _checkpoint(tmp_path, 3)
    tower = load_weights(lambda: Tower(3, rngs=nnx.Rngs(0)), file, RULES)
    for i in range(3):
        np.testing.assert_array_equal(
            tower.blocks.at(i).proj.kernel[...], tensors[f"blocks.{i}.proj.weight"].T
        )
        np.testing.assert_array_equal(tower.blocks.at(i).scale[...], tensors[f"blocks.{i}.scale"])


def test_loader_refuses_a_missing_layer_and_a_layer_past_the_stack(tmp_path):
    file, _ = _checkpoint(tmp_path, 3, skip="blocks.1.scale")
    with pytest.raises(WeightError, match=r"layer\(s\) of stacked parameter 'blocks.layer.scale'"):
        load_weights(lambda: Tower(3, rngs=nnx.Rngs(0)), file, RULES)
    file, _ = _checkpoint(tmp_path, 4)
    with pytest.raises(WeightError, match="names layer 3 of 'blocks', which has 3 layers"):
        load_weights(lambda: Tower(3, rngs=nnx.Rngs(0)), file, RULES)


def test_partition_rules_describe_one_layer_and_the_layer_axis_stays_whole(tmp_path):
    file, _ = _checkpoint(tmp_path, 2)
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    tower = load_weights(
        lambda: Tower(2, rngs=nnx.Rngs(0)),
        file,
        RULES,
        mesh=mesh,
        partition_rules=[(r"blocks\.layer\.proj\.kernel", (None, "model"))],
    )
    kernel = tower.blocks.layer.proj.kernel[...]
    assert kernel.sharding == NamedSharding(mesh, PartitionSpec(None, None, None)) or (
        kernel.sharding.spec == PartitionSpec(None, None, None)
    ), "6 columns do not divide over 4 devices: replicated"
    tower = load_weights(
        lambda: Tower(2, d=8, rngs=nnx.Rngs(0)),
        _checkpoint_wide(tmp_path),
        RULES,
        mesh=mesh,
        partition_rules=[(r"blocks\.layer\.proj\.kernel", (None, "model"))],
    )
    assert tower.blocks.layer.proj.kernel[...].sharding.spec == PartitionSpec(None, None, "model")


def _checkpoint_wide(path) -> str:
    rng = np.random.default_rng(1)
    tensors = {}
    for i in range(2):
        tensors[f"blocks.{i}.proj.weight"] = rng.standard_normal((8, 8), np.float32)
        tensors[f"blocks.{i}.proj.bias"] = rng.standard_normal(8, np.float32)
        tensors[f"blocks.{i}.scale"] = rng.standard_normal(8, np.float32)
    tensors["head.weight"] = rng.standard_normal((3, 8), np.float32)
    tensors["head.bias"] = rng.standard_normal(3, np.float32)
    file = str(path / "wide.safetensors")
    save_file(tensors, file)
    return file


def test_loader_builds_a_stack_of_no_layers_without_keys(tmp_path):
    file, tensors = _checkpoint(tmp_path, 0)
    tower = load_weights(lambda: Tower(0, rngs=nnx.Rngs(0)), file, RULES)
    assert tower.blocks.layer.proj.kernel[...].shape == (0, 6, 6)
    np.testing.assert_array_equal(tower.head.bias[...], tensors["head.bias"])
