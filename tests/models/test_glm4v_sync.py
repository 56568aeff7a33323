"""GLM-4.1V vision paths: sync-freedom, buckets without recompiles, bad input, weights, registry."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsync
from jaxsync.check import assert_sync_free, count_compiles
from jaxsync.models import glm4v
from jaxsync.models.glm4v import _reference as ref
from jaxsync.models.glm4v._verify import VERIFY_GRIDS
from jaxsync.testing import requires_torch
from jaxsync.weights import WeightError


CFG = glm4v.Glm4vVisionConfig(**ref.TINY)  # the same tiny odd-sized tower as the parity tests


@pytest.fixture(scope="module")
def enc():
    return glm4v.Glm4vVisionEncoder(glm4v.Glm4vVisionModel(CFG, rngs=nnx.Rngs(0)))


def _inputs():
    return [(ref.pixels(g, CFG, seed=i), g) for i, g in enumerate(VERIFY_GRIDS)]


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
    padded = []
    for px, g in _inputs()[:3]:
        host = np.zeros((enc.plan(g).padded_patches, CFG.patch_dim), np.float32)
        host[: px.shape[0]] = px
        padded.append((jaxsync.async_h2d(host), g))
    assert_sync_free(enc, *padded[0], inputs=padded[1:])


def test_one_upload_per_call(enc, monkeypatch):
    """Everything derived from grid_thw moves in one packed transfer (pixels are the other)."""
    calls = []
    real = jaxsync.upload_packed
    monkeypatch.setattr(jaxsync, "upload_packed", lambda f, **k: calls.append(f) or real(f, **k))
    px, g = _inputs()[-1]
    enc(px, g)
    assert len(calls) == 1 and set(calls[0]) == {"h", "w", "th", "tw", "seg"}


@pytest.mark.parametrize(
    "grid, rows, match",
    [
        ([[1, 5, 6]], 30, "multiples of spatial_merge_size"),
        ([[2, 6, 3]], 36, "multiples of spatial_merge_size"),
        ([], 0, "empty batch"),
        ([[1, 6, 6]], 35, "describes 36 patches but the pixel array has 35"),
        ([[1, 6, 6], [1, 2, 2]], 36, "describes 40 patches"),
        ([[0, 6, 6]], 0, ">= 1"),
        ([[6, 6]], 36, r"shape \[B, 3\]"),
    ],
)
def test_bad_input_fails_on_the_host(enc, grid, rows, match):
    px = np.zeros((rows, CFG.patch_dim), np.float32)
    with count_compiles() as log, pytest.raises(ValueError, match=match):
        enc(px, grid)
    assert log.count == 0  # rejected before anything was traced or dispatched


def test_bad_pixels_and_device_grid(enc):
    with pytest.raises(ValueError, match=r"pixels must be \[P, 294\]"):
        enc(np.zeros((36, 17), np.float32), [[1, 6, 6]])
    with pytest.raises(TypeError, match="host data"):
        enc.pos_embeds(jaxsync.async_h2d(np.array([[1, 6, 6]])))


def test_plan_layout():
    plan = glm4v.plan_batch([[2, 2, 4], [1, 2, 2]], CFG)
    assert (plan.num_patches, plan.padded_patches, plan.tokens_per_item) == (20, 32, (4, 1))
    f = plan.fields
    # merge-block order: block-row, block-col, inner-row, inner-col; both frames identical
    np.testing.assert_array_equal(f["h"][:16], [0, 0, 1, 1, 0, 0, 1, 1] * 2)
    np.testing.assert_array_equal(f["w"][:16], [0, 1, 0, 1, 2, 3, 2, 3] * 2)
    np.testing.assert_array_equal(f["seg"], [0] * 8 + [1] * 8 + [2] * 4 + [3] * 12)
    np.testing.assert_array_equal(f["tw"][:20], [4] * 16 + [2] * 4)


@requires_torch
def test_weight_errors_name_the_key(tmp_path):
    import torch

    hf = ref.hf_config(**ref.TINY)
    model = ref.build_reference(hf)
    state = {f"model.visual.{k}": v for k, v in model.state_dict().items()}
    del state["model.visual.blocks.1.attn.qkv.bias"]
    path = jaxsync.testing.save_torch_state(state, tmp_path / "missing.safetensors")
    with pytest.raises(WeightError, match=r"blocks\.1\.attn\.qkv\.bias"):
        glm4v.load_vision_model(path, CFG)
    state["model.visual.blocks.1.attn.qkv.bias"] = torch.zeros(144)
    state["model.visual.blocks.0.attn.rope_scale"] = torch.zeros(3)
    path = jaxsync.testing.save_torch_state(state, tmp_path / "extra.safetensors")
    with pytest.raises(WeightError, match="rope_scale"):
        glm4v.load_vision_model(path, CFG)
    with pytest.raises(WeightError, match="dtype"):  # bf16 tower from an fp32 file needs a cast
        ok = ref.save_checkpoint(model, tmp_path / "ok.safetensors")
        glm4v.load_vision_model(ok, CFG, dtype=jnp.bfloat16)


def test_released_config_shapes():
    """The released tower (depth 24, hidden 1536) built abstractly: nothing is allocated."""
    model = nnx.eval_shape(
        lambda: glm4v.Glm4vVisionModel(glm4v.Glm4vVisionConfig(), rngs=nnx.Rngs(0))
    )
    assert model.embeddings.position_embedding.shape == (576, 1536)
    assert model.patch_embed.proj.kernel.shape == (3 * 2 * 14 * 14, 1536)
    assert model.downsample.kernel.shape == (4 * 1536, 4096)
    assert len(model.blocks) == 24 and model.blocks[0].mlp.gate_proj.kernel.shape == (1536, 4096)


@requires_torch
def test_registered_for_verify():
    from jaxsync import registry

    names = {s.name for s in registry.paths(["glm4v"])}
    assert names == {"glm4v.vision_tower", "glm4v.pos_embeds"}
    for spec in registry.paths(["glm4v"]):
        case = spec.build(None)
        assert len(case.inputs) >= 2
        parity = case.parity()
        assert parity.ok, (spec.name, str(parity))
