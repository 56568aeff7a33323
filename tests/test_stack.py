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


def _counter_scan(stack: jaxsync.LayerStack, x: jax.Array, gain: jax.Array) -> jax.Array:
    """The layer scan written the naive way: the stacked weights as the scan's xs, sliced at
    the loop counter (the form the detectors below must flag)."""
    graphdef, state = nnx.split(stack.layer)

    def step(carry, layer_state):
        return nnx.merge(graphdef, layer_state)(carry, gain), None

    return jax.lax.scan(step, x, state)[0]


def _scan_xs(eqn) -> list:
    """A scan equation's xs operands (its invars are consts, then carry, then xs). jax < 0.12
    counts the first two groups in `num_consts` / `num_carry`; jax 0.12 gives the three groups
    as the elements of one flat tree, `ft_in`."""
    params = eqn.params
    if "num_consts" in params:
        return eqn.invars[params["num_consts"] + params["num_carry"] :]
    xs_leaves = len(params["ft_in"].elts[2].vals)
    return eqn.invars[len(eqn.invars) - xs_leaves :]


def _scanned_over(fn, *args) -> list[list[tuple]]:
    """(shape, dtype, producing primitive) of every scan's xs in `fn`'s jaxpr: the arrays it
    slices per step, and whether the compiler can know them (a constant) or not (a barrier)."""
    found = []

    def walk(jaxpr):
        made_by = {}
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "scan":
                found.append([
                    (v.aval.shape, str(v.aval.dtype), made_by.get(v)) for v in _scan_xs(eqn)
                ])  # fmt: skip
            made_by.update((v, eqn.primitive.name) for v in eqn.outvars)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if hasattr(sub, "eqns"):  # a Jaxpr
                        walk(sub)
                    elif hasattr(getattr(sub, "jaxpr", None), "eqns"):  # a ClosedJaxpr
                        walk(sub.jaxpr)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@pytest.mark.parametrize("span", [None, (1, 4)])
def test_the_layer_scan_reads_its_index_not_the_loop_counter(span):
    # Sliced at the loop counter, XLA:GPU copies every stacked weight with a host-launched
    # memcpy per layer; the scan must run over an index vector and slice the weights by it.
    tower = Tower(5, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(tower)
    x, gain = jnp.ones((2, 6)), jnp.float32(0.5)

    def server(s, x):
        return nnx.merge(graphdef, s).blocks(x, gain, span=span)

    layers = 5 if span is None else 3
    assert _scanned_over(server, state, x) == [[((layers,), "int32", "optimization_barrier")]]
    # negative control: the naive scan slices the three stacked leaves of a Block
    naive = _scanned_over(lambda s, x: _counter_scan(nnx.merge(graphdef, s).blocks, x, gain),
                          state, x)  # fmt: skip
    assert len(naive[0]) == 3 and all(shape[0] == 5 for shape, _, _ in naive[0])


@pytest.mark.gpu
def test_a_server_jit_over_stacked_leaves_copies_no_layer_with_a_memcpy(tmp_path):
    """On a GPU, the scan of a server's own jit runs no per-layer memcpy (negative control: the
    naive scan runs one per stacked weight per layer)."""
    import glob
    import gzip
    import json

    depth, d = 8, 512
    tower = Tower(depth, d, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(tower)
    x, gain = jnp.ones((64, d)), jnp.float32(0.5)
    forms = {
        "stack": jax.jit(lambda s, x: nnx.merge(graphdef, s).blocks(x, gain)),
        "naive": jax.jit(lambda s, x: _counter_scan(nnx.merge(graphdef, s).blocks, x, gain)),
    }
    memcpys = {}
    for name, step in forms.items():
        jax.block_until_ready(step(state, x))
        trace = tmp_path / name
        with jax.profiler.trace(str(trace), create_perfetto_trace=True):
            jax.block_until_ready(step(state, x))
        (path,) = glob.glob(f"{trace}/**/*perfetto_trace.json.gz", recursive=True)
        with gzip.open(path) as f:
            events = json.load(f)
        events = events["traceEvents"] if isinstance(events, dict) else events
        memcpys[name] = sum(
            1 for e in events if e.get("ph") == "X" and "memcpy" in e.get("name", "").lower()
        )
    assert memcpys["naive"] >= depth, memcpys  # the detector sees the per-layer copies
    assert memcpys["stack"] < depth, memcpys


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
