"""Registers the GLM-4.1V vision paths for `jaxsync verify`."""

from __future__ import annotations

import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsync.harness.paths.glm4v import reference as ref
from jaxsync.harness.registry import Parity, PathCase, register_path
from jaxsync.models.glm4v import (
    DEFAULT_GROUP_BUCKETS,
    Glm4vVisionConfig,
    Glm4vVisionEncoder,
    Glm4vVisionTower,
)


# Five image sizes, a video and a two-image batch whose merged-token counts (25..32) share the
# 32-token bucket.
VERIFY_GRIDS: tuple[list[list[int]], ...] = (
    [[1, 10, 10]],
    [[1, 8, 14]],
    [[1, 4, 30]],
    [[1, 8, 16]],
    [[1, 6, 18]],
    [[2, 6, 10]],
    [[1, 6, 6], [1, 8, 8]],
)


def _tiny_encoder() -> Glm4vVisionEncoder:
    # Built without transformers, so verify's checks run on a torch-free install; a test pins
    # Glm4vVisionConfig(**TINY) == from_hf_config(hf_config(**TINY)).
    return Glm4vVisionEncoder(Glm4vVisionTower(Glm4vVisionConfig(**ref.TINY), rngs=nnx.Rngs(0)))


def _checkpoint_encoder(checkpoint: str) -> Glm4vVisionEncoder:
    return Glm4vVisionEncoder.from_pretrained(checkpoint, dtype=jnp.bfloat16)


def _reference_pair(seed: int):
    """A tiny random transformers tower and our encoder loaded from its saved safetensors."""
    hf = ref.hf_config(**ref.TINY)
    torch_model = ref.build_reference(hf, seed=seed)
    cfg = Glm4vVisionConfig.from_hf_config(hf)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = ref.save_checkpoint(torch_model, Path(tmp) / "model.safetensors")
        return torch_model, Glm4vVisionEncoder.from_pretrained(ckpt, cfg)


def _parity() -> Parity:
    """Tiny random transformers tower -> safetensors -> our loader; fp32 max-norm rel error over
    images, a non-square batch and a video."""
    from jaxsync.testing import rel_err

    torch_model, enc = _reference_pair(seed=1)
    worst = 0.0
    for grid in ([[1, 6, 6]], [[1, 4, 8], [1, 10, 6]], [[3, 4, 6]]):
        px = ref.pixels(grid, enc.cfg)
        out = enc(px, grid)
        want = ref.forward(torch_model, px, grid)[1]
        worst = max(worst, rel_err(np.asarray(out.embeddings)[: out.num_tokens], want))
    return Parity(worst, 1e-5, "rel", "transformers Glm4vVisionModel (eager), tiny random fp32")


@register_path("glm4v.vision_tower", "packed pixels + host grid_thw -> merged vision tokens")
def _build_tower(checkpoint: str | None) -> PathCase:
    enc = _tiny_encoder() if checkpoint is None else _checkpoint_encoder(checkpoint)
    inputs = [(ref.pixels(g, enc.cfg, seed=i), g) for i, g in enumerate(VERIFY_GRIDS)]

    def make_inputs(bucket: int):  # one 2 x 2b-patch image: exactly `bucket` merged tokens
        grid = _grid_for(bucket, enc.cfg.spatial_merge_size)
        return (ref.pixels(grid, enc.cfg), grid)

    return PathCase(
        fn=enc,
        inputs=inputs,
        parity=_parity if checkpoint is None else None,
        make_inputs=make_inputs,
        buckets=_PRECOMPILE_BUCKETS,
    )


# `jaxsync.precompile` default: the group buckets up to 1024 merged tokens (a 896x896 image).
_PRECOMPILE_BUCKETS = tuple(b for b in DEFAULT_GROUP_BUCKETS if b <= 1024)


def _grid_for(tokens: int, merge: int) -> list[list[int]]:
    return [[1, merge, merge * tokens]]


@register_path("glm4v.pos_embeds", "host grid_thw -> bicubic-interpolated position embeddings")
def _build_pos(checkpoint: str | None) -> PathCase:
    enc = _tiny_encoder() if checkpoint is None else _checkpoint_encoder(checkpoint)

    def parity() -> Parity:
        torch_model, e = _reference_pair(seed=2)
        worst = torch32 = 0.0
        for grid in VERIFY_GRIDS:
            n = sum(t * h * w for t, h, w in grid)
            got = np.asarray(e.pos_embeds(grid))[:n]
            exact = ref.exact_pos_embeds(torch_model, grid, 2)
            worst = max(worst, float(np.abs(got - exact).max()))
            theirs = ref.pos_embeds(torch_model, grid, 2)
            torch32 = max(torch32, float(np.abs(theirs - exact).max()))
        return Parity(
            worst,
            1e-6,
            "abs",
            f"vs F.grid_sample(bicubic, border) in float64; transformers' fp32 path is "
            f"{torch32:.1e} from it",
        )

    return PathCase(
        fn=enc.pos_embeds,
        inputs=[(g,) for g in VERIFY_GRIDS],
        parity=parity,
        make_inputs=lambda b: (_grid_for(b, enc.cfg.spatial_merge_size),),
        buckets=_PRECOMPILE_BUCKETS,
    )
