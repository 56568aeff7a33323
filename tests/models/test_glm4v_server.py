"""GLM-4.1V's server form: `forward(nnx.merge(graphdef, state), pixels, meta)` inside a server's
own jit over the state's flat leaves. Its argument count does not grow with depth, a new state
compiles nothing, it equals the entry bit for bit, every stacked layer reaches the output, the
plan fixes every static size, and the forward refuses inputs that do not fit its plan."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import jaxsync
from jaxsync.check import RecompileError, count_compiles, no_recompile
from jaxsync.harness.paths.glm4v import reference as ref
from jaxsync.models import glm4v
from jaxsync.testing import assert_close, assert_layers_run, assert_same_math


CFG = glm4v.Glm4vVisionConfig(**ref.TINY)
GRID = [[1, 6, 6], [2, 4, 4], [1, 2, 10]]  # an image, a two-frame video, a thin image


@pytest.fixture(scope="module")
def model():
    return glm4v.Glm4vVisionTower(CFG, rngs=nnx.Rngs(0))


def _server_step(graphdef, treedef, forward=glm4v.forward):
    """A server's jit: the state as flat leaves, the module merged inside the trace."""

    def step(leaves, pixels, meta):
        state = jax.tree_util.tree_unflatten(treedef, leaves)
        return forward(nnx.merge(graphdef, state), pixels, meta)

    return jax.jit(step)


def _padded(plan, px) -> jax.Array:
    host = np.zeros((plan.padded_patches, CFG.patch_dim), np.float32)
    host[: px.shape[0]] = px
    return jaxsync.async_h2d(host)


def _leaf_count(cfg) -> int:
    tower = nnx.eval_shape(lambda: glm4v.Glm4vVisionTower(cfg, rngs=nnx.Rngs(0)))  # no weights
    return len(jax.tree.leaves(nnx.state(tower)))


def test_state_leaves_are_the_jit_arguments_and_do_not_grow_with_depth():
    counts = {}
    for depth in (1, 2, 7):
        cfg = glm4v.Glm4vVisionConfig(**{**ref.TINY, "depth": depth})
        tower = glm4v.Glm4vVisionTower(cfg, rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(tower)
        leaves, treedef = jax.tree_util.tree_flatten(state)
        plan = glm4v.plan(GRID, tower.cfg)
        px = _padded(plan, ref.pixels(GRID, cfg))
        lowered = _server_step(graphdef, treedef).lower(leaves, px, jaxsync.upload_packed(plan))
        counts[depth] = len(leaves)
        assert len(jax.tree.leaves(lowered.args_info)) == len(leaves) + 2  # + pixels, meta
    assert counts == {1: 21, 2: 21, 7: 21}, counts  # 21: one leaf per weight kind
    assert _leaf_count(glm4v.Glm4vVisionConfig(**{**ref.TINY, "depth": 7})) == 21


def test_released_tower_state_is_20_leaves():
    """The released GLM-4.1V tower (24 blocks, no qkv bias), built abstractly."""
    assert _leaf_count(glm4v.Glm4vVisionConfig()) == 20  # <= 40 at any depth


def test_new_state_compiles_nothing_and_is_used(model):
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    step = _server_step(graphdef, treedef)
    plan = glm4v.plan(GRID, model.cfg)
    px, meta = _padded(plan, ref.pixels(GRID, CFG, seed=1)), jaxsync.upload_packed(plan)
    before = np.asarray(step(leaves, px, meta).rows)
    halved = [leaf * 0.5 for leaf in leaves]
    with no_recompile():
        after = np.asarray(step(halved, px, meta).rows)
    assert not np.allclose(after, before)
    # and through nnx.update of the module, as an entry's load_state sees it
    enc = glm4v.Glm4vVisionEncoder(nnx.merge(graphdef, state))
    enc(ref.pixels(GRID, CFG, seed=1), GRID)
    updated = nnx.merge(graphdef, state)
    nnx.update(updated, jax.tree_util.tree_unflatten(treedef, halved))
    with no_recompile():
        enc.load_state(updated)
        got = enc(ref.pixels(GRID, CFG, seed=1), GRID)
    np.testing.assert_array_equal(np.asarray(got.rows), after)


@pytest.mark.parametrize("layout", ["dense", "segments", "ragged"])
def test_entry_and_server_form_give_identical_rows(model, layout):
    enc = glm4v.Glm4vVisionEncoder(model, layout=layout)
    px = ref.pixels(GRID, CFG, seed=2)
    out = enc(px, GRID)
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    plan = glm4v.plan(GRID, model.cfg, layout=layout)
    assert plan.lengths == out.lengths and plan.layout == layout
    encoded = _server_step(graphdef, treedef)(
        leaves, _padded(plan, px), jaxsync.upload_packed(plan)
    )
    assert_same_math(encoded.rows, out.rows)
    assert_same_math(encoded.extras["hidden"], out.extras["hidden"])
    np.testing.assert_array_equal(np.asarray(encoded.finite), np.asarray(out.finite))
    assert encoded.finite.shape == (plan.padded_items,) == (8,)
    # the item's rows at the plan's lengths, contiguous from row 0
    assert [p.shape[0] for p in jaxsync.Embeddings.of(encoded, plan).split()] == [9, 8, 5]


def test_every_stacked_layer_reaches_the_output(model):
    plan = glm4v.plan(GRID, model.cfg)
    px = _padded(plan, ref.pixels(GRID, CFG, seed=3))
    assert_layers_run(model, glm4v.forward, px, jaxsync.upload_packed(plan))


def test_blocks_at_i_are_the_scanned_layers(model):
    """Layer i's view, applied in turn, is the stack's scan."""
    x = jax.random.normal(jax.random.key(0), (16, CFG.hidden_size))
    from jaxsync.models.glm4v._attention import rotary_cos_sin

    h, w = (jax.numpy.arange(16) // 4, jax.numpy.arange(16) % 4)
    cos, sin = rotary_cos_sin(h, w, CFG.head_dim, CFG.rope_theta)
    mask = jax.numpy.ones((16, 16), bool)
    looped = x
    for i in range(len(model.blocks)):
        looped = model.blocks.at(i)(looped, cos, sin, mask)
    # eager layers against one compiled scan: XLA fuses them differently (fp32 rounding only)
    assert_close(jax.jit(model.blocks)(x, cos, sin, mask), looped, rtol=1e-6)
    assert not np.allclose(np.asarray(model.blocks.at(0)(x, cos, sin, mask)), np.asarray(looped))


def test_two_and_three_items_share_one_program(model):
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    step = _server_step(graphdef, treedef)
    two, three = [[1, 6, 6], [1, 4, 8]], [[1, 6, 6], [1, 4, 4], [1, 2, 8]]
    plans = [glm4v.plan(g, model.cfg) for g in (two, three)]
    assert {p.padded_items for p in plans} == {8}
    assert plans[0].padded_patches == plans[1].padded_patches
    step(leaves, _padded(plans[0], ref.pixels(two, CFG)), jaxsync.upload_packed(plans[0]))
    with no_recompile():
        out = step(
            leaves, _padded(plans[1], ref.pixels(three, CFG)), jaxsync.upload_packed(plans[1])
        )
    assert out.finite.shape == (8,)
    # control: nine items (the same patch bucket) take the next item bucket, another program
    nine_grid = [[1, 2, 4]] * 9
    nine = glm4v.plan(nine_grid, model.cfg)
    assert nine.padded_items == 64 and nine.padded_patches == plans[0].padded_patches
    with pytest.raises(RecompileError), no_recompile():
        step(leaves, _padded(nine, ref.pixels(nine_grid, CFG)), jaxsync.upload_packed(nine))


def test_forward_refuses_pixels_that_do_not_fit_the_plan(model):
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    plan = glm4v.plan(GRID, model.cfg)
    meta = jaxsync.upload_packed(plan)
    step = _server_step(graphdef, treedef)
    unpadded = jaxsync.async_h2d(ref.pixels(GRID, CFG))  # the real rows only
    with count_compiles() as log, pytest.raises(ValueError) as err:
        step(leaves, unpadded, meta)
    assert f"({unpadded.shape[0]}, {CFG.patch_dim})" in str(err.value)
    assert f"[{plan.padded_patches}, {CFG.patch_dim}]" in str(err.value)
    assert log.lowerings == [] and log.compiles == []  # refused while tracing
    other = glm4v.plan([[1, 2, 2]], model.cfg)  # a plan of another bucket
    with pytest.raises(ValueError, match="do not fit the plan"):
        step(leaves, _padded(other, ref.pixels([[1, 2, 2]], CFG)), meta)


def test_encoder_only_rows_are_the_tokens_before_the_merger(model):
    px = ref.pixels(GRID, CFG, seed=4)
    full = glm4v.Glm4vVisionEncoder(model)(px, GRID)
    enc = glm4v.Glm4vVisionEncoder(model, encoder_only=True)
    out = enc(px, GRID)
    assert out.lengths == full.lengths and sorted(out.extras) == ["finite"]
    assert out.rows.shape == full.extras["hidden"].shape
    assert_same_math(out.rows, full.extras["hidden"])
    np.testing.assert_array_equal(np.asarray(out.finite), np.asarray(full.finite))
    # the server form of the same option
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    plan = enc.plan(GRID, px.shape[0])
    step = _server_step(graphdef, treedef, glm4v.forward_encoder_only)
    encoded = step(leaves, _padded(plan, px), jaxsync.upload_packed(plan))
    assert encoded.extras is None
    assert_same_math(encoded.rows, out.rows)
