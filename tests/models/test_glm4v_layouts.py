"""GLM-4.1V attention layouts: each image attends only to itself, as a dense segment mask,
as batched segment groups, or as cuDNN's ragged segments; what "auto" resolves to; how many
programs each compiles; and the GPU kernels against the XLA form."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsync
from jaxsync.harness.paths.glm4v import reference as ref
from jaxsync.models import glm4v
from jaxsync.testing import rel_err


CFG = glm4v.Glm4vVisionConfig(**ref.TINY)


@pytest.fixture(scope="module")
def model():
    return glm4v.Glm4vVisionTower(CFG, rngs=nnx.Rngs(0))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["dense", "segments", "ragged"])
def test_cudnn_attention_matches_xla(layout):
    """The GPU flash-attention path (segment mask through cuDNN) against the XLA form, bf16.

    Tolerance 2e-2: the two differ only in bf16 rounding of the attention (cuDNN keeps the
    probabilities in registers; XLA rounds them to bf16 before the value product).
    """
    if jax.default_backend() not in ("gpu", "cuda"):
        pytest.skip("cuDNN attention needs a GPU")
    cfg = glm4v.Glm4vVisionConfig(**{**ref.TINY, "hidden_size": 64, "num_heads": 4})  # H = 16
    grid = [[2, 6, 4], [1, 8, 8], [1, 2, 12]]
    px = ref.pixels(grid, cfg, seed=3)
    outs = []
    for impl in ("xla", "cudnn"):
        model = glm4v.Glm4vVisionTower(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), attention=impl)
        assert model.blocks.at(0).attn.impl == impl
        out = glm4v.Glm4vVisionEncoder(model, layout=layout)(px, grid)
        assert np.asarray(out.extras["finite"])[: len(grid)].all()
        outs.append(np.asarray(out.embeddings, np.float32)[: out.num_tokens])
    assert rel_err(outs[1], outs[0]) <= 2e-2


# --- segment-aware attention: work grows with the sum of per-image squares ---

MIXED_SIZES = [[1, 8, 8], [1, 12, 6], [1, 4, 10], [1, 6, 6]]  # 64, 72, 40, 36 patches


def _flops(model, layout: str, grid) -> float:
    """XLA's flop count of one block over the batch in `layout` (the blocks run as one scan,
    whose body XLA's cost analysis counts once; the layout changes only the blocks' work)."""
    from jaxsync.models.glm4v._attention import rotary_cos_sin
    from jaxsync.models.glm4v._modules import _segments

    plan = glm4v.plan(grid, CFG, layout=layout)
    graphdef, state = nnx.split(model.blocks.at(0))

    def block(state, x, meta):
        cos, sin = rotary_cos_sin(meta.h, meta.w, CFG.head_dim, CFG.rope_theta)
        return nnx.merge(graphdef, state)(x, cos, sin, _segments(meta))

    x = jax.ShapeDtypeStruct((plan.padded_patches, CFG.hidden_size), jnp.float32)
    lowered = jax.jit(block).lower(state, x, jaxsync.upload_packed(plan))
    cost = lowered.compile().cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def test_segments_layout_scales_with_per_image_squares(model):
    """XLA's own flop count of a block for 1, 4 and 16 images of mixed sizes: the dense
    [P, P] mask grows ~quadratically in the image count, the segments layout ~linearly."""
    dense, segments = {}, {}
    for n in (1, 4, 16):
        grid = [MIXED_SIZES[i % 4] for i in range(n)]
        dense[n], segments[n] = _flops(model, "dense", grid), _flops(model, "segments", grid)
    assert segments[1] <= 1.05 * dense[1]  # one image: the same work
    assert dense[16] / dense[4] > 8  # quadratic (16x for 4x the images, plus linear terms)
    assert segments[16] / segments[4] < 5  # linear: 4x the images, ~4x the work
    assert segments[16] < dense[16] / 4


def test_segments_layout_never_recompiles_a_repeated_mix(model):
    from jaxsync.check import no_recompile

    enc = glm4v.Glm4vVisionEncoder(model, layout="segments")
    grid = [MIXED_SIZES[i % 4] for i in range(6)]
    same_mix = [[1, 8, 8], [1, 6, 12], [1, 10, 4], [1, 6, 6], [1, 8, 8], [1, 12, 6]]
    px = ref.pixels(grid, CFG, seed=1)
    enc(px, grid)
    with no_recompile():
        out = enc(ref.pixels(same_mix, CFG, seed=2), same_mix)
    assert out.lengths == tuple(t * h * w // 4 for t, h, w in same_mix)


def test_ragged_plan_lists_every_segment_once():
    # A video of 3 frames, two images and the bucket's padding: 6 segments covering every row.
    grid = [[3, 4, 4], [1, 8, 6], [1, 2, 2]]
    plan = glm4v.plan(grid, CFG, layout="ragged")
    lengths, offsets = plan.meta.seq_lengths, plan.meta.seq_offsets
    real = [16, 16, 16, 48, 4]
    pad = plan.padded_patches - sum(real)
    assert pad > 0
    np.testing.assert_array_equal(lengths, [*real, pad, -1, -1])  # 8 slots
    np.testing.assert_array_equal(offsets, [0, 16, 32, 48, 96, 100, plan.padded_patches, -1, -1])
    assert lengths.dtype == offsets.dtype == np.int32
    # each run of the dense layout's segment ids is one ragged segment
    seg = plan.meta.seg
    for first, n in zip(offsets[:6], lengths[:6], strict=True):
        assert len(set(seg[first : first + n])) == 1 and (
            first == 0 or seg[first - 1] != seg[first]
        )
    # nine images: the next slot bucket (64)
    nine = glm4v.plan([[1, 2, 2]] * 9, CFG, layout="ragged")
    assert nine.meta.seq_lengths.shape == (64,) and nine.meta.seq_offsets.shape == (65,)
    assert glm4v.plan(grid, CFG).meta.seq_lengths.shape == (0,)  # control: dense plans none


@pytest.mark.parametrize("grid", [MIXED_SIZES, [[3, 4, 4], [1, 8, 6]], [[1, 8, 8]]])
def test_ragged_layout_off_cudnn_is_the_dense_result(model, grid):
    # Without cuDNN attention the ragged segments run as the dense mask: bit-identical.
    ragged = glm4v.Glm4vVisionEncoder(model, layout="ragged")
    dense = glm4v.Glm4vVisionEncoder(model, layout="dense")
    assert ragged.layout == "ragged" and ragged.plan(grid).meta.seq_lengths.size
    px = ref.pixels(grid, CFG, seed=3)
    a, b = ragged(px, grid), dense(px, grid)
    np.testing.assert_array_equal(np.asarray(a.embeddings), np.asarray(b.embeddings))
    np.testing.assert_array_equal(np.asarray(a.extras["hidden"]), np.asarray(b.extras["hidden"]))


def test_ragged_layout_compiles_once_per_bucket_not_per_mix(model):
    from jaxsync.check import RecompileError, no_recompile

    enc = glm4v.Glm4vVisionEncoder(model, layout="ragged")
    first = [MIXED_SIZES[i % 4] for i in range(5)]
    other_mix = [[1, 10, 10], [2, 4, 6], [1, 6, 4], [1, 8, 12]]  # other sizes, a video
    assert enc.plan(first).padded_patches == enc.plan(other_mix).padded_patches
    enc(ref.pixels(first, CFG, seed=1), first)
    with no_recompile():
        out = enc(ref.pixels(other_mix, CFG, seed=2), other_mix)
    assert out.lengths == tuple(t * h * w // 4 for t, h, w in other_mix)
    # control: a new slot bucket (more than 8 segments) is a new program
    many = [[1, 2, 2]] * 9 + [[1, 8, 8]] * 4
    assert enc.plan(many).padded_patches == enc.plan(first).padded_patches
    with pytest.raises(RecompileError), no_recompile():
        enc(ref.pixels(many, CFG, seed=3), many)


def test_auto_layout_is_ragged_with_cudnn_attention_else_dense(model, monkeypatch):
    from jaxsync import _compat

    assert glm4v.Glm4vVisionEncoder(model).layout == "dense"  # XLA attention (CPU)
    assert glm4v.resolve_layout("auto", "cudnn") == "ragged"
    assert glm4v.resolve_layout("auto", "xla") == "dense"
    assert glm4v.resolve_layout("segments", "cudnn") == "segments"
    # a server's own plan from the tower's cfg resolves "auto" as the tower's encoder does
    cudnn = glm4v.Glm4vVisionTower(CFG, rngs=nnx.Rngs(0), attention="cudnn")  # built, never run
    assert cudnn.cfg.attention == "cudnn" and model.cfg.attention == "xla"
    assert glm4v.Glm4vVisionEncoder(cudnn).layout == "ragged"
    auto = glm4v.plan(MIXED_SIZES, cudnn.cfg)
    ragged = glm4v.plan(MIXED_SIZES, CFG, layout="ragged")
    assert auto.layout == "ragged"
    assert jax.tree.map(np.shape, auto.meta) == jax.tree.map(np.shape, ragged.meta)
    assert glm4v.plan(MIXED_SIZES, model.cfg).layout == "dense"
    assert glm4v.plan(MIXED_SIZES, CFG).layout == "dense"  # a bare config: XLA attention
    # a tower over several devices keeps the dense mask under "auto"; asked for, ragged it is
    assert glm4v.resolve_layout("auto", "cudnn", devices=8) == "dense"
    assert glm4v.plan(MIXED_SIZES, cudnn.cfg, devices=8).layout == "dense"
    from jax.sharding import NamedSharding, PartitionSpec as P

    graphdef, state = nnx.split(cudnn)
    everywhere = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()), ("d",)), P())
    spread = nnx.merge(graphdef, jax.device_put(state, everywhere))
    assert glm4v.Glm4vVisionEncoder(spread).layout == "dense"
    assert glm4v.Glm4vVisionEncoder(spread, layout="ragged").layout == "ragged"
    # a jax without the ragged kernel: auto keeps the dense mask
    monkeypatch.setattr(_compat, "ragged_attention_available", lambda: False)
    assert glm4v.resolve_layout("auto", "cudnn") == "dense"
    assert glm4v.plan(MIXED_SIZES, cudnn.cfg).layout == "dense"
    with pytest.raises(ValueError, match="'auto'"):
        glm4v.Glm4vVisionEncoder(model, layout="sparse")
    with pytest.raises(ValueError, match="layout must be one of"):
        glm4v.plan([[1, 4, 4]], CFG, layout="sparse")


def test_ragged_plan_refuses_more_segments_than_its_largest_slot_bucket():
    from jaxsync.models.glm4v._segments import RAGGED_SLOTS, ragged_segments

    most = RAGGED_SLOTS[-1]
    assert ragged_segments(np.arange(most, dtype=np.int32))[0].shape == (most,)
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        ragged_segments(np.arange(most + 1, dtype=np.int32))
