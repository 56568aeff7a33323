"""A tpu-inference-style model class around jaxsync's GLM-4.1V vision tower.

tpu-inference builds a model under `nnx.eval_shape`, fills it with `load_weights`, keeps
`(graphdef, state)`, and on every multimodal call rebuilds the module with `nnx.merge` and calls
`embed_multimodal(image_grid_thw, **kwargs)` (`get_multimodal_embeddings` in older releases),
which returns one `[tokens_i, D]` array per image. This example does exactly that, with a tiny
random GLM-4.1V tower saved as a sharded checkpoint next to a large unrelated "language model"
shard the loader never opens, and checks:

- the embeddings equal `Glm4vVisionEncoder`'s;
- after one warm-up call, further calls compile nothing and read nothing back;
- a weight update through the server's own state is seen by the next call.

  python examples/tpu_inference_style.py
"""

from __future__ import annotations

import functools
import json
import pathlib
import tempfile

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

import jaxsync
from jaxsync.check import no_recompile, sync_guard
from jaxsync.models import glm4v


class Glm4vMultimodal(nnx.Module):
    """The part of a server's GLM-4.1V model class that owns the vision tower."""

    def __init__(self, cfg: glm4v.Glm4vVisionConfig, *, rngs: nnx.Rngs):
        self.visual = glm4v.Glm4vVisionTower(cfg, rngs=rngs)

    def load_weights(self, checkpoint: str) -> None:
        # Streams only `model.visual.*` from the sharded checkpoint, placing each as it is read.
        self.visual = glm4v.load_model(checkpoint, self.visual.cfg)

    def embed_multimodal(self, image_grid_thw, pixel_values) -> tuple[jax.Array, ...]:
        plan, meta = _planned(self.visual.cfg, image_grid_thw)
        host = np.zeros((plan.padded_patches, pixel_values.shape[1]), np.float32)
        host[: plan.num_patches] = pixel_values  # padding patches are zeros
        pixels = jaxsync.async_h2d(host, copy=False)
        graphdef, state = nnx.split(self.visual)
        out = jaxsync.Embeddings.of(_encode(graphdef, state, pixels, meta), plan)
        return tuple(out.split())  # static slices at host offsets: nothing is read back

    get_multimodal_embeddings = embed_multimodal  # the name older tpu-inference releases call


_plans: jaxsync.PlanCache = jaxsync.PlanCache()


def _planned(cfg: glm4v.Glm4vVisionConfig, grid_thw):
    """The host plan and its one packed upload, cached per grid mix."""
    key = np.asarray(grid_thw, np.int64).tobytes()

    def build():
        plan = glm4v.plan(grid_thw, cfg)  # `tower.cfg`: the layout its encoder would run
        return plan, jaxsync.upload_packed(plan)

    return _plans.get(key, build)


@functools.partial(jax.jit, static_argnums=0)
def _encode(graphdef, state, pixels, meta) -> jaxsync.Encoded:
    # The server's jit: the weights are arguments, so a state update needs no recompile.
    return glm4v.forward(nnx.merge(graphdef, state), pixels, meta)


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


def main() -> None:
    grid = [[1, 4, 6], [1, 6, 6], [1, 2, 2]]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _sharded_checkpoint(pathlib.Path(tmp))
        model = nnx.eval_shape(lambda: Glm4vMultimodal(cfg, rngs=nnx.Rngs(0)))  # no allocation
        model.load_weights(tmp)
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    pixels = rng.standard_normal((sum(t * h * w for t, h, w in grid), cfg.patch_dim), np.float32)

    def run_embed_multimodal(graphdef, state, image_grid_thw, **kwargs):
        return nnx.merge(graphdef, state).embed_multimodal(image_grid_thw, **kwargs)

    first = run_embed_multimodal(graphdef, state, grid, pixel_values=pixels)  # warm-up
    halved = jax.tree.map(lambda w: w * 0.5, state)  # a weight update in the server's state
    with sync_guard("error"), no_recompile():
        again = run_embed_multimodal(graphdef, state, grid, pixel_values=pixels)
        updated = run_embed_multimodal(graphdef, halved, grid, pixel_values=pixels)

    expected = glm4v.Glm4vVisionEncoder(model.visual)(pixel_values=pixels, image_grid_thw=grid)
    assert len(first) == len(grid)
    for got, same, want in zip(first, again, expected.split(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(same, got)
    assert not np.allclose(updated[0], first[0]), "the updated weights were not used"
    print(
        f"{len(grid)} images -> {[e.shape for e in first]}; 0 compiles and 0 host reads after "
        "warm-up; a state update is seen without recompiling"
    )


if __name__ == "__main__":
    main()
