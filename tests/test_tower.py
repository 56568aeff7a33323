"""TowerProgram: one shared forward, a loop outside, a packed scan inside; few jit arguments."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsync
from jaxsync.check import no_recompile


class Layer(nnx.Module):
    def __init__(self, d, rngs):
        self.lin = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x, scale):
        return jnp.tanh(self.lin(x)) * scale[0]


class Tower(nnx.Module):
    def __init__(self, d=7, depth=5, *, rngs):
        self.inp = nnx.Linear(3, d, rngs=rngs)
        self.blocks = nnx.List([Layer(d, rngs) for _ in range(depth)])
        self.out = nnx.Linear(d, 2, rngs=rngs)


def forward(model, x, meta):
    h = model.inp(x)
    h = jaxsync.run_layers(model.blocks, h, meta["scale"])
    return model.out(h)


def _inputs():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((11, 3)), jnp.float32)
    return x, jaxsync.upload_packed({"scale": np.full((1,), 0.5, np.float32)})


@pytest.mark.parametrize("depth", [1, 5, 13])
def test_program_matches_the_pure_forward_with_constant_argument_count(depth):
    model = Tower(depth=depth, rngs=nnx.Rngs(0))
    x, meta = _inputs()
    prog = jaxsync.TowerProgram(model, forward, layers="blocks")
    np.testing.assert_allclose(prog(x, meta), forward(model, x, meta), rtol=1e-6, atol=1e-6)
    # one state buffer (one dtype) + x + the packed meta, however deep
    assert prog.num_state_args == 1
    assert len(jax.tree.leaves(prog.lower(x, meta).args_info)) == 3
    x2 = x * 2
    with no_recompile():
        prog(x2, meta)


def test_pure_forward_inside_a_server_jit_takes_weights_as_arguments():
    model = Tower(rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    x, meta = _inputs()

    @jax.jit
    def step(state, x, meta):
        return forward(nnx.merge(graphdef, state), x, meta)

    first = step(state, x, meta)
    # every weight is a program argument: state leaves + x + the packed meta buffer
    state_args = step.lower(state, x, meta).args_info[0][0]
    assert len(jax.tree.leaves(state_args)) == len(jax.tree.leaves(state))
    halved = jax.tree.map(lambda w: w * 0.5, state)
    with no_recompile():
        second = step(halved, x, meta)
    assert not np.allclose(first, second)  # the new weights were used, not baked constants


def test_load_state_takes_new_weights_without_recompiling():
    model = Tower(rngs=nnx.Rngs(0))
    x, meta = _inputs()
    prog = jaxsync.TowerProgram(model, forward, layers="blocks")
    before = prog(x, meta)
    _, state = nnx.split(model)
    nnx.update(model, jax.tree.map(lambda w: w * 0.5, state))
    np.testing.assert_array_equal(prog(x, meta), before)  # a snapshot until load_state
    with no_recompile():
        prog.load_state(model)
        after = prog(x, meta)
    np.testing.assert_allclose(after, forward(model, x, meta), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="same parameter structure"):
        prog.load_state(Tower(d=5, rngs=nnx.Rngs(1)))
    np.testing.assert_array_equal(prog(x, meta), after)  # a refused state changes nothing


def test_model_without_layers_packs_flat():
    model = Tower(depth=0, rngs=nnx.Rngs(0))
    x, meta = _inputs()
    prog = jaxsync.TowerProgram(model, forward, layers=None)
    np.testing.assert_allclose(prog(x, meta), forward(model, x, meta), rtol=1e-6)
    assert prog.num_state_args == 1


def test_sharded_state_passes_leaf_by_leaf():
    mesh = jax.make_mesh((len(jax.devices()),), ("model",), (jax.sharding.AxisType.Auto,))
    model = Tower(d=8, depth=3, rngs=nnx.Rngs(0))
    x, meta = _inputs()
    expected = forward(model, x, meta)
    _, state = nnx.split(model)
    replicated = jax.NamedSharding(mesh, jax.P())
    nnx.update(model, jax.tree.map(lambda w: jax.device_put(w, replicated), state))
    for layer in model.blocks:  # the layer kernels split over the model axis
        k = layer.lin.kernel
        k.set_value(jax.device_put(k[...], jax.NamedSharding(mesh, jax.P(None, "model"))))
    x = jax.device_put(x, replicated)
    meta = jaxsync.upload_packed({"scale": np.full((1,), 0.5, np.float32)}, placement=replicated)
    prog = jaxsync.TowerProgram(model, forward, layers="blocks")
    assert prog.num_state_args > 1  # not packed: packing would reshard
    np.testing.assert_allclose(prog(x, meta), expected, rtol=1e-5, atol=1e-6)


def test_cublas_matmuls_option_applies_only_on_a_gpu():
    from jaxsync._tower import CUBLAS_MATMULS, jit_options

    assert jit_options("cublas", "gpu", {})["compiler_options"] == CUBLAS_MATMULS
    mine = {"compiler_options": {"xla_gpu_enable_triton_gemm": True}, "donate_argnums": (1,)}
    assert jit_options("cublas", "gpu", mine) == mine  # the caller's own option wins
    assert jit_options("cublas", "cpu", {}) == {} and jit_options("cublas", "tpu", {}) == {}
    assert jit_options("xla", "gpu", {}) == {}
    model = Tower(rngs=nnx.Rngs(0))
    x, meta = _inputs()
    prog = jaxsync.TowerProgram(model, forward, layers="blocks", matmuls="cublas")
    assert prog.platform == jax.devices()[0].platform
    np.testing.assert_array_equal(
        prog(x, meta), jaxsync.TowerProgram(model, forward, layers="blocks")(x, meta)
    )
    with pytest.raises(ValueError, match="matmuls"):
        jaxsync.TowerProgram(model, forward, layers="blocks", matmuls="triton")


def test_program_with_compiler_options_runs_inside_another_jit(monkeypatch):
    # JAX refuses compiler options on a nested jit; a "cublas" program traced inside a server's
    # step (or a checker's trace) takes the same function without them.
    from jaxsync import _tower

    monkeypatch.setattr(_tower, "jit_options", lambda m, p, kw: _tower.CUBLAS_MATMULS_KW)
    monkeypatch.setattr(
        _tower, "CUBLAS_MATMULS_KW", {"compiler_options": _tower.CUBLAS_MATMULS}, raising=False
    )
    model = Tower(rngs=nnx.Rngs(0))
    x, meta = _inputs()
    prog = jaxsync.TowerProgram(model, forward, layers="blocks", matmuls="cublas")
    want = np.asarray(prog(x, meta))
    np.testing.assert_array_equal(jax.jit(lambda x: prog(x, meta))(x), want)
    call = prog.prepared(meta, finish=lambda out: out, name="x")
    np.testing.assert_array_equal(call(x), want)
    np.testing.assert_array_equal(jax.jit(call)(x), want)
    # control: the plain jit with the options fails when nested
    opts = jax.jit(lambda x: x + 1, compiler_options=_tower.CUBLAS_MATMULS)
    with pytest.raises(ValueError, match="compiler_options"):
        jax.jit(lambda x: opts(x))(x)
