"""Hostile inputs to every GLM-4.1V entry point: a typed error naming the problem, raised on the
host before any upload or compile, inputs untouched; or a correct result. One poisoned image
among good ones lives in test_glm4v_poisoned.py."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsync
import jaxsync.testing
from jaxsync.check import count_compiles
from jaxsync.harness.paths.glm4v import reference as ref
from jaxsync.models import glm4v
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
    # the blocks are stacked: the error names the stacked parameter and the missing layer
    with pytest.raises(WeightError, match=r"blocks\.layer\.attn\.qkv\.bias.*layers \[1\]"):
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


# --- non-finite host data: refused before any upload or compile, inputs untouched ---


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_host_pixels_refused(enc, bad, monkeypatch):
    grid = [[1, 6, 6]]
    px = ref.pixels(grid, CFG, seed=1)
    px[3, 2] = bad
    before = px.copy()
    puts = _count_puts(monkeypatch)
    with (
        count_compiles() as log,
        pytest.raises(ValueError, match="pixel_values holds a non-finite"),
    ):
        enc(px, grid)
    assert log.count == 0 and puts == []
    np.testing.assert_array_equal(px, before)


# --- metadata: typed errors before any upload or compile, inputs untouched ---


def _count_puts(monkeypatch) -> list:
    return jaxsync.testing.watch_uploads(monkeypatch)


@pytest.mark.parametrize(
    "grid, error, match",
    [
        ([[1, 2.9, 4.2]], TypeError, "grid_thw must hold integers"),
        ([[1.0, 6.0, 6.0]], TypeError, "grid_thw must hold integers"),
        (np.array([[1, 6, 6]], np.float32), TypeError, "grid_thw must hold integers"),
        ([[True, 6, 6]], TypeError, "grid_thw must hold integers"),
        (np.ones((1, 3), bool), TypeError, "grid_thw must hold integers"),
        ([[1, 6, 6], [1, 2]], ValueError, "ragged"),
        ([["1", "6", "6"]], TypeError, "integers"),
        ([[1, -6, 6]], ValueError, ">= 1"),
        ([[1, 6, 6, 1]], ValueError, r"shape \[B, 3\]"),
        ([1, 6, 6], ValueError, r"shape \[B, 3\]"),
    ],
)
def test_bad_grid_types(enc, grid, error, match, monkeypatch):
    px = np.zeros((36, CFG.patch_dim), np.float32)
    puts = _count_puts(monkeypatch)
    with count_compiles() as log, pytest.raises(error, match=match):
        enc(px, grid)
    with pytest.raises(error, match=match):
        enc.pos_embeds(grid)
    assert log.count == 0 and puts == []
    assert not px.any()


@pytest.mark.parametrize(
    "pixels, error, match",
    [
        (np.zeros((36,), np.float32), ValueError, r"pixel_values must be \[P, 294\]"),
        (np.zeros((36, 294, 1), np.float32), ValueError, r"pixel_values must be \[P, 294\]"),
        (np.zeros((36, 294), np.int32), TypeError, "floating point"),
        (np.zeros((36, 294), bool), TypeError, "floating point"),
        ([[0.0] * 294] * 35 + [[0.0] * 293], ValueError, "ragged"),
        (np.zeros((36, 294), object), TypeError, "numeric"),
    ],
)
def test_bad_pixel_values(enc, pixels, error, match, monkeypatch):
    puts = _count_puts(monkeypatch)
    with count_compiles() as log, pytest.raises(error, match=match):
        enc(pixels, [[1, 6, 6]])
    assert log.count == 0 and puts == []


def test_device_inputs_misplaced_deleted_or_device_grid(enc):
    import jax

    grid = [[1, 6, 6]]
    plan = enc.plan(grid)
    host = np.zeros((plan.padded_patches, CFG.patch_dim), np.float32)
    with pytest.raises(TypeError, match="image_grid_thw|grid_thw must be host data"):
        enc(host, jaxsync.async_h2d(np.array(grid)))
    other = jax.device_put(host, jax.devices()[1])
    with count_compiles() as log, pytest.raises(ValueError, match="same devices"):
        enc(other, grid)
    assert log.count == 0
    gone = jax.device_put(host)
    gone.delete()
    with pytest.raises(ValueError, match="deleted"):
        enc(gone, grid)


def test_torch_tensors_off_cpu_and_bad_buckets():
    tower = glm4v.Glm4vVisionTower(CFG, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="buckets.tokens must be an int"):
        glm4v.Glm4vVisionEncoder(tower, buckets=glm4v.Glm4vBuckets(tokens=(8, 16.0)))
    with pytest.raises(TypeError, match="buckets.items must be an int"):
        glm4v.plan([[1, 6, 6]], CFG, buckets=glm4v.Glm4vBuckets(items=(4, True)))
    with pytest.raises(TypeError, match="Glm4vBuckets"):
        glm4v.Glm4vVisionEncoder(tower, buckets=[8, 16])
    with pytest.raises(TypeError, match="Glm4vVisionTower"):
        glm4v.Glm4vVisionEncoder(object())


# --- configs ---


@pytest.mark.parametrize(
    "fields, error, match",
    [
        ({"depth": True}, TypeError, "depth must be an int"),
        ({"depth": 2.0}, TypeError, "depth must be an int"),
        ({"num_heads": np.float32(4)}, TypeError, "num_heads must be an int"),
        ({"depth": 0}, ValueError, "depth must be >= 1"),
        ({"hidden_size": 30, "num_heads": 3}, ValueError, "multiple of 4"),
        ({"hidden_act": "mish"}, ValueError, "hidden_act"),
        ({"attention_bias": 1}, TypeError, "attention_bias"),
    ],
)
def test_bad_config_fields(fields, error, match):
    with pytest.raises(error, match=match):
        glm4v.Glm4vVisionConfig(**{**ref.TINY, **fields})
    src = {**ref.TINY, **fields}
    with pytest.raises(error, match=match):
        glm4v.Glm4vVisionConfig.from_hf_config(src)


def test_bad_config_sources(tmp_path):
    with pytest.raises(ValueError, match="window_size"):
        glm4v.Glm4vVisionConfig.from_hf_config({**ref.TINY, "window_size": 7})
    rope = {"rope_type": "axial", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(ValueError, match="axial"):
        glm4v.Glm4vVisionConfig.from_hf_config({**ref.TINY, "rope_parameters": rope})
    with pytest.raises(ValueError, match="square pair"):
        glm4v.Glm4vVisionConfig.from_hf_config({**ref.TINY, "image_size": [42, 28]})
    with pytest.raises(TypeError, match="expected an HF config"):
        glm4v.Glm4vVisionConfig.from_hf_config(42)
    with pytest.raises(FileNotFoundError):
        glm4v.Glm4vVisionConfig.from_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError):
        glm4v.Glm4vVisionConfig.from_hf_config(tmp_path)


@requires_torch
def test_corrupt_and_mismatched_checkpoints(tmp_path):
    hf = ref.hf_config(**ref.TINY)
    path = ref.save_checkpoint(ref.build_reference(hf), tmp_path / "m.safetensors")
    wider = glm4v.Glm4vVisionConfig(**{**ref.TINY, "hidden_size": 64})
    with pytest.raises(WeightError, match="shape"):
        glm4v.load_model(path, wider)
    data = Path(path).read_bytes()
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "m.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightError):
        glm4v.load_model(tmp_path / "cut" / "m.safetensors", CFG)
    with pytest.raises(TypeError, match="cfg must be"):
        glm4v.load_model(path, dict(ref.TINY))


# --- structured inputs: hypothesis over grids; the result equals a per-image run ---

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies


@hypothesis.settings(max_examples=12, deadline=None)
@hypothesis.given(
    st.lists(
        st.tuples(st.integers(1, 2), st.integers(1, 4), st.integers(1, 4)), min_size=1, max_size=3
    )
)
def test_batch_equals_each_image_alone(enc, blocks):
    """Any valid batch: every item's tokens equal that item encoded alone (no cross-item term),
    within fp32 reduction-order noise."""
    grid = [[t, 2 * h, 2 * w] for t, h, w in blocks]
    px = ref.pixels(grid, CFG, seed=len(grid))
    out = enc(px, grid)
    start = 0
    for (t, h, w), part in zip(grid, out.split(), strict=True):
        n = t * h * w
        alone = enc(px[start : start + n], [[t, h, w]])
        np.testing.assert_allclose(
            np.asarray(part), np.asarray(alone.embeddings)[: n // 4], rtol=2e-5, atol=2e-5
        )
        start += n
