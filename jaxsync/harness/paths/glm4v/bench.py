"""Benchmarks of the GLM-4.1V vision paths against transformers and vLLM's torch code.

Every workload timed through the entry is timed beside it through the server form: `forward`
(or `pos_embeds`) in a server's own jit over the tower's flat state leaves, with the batch's meta
uploaded once (`upload_packed(plan)`) outside the timed call.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxsync
from jaxsync.harness.paths._server import rows_only, server_runner
from jaxsync.harness.paths.glm4v import reference as ref
from jaxsync.harness.registry import BenchCase, register_bench
from jaxsync.models.glm4v import (
    Glm4vVisionConfig,
    Glm4vVisionEncoder,
    Glm4vVisionTower,
    forward,
    pos_embeds,
)


# Bench batches in patches (14 px): 336x336, 672x448, and 4 or 16 images of mixed sizes.
_MIXED = [[1, 24, 24], [1, 48, 32], [1, 32, 48], [1, 16, 16]]
_BENCH_GRIDS = {
    "336x336": [[1, 24, 24]],
    "672x448": [[1, 48, 32]],
    "4 images": _MIXED,
    "16 images": _MIXED * 4,
}
# Rows also timed with the other attention layouts than the default ("ragged" on a GPU):
# "dense" (work grows with the square of the batch's patch count) and "segments".
_LAYOUT_ROWS = ("672x448", "4 images", "16 images")


@register_bench("glm4v")
def _bench(device: str, size: str) -> list[BenchCase]:
    import torch

    fields = ref.TINY if size == "tiny" else ref.RELEASED
    hf = ref.hf_config(**fields)
    cfg = Glm4vVisionConfig.from_hf_config(hf)
    tdtype, jdtype = (
        (torch.float32, jnp.float32) if size == "tiny" else (torch.bfloat16, jnp.bfloat16)
    )
    # Random weights on both sides (the bench measures time; parity is `verify`'s job).
    torch_model = ref.build_reference(hf, device=device, dtype=tdtype)
    tower = Glm4vVisionTower(cfg, dtype=jdtype, rngs=nnx.Rngs(0))
    enc = Glm4vVisionEncoder(tower)
    others = {
        layout: Glm4vVisionEncoder(tower, layout=layout)
        for layout in ("dense", "segments")
        if layout != enc.layout
    }
    step = server_runner(tower, rows_only(forward))
    grids = _BENCH_GRIDS
    if size == "tiny":  # the tiny table is 6x6 with patch 7: same shapes, smaller images
        grids = {k: [[t, h // 4, w // 4] for t, h, w in g] for k, g in grids.items()}

    cases = []
    for label, grid in grids.items():
        host = [ref.pixels(grid, cfg, seed=s) for s in range(2)]
        plan = enc.plan(grid, host[0].shape[0])
        # Pixels pre-placed on both sides: the bench times the tower, not the pixel upload.
        padded = [np.zeros((plan.padded_patches, cfg.patch_dim), np.float32) for _ in host]
        for p, h in zip(padded, host, strict=True):
            p[: h.shape[0]] = h
        jpx = itertools.cycle([jax.device_put(p.astype(enc.dtype)) for p in padded])
        tpx = itertools.cycle([torch.from_numpy(h).to(device, tdtype) for h in host])
        tgrid = torch.tensor(ref.per_frame_grid(grid), device=device)

        def jax_fn(jpx=jpx, grid=grid):
            return enc(next(jpx), grid).embeddings

        def torch_fn(tpx=tpx, tgrid=tgrid):
            with torch.no_grad():
                return torch_model(next(tpx), tgrid).pooler_output

        name = f"glm4v.vision_tower {label}"
        cases.append(BenchCase(name, jax_fn, {"transformers_eager": torch_fn}))
        cases.append(BenchCase(f"{name} · server form", step(plan, lambda jpx=jpx: next(jpx))))
        for layout, other in others.items() if label in _LAYOUT_ROWS else ():

            def other_fn(jpx=jpx, grid=grid, other=other):
                return other(next(jpx), grid).embeddings

            name = f"glm4v.vision_tower {label} [{layout}]"
            cases.append(BenchCase(name, other_fn))
            cases.append(
                BenchCase(
                    f"{name} · server form", step(other.plan(grid), lambda jpx=jpx: next(jpx))
                )
            )

    grid = grids["4 images"]
    cases.append(
        BenchCase(
            "glm4v.pos_embeds 4 images",
            lambda grid=grid: enc.pos_embeds(grid),
            _torch_pos_embeds(torch_model, grid, cfg.spatial_merge_size, device),
        )
    )
    cases.append(BenchCase("glm4v.pos_embeds 4 images · server form", pos_step(tower, enc, grid)))
    return cases


def pos_step(tower: Glm4vVisionTower, enc: Glm4vVisionEncoder, grid):
    """The position embeddings' server form: `pos_embeds(table, meta)` in a server's jit."""
    table = tower.embeddings.position_embedding[...]
    meta = jaxsync.upload_packed(enc.plan(grid))
    step = jax.jit(pos_embeds)

    def run():
        return step(table, meta)

    jax.block_until_ready(run())
    return run


def _async_h2d(x, device: str):
    """vLLM's async_tensor_h2d: pinned host copy, then a non-blocking transfer."""
    if device == "cpu":
        return x.clone()
    return x.pin_memory().to(device, non_blocking=True)


def _torch_pos_embeds(torch_model, grid, merge: int, device: str) -> dict:
    """vLLM's pos_embeds_interpolate pre- and post-#51458, on transformers' embeddings module."""
    import torch

    from jaxsync.models.glm4v import merge_block_coords

    emb = torch_model.embeddings
    width = emb.position_embedding.weight.shape[1]
    dtype = emb.position_embedding.weight.dtype

    def run(pinned: bool):
        outs = []
        for t, h, w in grid:
            rows, cols = merge_block_coords(h, w, merge)
            hc = torch.from_numpy(np.tile(rows, t))
            wc = torch.from_numpy(np.tile(cols, t))
            if pinned:  # post-PR: async_tensor_h2d (pinned + non_blocking) for coords and shapes
                hc, wc, shapes = (
                    _async_h2d(x, device) for x in (hc, wc, torch.tensor([[t, h, w]]))
                )
            else:  # pre-PR: blocking tensor creation; coords moved by the blocking .to() inside
                shapes = torch.tensor([[t, h, w]], device=device)
                hc, wc = hc.to(device), wc.to(device)
            zeros = torch.zeros(t * h * w, width, dtype=dtype, device=device)
            with torch.no_grad():
                # `lengths` as a Python list: still a blocking H2D in both versions (fixed #52369).
                # Videos use the per-frame DP cycling of vLLM, which HF lacks: t = 1 here.
                outs.append(emb(zeros, [h * w] * t, shapes, hc, wc))
        return torch.cat(outs)

    fns = {"vllm_pre_pr": lambda: run(False), "vllm_post_pr": lambda: run(True)}
    try:  # transformers >= 5.2x: its own position-id helper (with its grid_thw.tolist())
        from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids
    except ImportError:
        return fns
    tgrid = torch.tensor(ref.per_frame_grid(grid), device=device)

    def hf_eager():
        pos = get_vision_position_ids(tgrid, merge)
        cu = get_vision_cu_seqlens(tgrid)
        zeros = torch.zeros(pos.shape[0], width, dtype=dtype, device=device)
        with torch.no_grad():
            return emb(zeros, cu[1:] - cu[:-1], tgrid, pos[:, 0], pos[:, 1])

    fns["transformers_eager"] = hf_eager
    return fns
