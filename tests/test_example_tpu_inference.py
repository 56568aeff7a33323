"""examples/tpu_inference_style.py: the runner's flat state leaves, `run_embed_multimodal(
state_leaves, modality=None, **kwargs)` rebuilding the module per call, one `[tokens_i, D]`
array per image, and a jitted merge at the placeholder positions."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from jaxsync.testing import requires_torch


def _load():
    path = Path(__file__).resolve().parents[1] / "examples" / "tpu_inference_style.py"
    spec = importlib.util.spec_from_file_location("tpu_inference_style", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@requires_torch
def test_example_runs_sync_free_without_recompiles(capsys):
    _load().main()  # asserts parity with the entry, the merge, 0 compiles, 0 reads, updates seen
    out = capsys.readouterr().out
    assert "0 compiles and 0 host reads" in out
    assert "merged into a 64-token prompt" in out


@pytest.mark.parametrize(
    "grid",
    [
        np.array([[1, 4, 6], [2, 2, 2]]),  # the processor's [N, 3]
        np.array([[[1, 4, 6], [2, 2, 2]]]),  # a batch of them, [B, N, 3]
        ((1, 4, 6), (2, 2, 2)),  # already a tuple of int tuples
        [[np.int64(1), 4, 6], [2, 2, 2]],
    ],
    ids=["rows", "batched", "tuples", "lists"],
)
def test_grid_fields_become_int_tuples(grid):
    rows = _load()._grid_rows(grid)
    assert rows == ((1, 4, 6), (2, 2, 2))
    assert all(type(v) is int for row in rows for v in row)  # hashable plan-cache keys


def _patched(monkeypatch, after):
    """The example with `embed_multimodal`'s result passed through `after` before it returns."""
    example = _load()
    original = example.Glm4vMultimodal.embed_multimodal

    def embed_multimodal(self, *args, **kwargs):
        return after(original(self, *args, **kwargs))

    monkeypatch.setattr(example.Glm4vMultimodal, "embed_multimodal", embed_multimodal)
    return example


@requires_torch
def test_example_would_catch_a_read_back(monkeypatch):
    # Negative control: a model class that reads its embeddings back is caught by the guard.
    from jaxsync.check import SyncError

    def reads_back(out):
        np.asarray(out[0])  # a device->host read
        return out

    with pytest.raises(SyncError):
        _patched(monkeypatch, reads_back).main()


@requires_torch
def test_the_runner_refuses_one_concatenated_array(monkeypatch):
    # Negative control: all images' rows as one [N, D] array (sglang-jax's encoder form) fail
    # the runner's count check: tpu-inference caches one array per item.
    import jax.numpy as jnp

    with pytest.raises(AssertionError, match=r"\(\d+, 3\)"):
        _patched(monkeypatch, jnp.concatenate).main()


@requires_torch
def test_example_would_catch_rows_in_another_dtype(monkeypatch):
    # Negative control: bfloat16 rows merged into float32 text embeddings are refused (the
    # merge's `where` would promote them).
    import jax.numpy as jnp

    with pytest.raises(AssertionError):
        _patched(monkeypatch, lambda out: tuple(e.astype(jnp.bfloat16) for e in out)).main()


@requires_torch
def test_example_would_catch_a_misplaced_merge(monkeypatch):
    # Negative control: a merge whose k-th placeholder takes row k + 1 fails the prompt check.
    import jax.numpy as jnp

    example = _load()

    def shifted(self, input_ids, mm_embeds, *, is_multimodal):
        rows = jnp.concatenate([mm_embeds, mm_embeds[:1]])  # no dummy row: row k + 1 at k
        taken = rows[jnp.cumsum(is_multimodal)]
        return jnp.where(is_multimodal[:, None], taken, self.embed_tokens(input_ids))

    monkeypatch.setattr(example.Glm4vMultimodal, "embed_input_ids", shifted)
    with pytest.raises(AssertionError):
        example.main()


def test_embed_multimodal_takes_the_earlier_call_too():
    # Earlier runners normalized the grid and passed it first (`run_embed_multimodal(graphdef,
    # state, image_grid_thw, **kwargs)`); 0.32 passes the processor's fields by keyword.
    import jax
    from flax import nnx

    from jaxsync.models import glm4v

    example = _load()
    cfg = glm4v.Glm4vVisionConfig(
        depth=1, hidden_size=16, num_heads=2, image_size=28, patch_size=7,
        temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=8, intermediate_size=12,
    )  # fmt: skip
    model = example.Glm4vMultimodal(cfg, rngs=nnx.Rngs(0))
    grid = np.array([[1, 2, 4], [1, 2, 2]])
    px = np.random.default_rng(0).standard_normal((12, cfg.patch_dim), np.float32)
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    now = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves)).embed_multimodal(
        pixel_values=px, image_grid_thw=grid
    )
    earlier = nnx.merge(graphdef, state).get_multimodal_embeddings(
        ((1, 2, 4), (1, 2, 2)), pixel_values=px
    )
    assert [e.shape for e in now] == [(2, 8), (1, 8)]
    for a, b in zip(now, earlier, strict=True):
        np.testing.assert_array_equal(a, b)
