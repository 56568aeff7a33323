"""GLM-4.1V vision entry: sync-freedom, buckets without recompiles, plan layout, the pure forward
in a server's jit, the compiled-program cache, processor inputs, sharding, registry."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import jaxsync
from jaxsync.check import assert_sync_free
from jaxsync.harness.paths.glm4v import reference as ref
from jaxsync.harness.paths.glm4v.verify import VERIFY_GRIDS
from jaxsync.models import glm4v
from jaxsync.testing import assert_close, requires_torch


CFG = glm4v.Glm4vVisionConfig(**ref.TINY)  # the same tiny odd-sized tower as the parity tests


@pytest.fixture(scope="module")
def model():
    return glm4v.Glm4vVisionTower(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def enc(model):
    return glm4v.Glm4vVisionEncoder(model)


def _inputs():
    return [(ref.pixels(g, CFG, seed=i), g) for i, g in enumerate(VERIFY_GRIDS)]


def _padded(enc, px, grid) -> np.ndarray:
    host = np.zeros((enc.plan(grid).padded_patches, CFG.patch_dim), np.float32)
    host[: px.shape[0]] = px
    return host


def test_verify_grids_share_one_bucket(enc):
    sizes = {tuple(map(tuple, g)) for g in VERIFY_GRIDS}
    assert len({s for s in sizes if len(s) == 1 and s[0][0] == 1}) >= 5  # five image sizes
    assert {enc.plan(g).padded_patches for g in VERIFY_GRIDS} == {128}


def test_tower_is_sync_free_and_never_recompiles(enc):
    first, *rest = _inputs()
    report = assert_sync_free(enc, *first, inputs=rest)
    assert report.compiles == 0


def test_pos_embeds_is_sync_free(enc):
    first, *rest = [(g,) for g in VERIFY_GRIDS]
    assert_sync_free(enc.pos_embeds, *first, inputs=rest)


def test_device_pixels_are_sync_free(enc):
    padded = [(jaxsync.async_h2d(_padded(enc, px, g)), g) for px, g in _inputs()[:3]]
    assert_sync_free(enc, *padded[0], inputs=padded[1:])


def test_one_upload_per_new_grid_and_none_when_cached(model, monkeypatch):
    """Everything derived from grid_thw moves in one packed transfer (pixels are the other), and
    a repeated grid mix reuses its uploaded plan."""
    enc = glm4v.Glm4vVisionEncoder(model)
    calls = []
    real = jaxsync.upload_packed
    monkeypatch.setattr(jaxsync, "upload_packed", lambda f, **k: calls.append(f) or real(f, **k))
    px, g = _inputs()[-1]
    enc(px, g)
    assert len(calls) == 1 and isinstance(calls[0], glm4v.Glm4vPlan)
    assert type(calls[0].meta) is glm4v.Glm4vMeta
    enc(px * 2, g)
    assert len(calls) == 1


def test_plan_layout():
    plan = glm4v.plan([[2, 2, 4], [1, 2, 2]], CFG)
    assert (plan.num_patches, plan.padded_patches, plan.lengths) == (20, 32, (4, 1))
    assert (plan.num_items, plan.padded_items, plan.layout) == (2, 8, "dense")
    f = plan.meta
    # merge-block order: block-row, block-col, inner-row, inner-col; both frames identical
    np.testing.assert_array_equal(f.h[:16], [0, 0, 1, 1, 0, 0, 1, 1] * 2)
    np.testing.assert_array_equal(f.w[:16], [0, 1, 0, 1, 2, 3, 2, 3] * 2)
    np.testing.assert_array_equal(f.seg, [0] * 8 + [1] * 8 + [2] * 4 + [3] * 12)
    np.testing.assert_array_equal(f.tw[:20], [4] * 16 + [2] * 4)
    np.testing.assert_array_equal(f.item, [0] * 16 + [1] * 4 + [8] * 12)  # padding: item I
    np.testing.assert_array_equal(f.item_tokens, [4, 1, 0, 0, 0, 0, 0, 0])
    # the other layouts' fields are empty in a dense plan
    assert f.seq_lengths.shape == (0,) and f.groups == ()


def test_padding_never_changes_real_outputs(model):
    """The same batch in its tight bucket and in a 4x larger one: real rows agree."""
    grid = [[2, 6, 4], [1, 8, 8], [1, 2, 12]]  # 48 + 64 + 24 patches = 34 merged tokens
    px = ref.pixels(grid, CFG, seed=11)
    tight = glm4v.Glm4vVisionEncoder(model, buckets=glm4v.Glm4vBuckets(tokens=(34,)))
    loose = glm4v.Glm4vVisionEncoder(model, buckets=glm4v.Glm4vBuckets(tokens=(136,)))
    a, b = tight(px, grid), loose(px, grid)
    assert (a.embeddings.shape[0], b.embeddings.shape[0]) == (34, 136)
    assert_close(np.asarray(b.embeddings)[:34], np.asarray(a.embeddings), rtol=1e-6)
    assert_close(np.asarray(b.extras["hidden"])[:34], np.asarray(a.extras["hidden"]), rtol=1e-6)
    assert np.isfinite(np.asarray(b.embeddings)).all()


def test_device_pixels_padded_to_bucket(enc):
    grid = [[3, 4, 6]]
    px = ref.pixels(grid, CFG, seed=5)
    a = enc(jax.device_put(_padded(enc, px, grid)), grid)
    b = enc(px, grid)
    np.testing.assert_array_equal(np.asarray(a.embeddings), np.asarray(b.embeddings))
    assert a.lengths == b.lengths == (18,) and a.offsets == (0,)
    with pytest.raises(ValueError, match="padded to the bucket"):
        enc(jax.device_put(px), grid)


def test_released_config_shapes():
    """The released tower (depth 24, hidden 1536) built abstractly: nothing is allocated."""
    model = nnx.eval_shape(
        lambda: glm4v.Glm4vVisionTower(glm4v.Glm4vVisionConfig(), rngs=nnx.Rngs(0))
    )
    assert model.embeddings.position_embedding.shape == (576, 1536)
    assert model.patch_embed.proj.kernel.shape == (3 * 2 * 14 * 14, 1536)
    assert model.downsample.kernel.shape == (4 * 1536, 4096)
    # the 24 blocks stored stacked: one [L, ...] parameter per weight kind
    assert len(model.blocks) == 24
    assert model.blocks.layer.mlp.gate_proj.kernel.shape == (24, 1536, 4096)


@requires_torch
def test_registered_for_verify():
    from jaxsync.harness import registry

    names = {s.name for s in registry.paths(["glm4v"])}
    assert names == {"glm4v.vision_tower", "glm4v.pos_embeds"}
    for spec in registry.paths(["glm4v"]):
        case = spec.build(None)
        assert len(case.inputs) >= 2
        parity = case.parity()
        assert parity.ok, (spec.name, str(parity))


# --- the three layers: pure forward in a server's jit, shared compiled programs, load_state ---


def _weight_constants(lowered, min_elements: int = 256) -> list[str]:
    """Constants of the lowered program with at least `min_elements` elements."""
    import re

    found = []
    for shape in re.findall(r"stablehlo\.constant dense.*?: tensor<([0-9x]+)x[a-z0-9]+>", lowered):
        if int(np.prod([int(d) for d in shape.split("x")])) >= min_elements:
            found.append(shape)
    return found


def test_pure_forward_in_a_server_jit_takes_weights_as_arguments(model, enc):
    graphdef, state = nnx.split(model)
    px, grid = _inputs()[1]
    plan = enc.plan(grid, px.shape[0])
    pixels = jaxsync.async_h2d(_padded(enc, px, grid))
    meta = jaxsync.upload_packed(plan)

    @jax.jit
    def step(state, pixels, meta):
        return glm4v.forward(nnx.merge(graphdef, state), pixels, meta)

    hlo = step.lower(state, pixels, meta).as_text()
    assert _weight_constants(hlo) == []
    # negative control: the same forward closing over the module bakes its weights in
    baked = jax.jit(lambda pixels, meta: glm4v.forward(model, pixels, meta))
    assert len(_weight_constants(baked.lower(pixels, meta).as_text())) >= CFG.depth
    encoded = step(state, pixels, meta)
    assert isinstance(encoded, jaxsync.Encoded)
    out = enc(px, grid)
    assert_close(np.asarray(encoded.rows), np.asarray(out.embeddings), rtol=1e-6, atol=1e-6)
    hidden = np.asarray(encoded.extras["hidden"])
    assert_close(hidden, np.asarray(out.extras["hidden"]), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(encoded.finite), np.asarray(out.extras["finite"]))


def test_encoder_rebuilt_per_call_compiles_nothing_after_warm_up(model):
    """A server that keeps (graphdef, state) and builds the encoder for every call."""
    from jaxsync.check import count_compiles

    graphdef, state = nnx.split(model)
    calls = _inputs()
    glm4v.Glm4vVisionEncoder(nnx.merge(graphdef, state))(*calls[0])  # warm-up
    with count_compiles() as log:
        for px, grid in calls[1:]:
            out = glm4v.Glm4vVisionEncoder(nnx.merge(graphdef, state))(px, grid)
    assert log.count == 0, log
    # negative control: another config is another program
    other = glm4v.Glm4vVisionTower(
        glm4v.Glm4vVisionConfig(**{**ref.TINY, "depth": 3}), rngs=nnx.Rngs(0)
    )
    with count_compiles() as log:
        glm4v.Glm4vVisionEncoder(other)(*calls[0])
    assert log.count >= 1
    assert out.num_tokens == sum(t * h * w for t, h, w in calls[-1][1]) // 4


def test_rebuilt_encoders_keep_their_own_weights(model):
    """Encoders sharing one compiled program still use their own weights."""
    graphdef, state = nnx.split(model)
    halved = nnx.merge(graphdef, jax.tree.map(lambda w: w * 0.5, state))
    px, grid = _inputs()[0]
    a = glm4v.Glm4vVisionEncoder(nnx.merge(graphdef, state))
    b = glm4v.Glm4vVisionEncoder(halved)
    out_a, out_b = a(px, grid), b(px, grid)
    assert not np.allclose(np.asarray(out_a.embeddings), np.asarray(out_b.embeddings))
    np.testing.assert_array_equal(np.asarray(a(px, grid).embeddings), np.asarray(out_a.embeddings))


def test_load_state_takes_new_weights_without_recompiling():
    from jaxsync.check import no_recompile

    model = glm4v.Glm4vVisionTower(CFG, rngs=nnx.Rngs(1))
    enc = glm4v.Glm4vVisionEncoder(model)
    px, grid = _inputs()[0]
    before = np.asarray(enc(px, grid).embeddings)
    before_pos = np.asarray(enc.pos_embeds(grid))
    _, state = nnx.split(model)
    nnx.update(model, jax.tree.map(lambda w: w * 0.5, state))
    np.testing.assert_array_equal(np.asarray(enc(px, grid).embeddings), before)  # a snapshot
    with no_recompile():
        enc.load_state(model)
        after = np.asarray(enc(px, grid).embeddings)
        after_pos = np.asarray(enc.pos_embeds(grid))
    want = glm4v.Glm4vVisionEncoder(model)(px, grid).embeddings
    np.testing.assert_array_equal(after, np.asarray(want))
    assert not np.allclose(after, before)
    assert_close(after_pos, before_pos * 0.5, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("depth", [1, 5])
def test_program_argument_count_is_the_same_at_any_depth(depth):
    cfg = glm4v.Glm4vVisionConfig(**{**ref.TINY, "depth": depth})
    enc = glm4v.Glm4vVisionEncoder(glm4v.Glm4vVisionTower(cfg, rngs=nnx.Rngs(0)))
    grid = [[1, 6, 6]]
    plan = enc.plan(grid)
    pixels = jaxsync.async_h2d(np.zeros((plan.padded_patches, cfg.patch_dim), np.float32))
    lowered = enc.lower(pixels, jaxsync.upload_packed(plan))
    count = len(jax.tree.leaves(lowered.args_info))
    # the state's 21 leaves (one per weight kind; the blocks stacked) packed into one flat
    # buffer and one row buffer for the stack, the pixels, the meta
    assert enc.program.packed and enc.program.num_state_args == 2
    assert count == 2 + 2, count


# --- processor outputs go straight in ---


@requires_torch
def test_image_processor_outputs_numpy_and_torch(enc):
    """The real transformers GLM-4.1V image processor (the PIL one: no torchvision needed),
    built locally for the tiny tower's patch size, on three images of different sizes: its
    `return_tensors="pt"` and `"np"` outputs give identical embeddings, as keywords."""
    pytest.importorskip("PIL")
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    proc = Glm4vImageProcessorPil(
        patch_size=CFG.patch_size,
        temporal_patch_size=CFG.temporal_patch_size,
        merge_size=CFG.spatial_merge_size,
        size={"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 64},
    )
    rng = np.random.default_rng(0)
    images = [
        rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for h, w in [(50, 70), (90, 41), (33, 33)]
    ]
    as_np = proc(images=images, return_tensors="np")
    as_pt = proc(images=images, return_tensors="pt")
    assert len({tuple(g) for g in as_np["image_grid_thw"].tolist()}) == 3
    a = enc(pixel_values=as_np["pixel_values"], image_grid_thw=as_np["image_grid_thw"])
    b = enc(pixel_values=as_pt["pixel_values"], image_grid_thw=as_pt["image_grid_thw"])
    b2 = enc(**as_pt)  # the processor's own field names
    assert (
        a.lengths == b.lengths == tuple(int(t * h * w) // 4 for t, h, w in as_np["image_grid_thw"])
    )
    np.testing.assert_array_equal(np.asarray(b.embeddings), np.asarray(a.embeddings))
    np.testing.assert_array_equal(np.asarray(b2.embeddings), np.asarray(a.embeddings))
    np.testing.assert_array_equal(
        np.asarray(enc.pos_embeds(as_pt["image_grid_thw"])),
        np.asarray(enc.pos_embeds(as_np["image_grid_thw"])),
    )


# --- sharding over the 8 simulated CPU devices ---


def _mesh(shape, names):
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return jax.sharding.Mesh(devices, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def test_data_parallel_pixels_with_replicated_weights(model, enc):
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = _mesh((8,), ("data",))
    graphdef, state = nnx.split(model)
    replicated = jax.device_put(state, NamedSharding(mesh, P()))
    dp = glm4v.Glm4vVisionEncoder(nnx.merge(graphdef, replicated))
    grid = [[1, 6, 6], [1, 4, 8], [2, 2, 4]]
    px = ref.pixels(grid, CFG, seed=9)
    pixels = jax.device_put(_padded(dp, px, grid), NamedSharding(mesh, P("data", None)))
    out = dp(pixels, grid)
    want = enc(px, grid)
    assert_close(np.asarray(out.embeddings), np.asarray(want.embeddings), rtol=1e-5, atol=1e-6)
    assert out.embeddings.sharding.device_set == set(mesh.devices.flat)
    # pixels away from the weights: a clear error, not XLA's "incompatible devices"
    with pytest.raises(ValueError, match="same devices"):
        dp(jax.device_put(_padded(dp, px, grid), jax.devices()[0]), grid)


@requires_torch
def test_model_sharded_weights_equal_single_device(tmp_path):
    """`load_model(mesh=...)` places the tower's matmuls over a "model" axis by
    `PARTITION_RULES`; outputs equal the single-device ones (host and data-parallel inputs)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    fields = {**ref.TINY, "out_hidden_size": 32, "intermediate_size": 40}  # split by 4
    ckpt = ref.save_checkpoint(
        ref.build_reference(ref.hf_config(**fields)), tmp_path / "m.safetensors"
    )
    cfg = glm4v.Glm4vVisionConfig(**fields)
    mesh = _mesh((2, 4), ("data", "model"))
    sharded = glm4v.load_model(ckpt, cfg, mesh=mesh)
    # stacked [L, ...]: the rules' axes describe one layer, the layer axis stays unsharded
    qkv = sharded.blocks.layer.attn.qkv.kernel[...]
    assert qkv.sharding.spec == P(None, None, "model") and not qkv.sharding.is_fully_replicated
    down = sharded.blocks.layer.mlp.down_proj.kernel[...]
    assert down.sharding.spec == P(None, "model", None)
    assert sharded.blocks.layer.attn.qkv.bias[...].sharding.spec == P(None, "model")
    assert sharded.post_layernorm.weight[...].sharding.is_fully_replicated
    single = glm4v.Glm4vVisionEncoder(glm4v.load_model(ckpt, cfg))
    enc = glm4v.Glm4vVisionEncoder(sharded)
    grid = [[1, 6, 6], [1, 10, 6], [2, 4, 4]]
    px = ref.pixels(grid, cfg, seed=2)
    want = np.asarray(single(px, grid).embeddings)
    assert_close(np.asarray(enc(px, grid).embeddings), want, rtol=1e-5, atol=1e-6)
    dp = jax.device_put(_padded(enc, px, grid), NamedSharding(mesh, P("data", None)))
    assert_close(np.asarray(enc(dp, grid).embeddings), want, rtol=1e-5, atol=1e-6)
