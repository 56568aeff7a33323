"""TowerProgram: the entry compiles the very function a server jits over its state leaves."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsync
import jaxsync.testing
from jaxsync.check import no_recompile


class Layer(nnx.Module):
    def __init__(self, d, rngs):
        self.lin = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x, scale):
        return x + jnp.tanh(self.lin(x)) * scale[0]


class Tower(nnx.Module):
    def __init__(self, d=7, depth=5, *, rngs):
        self.inp = nnx.Linear(3, d, rngs=rngs)
        self.blocks = jaxsync.LayerStack(lambda r: Layer(d, r), depth, rngs=rngs)
        self.out = nnx.Linear(d, 2, rngs=rngs)


def forward(model, x, meta):
    return model.out(model.blocks(model.inp(x), meta.scale))


def _inputs():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((11, 3)), jnp.float32)
    return x, jaxsync.upload_packed({"scale": np.full((1,), 0.5, np.float32)})


def _server_step(model):
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    step = jax.jit(
        lambda leaves, *a: forward(nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves)), *a)
    )
    return step, leaves


@pytest.mark.parametrize("depth", [1, 5, 13])
def test_program_equals_the_server_form_bit_for_bit_at_a_constant_argument_count(depth):
    model = Tower(depth=depth, rngs=nnx.Rngs(depth))
    program = jaxsync.TowerProgram(model, forward, packed=False)
    x, meta = _inputs()
    step, leaves = _server_step(model)
    np.testing.assert_array_equal(program(x, meta), step(leaves, x, meta))
    assert program.num_state_args == 6  # inp (2), the stack (2), out (2): at any depth
    assert len(jax.tree.leaves(program.lower(x, meta).args_info)) == 6 + 2
    packed = jaxsync.TowerProgram(model, forward)  # the entries' default
    assert packed.packed and packed.num_state_args == 2  # one flat buffer, one row buffer
    np.testing.assert_array_equal(packed(x, meta), step(leaves, x, meta))


def test_programs_of_one_structure_share_their_compile_and_hold_their_own_weights():
    a, b = Tower(rngs=nnx.Rngs(0)), Tower(rngs=nnx.Rngs(1))
    x, meta = _inputs()
    out_a = jaxsync.TowerProgram(a, forward)(x, meta)
    with no_recompile():
        out_b = jaxsync.TowerProgram(b, forward)(x, meta)
    assert not np.allclose(out_a, out_b)
    np.testing.assert_array_equal(out_b, _server_step(b)[0](_server_step(b)[1], x, meta))


@pytest.mark.parametrize("packed", [True, False])
def test_a_committed_and_an_uncommitted_input_share_one_compile(packed):
    # `device_put(x, device)` (and a staged upload) commits x to its device, `device_put(x)`
    # does not; jit keys programs by that flag, so a program must not compile a second time
    # for it (a server feeding both would pay a compile per bucket that `precompile` missed).
    device = jax.devices()[0]
    tower = Tower(rngs=nnx.Rngs(0))
    x, meta = _inputs()
    host = np.asarray(x)
    program = jaxsync.TowerProgram(tower, forward, packed=packed)
    committed = program(jax.device_put(host, device), meta)
    with no_recompile():
        uncommitted = program(jax.device_put(host), meta)
    np.testing.assert_array_equal(committed, uncommitted)
    # negative control: a plain jit of the same step compiles once more for the other flag
    step, leaves = _server_step(tower)
    step(leaves, jax.device_put(host, device), meta)
    with pytest.raises(jaxsync.check.RecompileError):
        with no_recompile():
            step(leaves, jax.device_put(host), meta)


def test_load_state_takes_new_weights_without_recompiling_and_refuses_another_shape():
    model = Tower(rngs=nnx.Rngs(0))
    program = jaxsync.TowerProgram(model, forward)
    x, meta = _inputs()
    before = program(x, meta)
    nnx.update(model, nnx.state(Tower(rngs=nnx.Rngs(5))))
    np.testing.assert_array_equal(program(x, meta), before)  # a snapshot until load_state
    with no_recompile():
        program.load_state(model)
        after = program(x, meta)
    assert not np.allclose(before, after)
    with pytest.raises(ValueError, match="same structure"):
        program.load_state(Tower(depth=4, rngs=nnx.Rngs(0)))


def test_a_kept_call_refuses_a_deleted_input_before_any_launch():
    program = jaxsync.TowerProgram(Tower(rngs=nnx.Rngs(0)), forward)
    x, meta = _inputs()
    run = program.prepared(meta, finish=lambda out: out, name="features")
    run(x)
    x.delete()
    with pytest.raises(ValueError, match="features was deleted"):
        run(x)


def test_layers_run_detector_and_its_negative_control():
    model = Tower(depth=3, rngs=nnx.Rngs(0))
    x, meta = _inputs()
    jaxsync.testing.assert_layers_run(model, forward, x, meta)

    def skips(model, x, meta):  # loops over nothing: the layers never run
        return model.out(model.inp(x))

    with pytest.raises(AssertionError, match="does not change the output"):
        jaxsync.testing.assert_layers_run(model, skips, x, meta)

    def first_only(model, x, meta):
        return model.out(model.blocks(model.inp(x), meta.scale, span=(0, 1)))

    with pytest.raises(AssertionError, match="layer 2 of 'blocks'"):
        jaxsync.testing.assert_layers_run(model, first_only, x, meta)


def test_sharded_state_stays_sharded_inside_the_program():
    mesh = jaxsync.testing.device_mesh("model", auto=True)
    model = Tower(d=8, rngs=nnx.Rngs(0))
    for var in jax.tree.leaves(model, is_leaf=lambda v: isinstance(v, nnx.Variable)):
        var.set_value(jax.device_put(var.get_value(), jax.NamedSharding(mesh, jax.P())))
    kernel = model.blocks.layer.lin.kernel
    kernel[...] = jax.device_put(kernel[...], jax.NamedSharding(mesh, jax.P(None, None, "model")))
    program = jaxsync.TowerProgram(model, forward)
    replicated = jax.NamedSharding(mesh, jax.P())
    x = jax.device_put(_inputs()[0], replicated)
    meta = jaxsync.upload_packed({"scale": np.full((1,), 0.5, np.float32)}, placement=replicated)
    step, leaves = _server_step(model)
    np.testing.assert_allclose(program(x, meta), step(leaves, x, meta), rtol=1e-6)
    specs = [leaf.sharding.spec for leaf in program.leaves]
    assert specs.count(jax.P(None, None, "model")) == 1, specs  # passed as it is, not gathered


class Inner(nnx.Module):
    def __init__(self, rngs):
        self.stack = jaxsync.LayerStack(lambda r: Layer(7, r), 4, rngs=rngs)


class Nested(nnx.Module):
    """Two stacks, one inside a list, run in spans: the packed program finds every stack."""

    def __init__(self, rngs):
        self.inp = nnx.Linear(3, 7, rngs=rngs)
        self.blocks = jaxsync.LayerStack(lambda r: Layer(7, r), 5, rngs=rngs)
        self.inner = nnx.List([Inner(rngs)])
        self.out = nnx.Linear(7, 2, rngs=rngs)


def nested_forward(model, x, meta):
    h = model.blocks(model.inp(x), meta.scale)
    stack = model.inner[0].stack
    return model.out(stack(stack(h, meta.scale, span=(0, 1)), meta.scale, span=(1, 4)))


@pytest.mark.parametrize("model_forward", [(Tower, forward), (Nested, nested_forward)])
def test_packed_program_runs_the_same_forward_in_few_arguments(model_forward):
    make, fwd = model_forward
    model = make(rngs=nnx.Rngs(0))
    x, meta = _inputs()
    plain = jaxsync.TowerProgram(model, fwd, packed=False)
    packed = jaxsync.TowerProgram(model, fwd)
    assert packed.packed and packed.num_state_args < plain.num_state_args
    assert packed.num_state_args == 1 + (2 if make is Nested else 1)  # own + one per stack
    np.testing.assert_array_equal(packed(x, meta), plain(x, meta))
    nnx.update(model, nnx.state(make(rngs=nnx.Rngs(4))))
    with no_recompile():
        packed.load_state(model)
        plain.load_state(model)
        np.testing.assert_array_equal(packed(x, meta), plain(x, meta))
    jaxsync.testing.assert_layers_run(model, fwd, x, meta)


def test_a_sharded_state_is_never_packed():
    mesh = jaxsync.testing.device_mesh("model", auto=True)
    model = Tower(d=8, rngs=nnx.Rngs(0))
    kernel = model.blocks.layer.lin.kernel
    kernel.set_value(jax.device_put(kernel.get_value(), jax.NamedSharding(mesh, jax.P())))
    assert not jaxsync.TowerProgram(model, forward).packed  # two placements


def test_a_stack_of_no_layers_packs_with_the_flat_leaves():
    model = Tower(depth=0, rngs=nnx.Rngs(0))
    x, meta = _inputs()
    packed = jaxsync.TowerProgram(model, forward)
    assert packed.packed and packed.num_state_args == 1
    np.testing.assert_array_equal(
        packed(x, meta), _server_step(model)[0](_server_step(model)[1], x, meta)
    )
