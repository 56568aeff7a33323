"""Hostile inputs to every GLM-4.1V entry point: a typed error naming the problem, raised on the
host before any upload or compile, inputs untouched; or a correct result."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsync
from jaxsync.check import count_compiles
from jaxsync.models import glm4v
from jaxsync.paths.glm4v import reference as ref
from jaxsync.testing import requires_torch
from jaxsync.weights import WeightError


CFG = glm4v.Glm4vVisionConfig(**ref.TINY)


@pytest.fixture(scope="module")
def enc():
    return glm4v.Glm4vVisionEncoder(glm4v.Glm4vVisionTower(CFG, rngs=nnx.Rngs(0)))


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
def test_bad_grid_fails_on_the_host(enc, grid, rows, match):
    px = np.zeros((rows, CFG.patch_dim), np.float32)
    with count_compiles() as log, pytest.raises(ValueError, match=match):
        enc(px, grid)
    assert log.count == 0  # rejected before anything was traced or dispatched


def test_bad_pixels_and_device_grid(enc):
    with pytest.raises(ValueError, match=r"pixel_values must be \[P, 294\]"):
        enc(np.zeros((36, 17), np.float32), [[1, 6, 6]])
    with pytest.raises(TypeError, match="host data"):
        enc.pos_embeds(jaxsync.async_h2d(np.array([[1, 6, 6]])))


@requires_torch
def test_weight_errors_name_the_key(tmp_path):
    import torch

    hf = ref.hf_config(**ref.TINY)
    model = ref.build_reference(hf)
    state = {f"model.visual.{k}": v for k, v in model.state_dict().items()}
    del state["model.visual.blocks.1.attn.qkv.bias"]
    path = jaxsync.testing.save_torch_state(state, tmp_path / "missing.safetensors")
    with pytest.raises(WeightError, match=r"blocks\.1\.attn\.qkv\.bias"):
        glm4v.load_model(path, CFG)
    state["model.visual.blocks.1.attn.qkv.bias"] = torch.zeros(144)
    state["model.visual.blocks.0.attn.rope_scale"] = torch.zeros(3)
    path = jaxsync.testing.save_torch_state(state, tmp_path / "extra.safetensors")
    with pytest.raises(WeightError, match="rope_scale"):
        glm4v.load_model(path, CFG)
    # dtype=None keeps the checkpoint's dtype; an explicit dtype casts
    ok = ref.save_checkpoint(model, tmp_path / "ok.safetensors")
    assert glm4v.load_model(ok, CFG).dtype == jnp.float32
    assert glm4v.load_model(ok, CFG, dtype=jnp.bfloat16).dtype == jnp.bfloat16
