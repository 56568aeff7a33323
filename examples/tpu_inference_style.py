"""A tpu-inference-style model class around jaxsync's GLM-4.1V vision tower.

tpu-inference builds a model under `nnx.eval_shape`, fills it with `load_weights`, splits it once
into `graphdef` and a state that its runner keeps as a flat tuple of leaves, and runs the
encoder through `run_embed_multimodal(state_leaves, modality=None, **kwargs)`: a plain Python
function that rebuilds the module from the leaves and calls `embed_multimodal(**kwargs)` with the
processor's fields (`pixel_values`, `image_grid_thw`). The model returns one `[tokens_i, D]`
array per image; the runner checks the count and rank, caches each array per item, and merges
the cached rows into the text embeddings of a step in a jitted `embed_input_ids` (the k-th
placeholder position takes row k). This example does exactly that, with a tiny random GLM-4.1V
tower saved as a sharded checkpoint next to a large unrelated "language model" shard the loader
never opens, and checks:

- the embeddings equal `Glm4vVisionEncoder`'s, and the merged prompt holds them at its
  placeholder positions and the text rows elsewhere;
- after one warm-up step, further steps compile nothing and read nothing back;
- a weight update through the runner's state leaves is seen by the next call.

  python examples/tpu_inference_style.py
"""

from __future__ import annotations

import functools
import json
import pathlib
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

import jaxsync
from jaxsync.check import no_recompile, sync_guard
from jaxsync.models import glm4v


VOCAB = 61
IMAGE_TOKEN_ID = 7  # the prompt's image placeholder id


class Glm4vMultimodal(nnx.Module):
    """The part of a server's GLM-4.1V model class that embeds images and merges them."""

    def __init__(self, cfg: glm4v.Glm4vVisionConfig, *, rngs: nnx.Rngs):
        self.visual = glm4v.Glm4vVisionTower(cfg, rngs=rngs)
        self.embed_tokens = nnx.Embed(VOCAB, cfg.out_hidden_size, rngs=rngs)

    def load_weights(self, checkpoint: str) -> None:
        # Streams only `model.visual.*` from the sharded checkpoint, placing each as it is read.
        self.visual = glm4v.load_model(checkpoint, self.visual.cfg)
        # The language model's table stands in random here (the checkpoint has none).
        self.embed_tokens = nnx.Embed(VOCAB, self.visual.cfg.out_hidden_size, rngs=nnx.Rngs(1))

    def embed_multimodal(self, image_grid_thw, pixel_values, **_) -> tuple[jax.Array, ...]:
        """The processor's fields of one group of images -> one `[tokens_i, D]` array each.

        Called with keywords (`**kwargs` of the group) or, by earlier runners, with the
        normalized grid first: `embed_multimodal(image_grid_thw, pixel_values=...)`.
        """
        grid = _grid_rows(image_grid_thw)
        plan, meta = _planned(self.visual.cfg, grid)
        patches = np.asarray(pixel_values)  # [P, C*T*p*p], or a batch of them
        patches = patches.reshape(-1, patches.shape[-1])
        host = np.zeros((plan.padded_patches, patches.shape[1]), np.float32)
        host[: plan.num_patches] = patches  # padding patches are zeros
        pixels = jaxsync.async_h2d(host, copy=False)
        graphdef, state = nnx.split(self.visual)
        leaves, treedef = jax.tree.flatten(state)
        out = jaxsync.Embeddings.of(_encode(graphdef, treedef, leaves, pixels, meta), plan)
        return tuple(out.split())  # static slices at host offsets: nothing is read back

    get_multimodal_embeddings = embed_multimodal  # the name earlier releases call

    def embed_input_ids(self, input_ids, mm_embeds, *, is_multimodal):
        """Text embeddings with the k-th position of `is_multimodal` replaced by row k."""
        text = self.embed_tokens(input_ids)
        rows = jnp.concatenate([jnp.zeros_like(mm_embeds[:1]), mm_embeds])  # row 0: a dummy
        taken = rows[jnp.cumsum(is_multimodal)]  # position -> its placeholder's row (else 0)
        return jnp.where(is_multimodal[:, None], taken, text)


def _grid_rows(image_grid_thw) -> tuple[tuple[int, int, int], ...]:
    """`[N, 3]` (or `[B, N, 3]`) grid rows, from the processor's array or tuples, as int tuples."""
    return tuple(tuple(int(v) for v in row) for row in np.asarray(image_grid_thw).reshape(-1, 3))


_plans: jaxsync.PlanCache = jaxsync.PlanCache()


def _planned(cfg: glm4v.Glm4vVisionConfig, grid: tuple[tuple[int, int, int], ...]):
    """The host plan and its one packed upload, cached per grid mix."""

    def build():
        plan = glm4v.plan(grid, cfg)  # `tower.cfg`: the layout its encoder would run
        return plan, jaxsync.upload_packed(plan)

    return _plans.get(grid, build)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _encode(graphdef, treedef, leaves, pixels, meta) -> jaxsync.Encoded:
    # The model's own jit over the tower's leaves: a new state needs no recompile, and the
    # programs are keyed by the plan's buckets, not by the grid.
    return glm4v.forward(nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves)), pixels, meta)


def sanity_check_mm_encoder_outputs(outputs, expected_num_items: int) -> None:
    """The runner's check of `embed_multimodal`'s result: one 2-D array per item."""
    assert isinstance(outputs, (list, tuple, jax.Array)), type(outputs)
    assert len(outputs) == expected_num_items, (len(outputs), expected_num_items)
    assert all(e.ndim == 2 for e in outputs), [e.shape for e in outputs]


def _sharded_checkpoint(folder: pathlib.Path) -> glm4v.Glm4vVisionConfig:
    """A tiny random tower in shard 1 of 2; shard 2 holds an unrelated 8 MiB tensor."""
    from jaxsync.harness.paths.glm4v import reference as ref

    hf_cfg = ref.hf_config(**ref.TINY)
    tower = ref.build_reference(hf_cfg)
    visual = {f"model.visual.{k}": v.numpy() for k, v in tower.state_dict().items()}
    save_file(visual, folder / "model-00001-of-00002.safetensors")
    other = {"lm_head.weight": np.zeros((2048, 1024), np.float32)}
    save_file(other, folder / "model-00002-of-00002.safetensors")
    weight_map = {k: "model-00001-of-00002.safetensors" for k in visual}
    weight_map |= {k: "model-00002-of-00002.safetensors" for k in other}
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return glm4v.Glm4vVisionConfig.from_hf_config(hf_cfg)


def _prompt(tokens_per_image, rng) -> np.ndarray:
    """Text with each image's placeholders between text, padded with id 0 to a multiple of 64."""
    ids = []
    for n in tokens_per_image:
        ids += rng.integers(IMAGE_TOKEN_ID + 1, VOCAB, 3).tolist() + [IMAGE_TOKEN_ID] * n
    return np.pad(np.asarray(ids, np.int32), (0, -len(ids) % 64))


def main() -> None:
    grid = np.array([[1, 4, 6], [1, 6, 6], [1, 2, 2]], np.int64)  # the processor's [N, 3] field
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _sharded_checkpoint(pathlib.Path(tmp))
        model = nnx.eval_shape(lambda: Glm4vMultimodal(cfg, rngs=nnx.Rngs(0)))  # no allocation
        model.load_weights(tmp)
    graphdef, state = nnx.split(model)
    state_leaves, treedef = jax.tree.flatten(state)  # the runner keeps the flat leaves
    rng = np.random.default_rng(0)
    pixels = rng.standard_normal((int(grid.prod(1).sum()), cfg.patch_dim), np.float32)

    def run_embed_multimodal(state_leaves, modality=None, **kwargs):
        model = nnx.merge(graphdef, jax.tree.unflatten(treedef, state_leaves))
        return model.embed_multimodal(**kwargs)

    @jax.jit
    def run_embed_input_ids(state_leaves, input_ids, mm_embeds, is_multimodal):
        model = nnx.merge(graphdef, jax.tree.unflatten(treedef, state_leaves))
        return model.embed_input_ids(input_ids, mm_embeds, is_multimodal=is_multimodal)

    def step(state_leaves, ids, is_mm):
        """One prefill step of the runner: encode the scheduled images, check, merge."""
        outputs = run_embed_multimodal(
            state_leaves, modality="image", pixel_values=pixels, image_grid_thw=grid
        )
        sanity_check_mm_encoder_outputs(outputs, expected_num_items=len(grid))
        mm_embeds = jnp.concatenate(outputs)  # the cached items, the whole prompt scheduled
        return outputs, run_embed_input_ids(state_leaves, ids, mm_embeds, is_mm)

    tokens = [t * (h // cfg.spatial_merge_size) * (w // cfg.spatial_merge_size) for t, h, w in grid]
    ids_host = _prompt(tokens, rng)
    is_mm_host = ids_host == IMAGE_TOKEN_ID  # the runner's host mask of the positions they fill
    ids, is_mm = jaxsync.async_h2d(ids_host), jaxsync.async_h2d(is_mm_host)

    first, merged = step(state_leaves, ids, is_mm)  # warm-up
    halved = [w * 0.5 for w in state_leaves]  # a weight update in the runner's leaves
    with sync_guard("error"), no_recompile():
        again, _ = step(state_leaves, ids, is_mm)
        updated, _ = step(halved, ids, is_mm)

    expected = glm4v.Glm4vVisionEncoder(model.visual)(pixel_values=pixels, image_grid_thw=grid)
    for got, same, want in zip(first, again, expected.split(), strict=True):
        assert got.dtype == model.embed_tokens.embedding.dtype  # merges without promotion
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(same, got)
    merged, text = np.asarray(merged), np.asarray(model.embed_tokens.embedding[...])
    np.testing.assert_array_equal(
        merged[is_mm_host], np.concatenate([np.asarray(e) for e in first])
    )
    np.testing.assert_array_equal(merged[~is_mm_host], text[ids_host[~is_mm_host]])
    assert not np.allclose(updated[0], first[0]), "the updated weights were not used"
    print(
        f"{len(grid)} images -> {[e.shape for e in first]} merged into a {len(ids_host)}-token "
        "prompt; 0 compiles and 0 host reads after warm-up; a state update is seen without "
        "recompiling"
    )


if __name__ == "__main__":
    main()
