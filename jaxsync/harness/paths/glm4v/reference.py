"""The transformers reference for tests, `jaxsync verify` and benchmarks (torch imported lazily).

Reference semantics differ from ours in one place only: transformers' `Glm4vVisionModel` indexes
`grid_thw` per frame, so videos are passed to it as t rows of [1, h, w] (what its
`get_video_features` does); jaxsync takes the [t, h, w] row directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from jaxsync.models.glm4v import Glm4vVisionConfig, merge_block_coords


# Tiny odd-sized tower: head dim 12, 6x6 table (image 42 / patch 7), out 29, merger 37.
TINY = dict(
    depth=2,
    hidden_size=48,
    num_heads=4,
    image_size=42,
    patch_size=7,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=29,
    intermediate_size=37,
    attention_bias=True,
)
# The released GLM-4.1V vision tower is the HF default config.
RELEASED: dict[str, Any] = {}


def hf_config(**fields: Any):
    """A transformers `Glm4vVisionConfig` (eager attention, the reference the bench names)."""
    from transformers import Glm4vVisionConfig as HfConfig

    cfg = HfConfig(**fields)
    cfg._attn_implementation = "eager"
    return cfg


def build_reference(hf_cfg, *, seed: int = 0, device: str = "cpu", dtype=None):
    """A transformers `Glm4vVisionModel` with every parameter random and O(1)-scaled.

    HF initialises norms to ones and the table with std 0.02, which would hide a missing norm
    weight or a transposed table; here norms are 1 + 0.2 n, the table n, matrices n / sqrt(fan_in).
    """
    import torch
    from transformers import Glm4vVisionModel

    torch.manual_seed(seed)
    with torch.device(device):
        model = Glm4vVisionModel(hf_cfg).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("position_embedding.weight"):
                    p.normal_()
                elif p.ndim == 1 and "norm" in name and name.endswith("weight"):
                    p.copy_(1 + 0.2 * torch.randn_like(p))
                elif p.ndim == 1:
                    p.copy_(0.1 * torch.randn_like(p))
                else:
                    p.copy_(torch.randn_like(p) / float(np.sqrt(p[0].numel())))
    return model if dtype is None else model.to(dtype)


def save_checkpoint(model, path: str | Path) -> str:
    """Saves the tower as a full transformers 5.x checkpoint would hold it: `model.visual.*`,
    plus one unrelated key the loader must ignore."""
    import torch

    from jaxsync.testing import save_torch_state

    state = {f"model.visual.{k}": v for k, v in model.state_dict().items()}
    state["lm_head.weight"] = torch.zeros(3, 5)
    return save_torch_state(state, path)


def pixels(grid_thw, cfg: Glm4vVisionConfig, *, seed: int = 0) -> np.ndarray:
    """Random flattened patches [sum(t*h*w), C*T*p*p] float32."""
    n = int(sum(t * h * w for t, h, w in grid_thw))
    return np.random.default_rng(seed).standard_normal((n, cfg.patch_dim)).astype(np.float32)


def per_frame_grid(grid_thw) -> list[list[int]]:
    """[t, h, w] rows -> t rows of [1, h, w] (transformers' video convention)."""
    return [[1, h, w] for t, h, w in grid_thw for _ in range(t)]


def forward(model, pixel_values: np.ndarray, grid_thw) -> tuple[np.ndarray, np.ndarray]:
    """(last_hidden_state, pooler_output) of the transformers tower, as float32 numpy."""
    import torch

    p = next(model.parameters())
    with torch.no_grad():
        out = model(
            torch.from_numpy(pixel_values).to(p.device, p.dtype),
            torch.tensor(per_frame_grid(grid_thw), device=p.device),
        )
    return (
        out.last_hidden_state.float().cpu().numpy(),
        out.pooler_output.float().cpu().numpy(),
    )


def pos_embeds(model, grid_thw, spatial_merge_size: int) -> np.ndarray:
    """Upstream's interpolated position embeddings (`F.grid_sample` path) for a batch: zeros fed
    through `Glm4vVisionEmbeddings.forward`, as vLLM's `pos_embeds_interpolate` does."""
    import torch

    frames = per_frame_grid(grid_thw)
    h, w = [], []
    for _, gh, gw in frames:
        rows, cols = merge_block_coords(gh, gw, spatial_merge_size)
        h.append(rows)
        w.append(cols)
    p = model.embeddings.position_embedding.weight
    n = sum(gh * gw for _, gh, gw in frames)
    with torch.no_grad():
        out = model.embeddings(
            torch.zeros(n, p.shape[1], dtype=p.dtype, device=p.device),
            torch.tensor([gh * gw for _, gh, gw in frames], device=p.device),
            torch.tensor(frames, device=p.device),
            torch.from_numpy(np.concatenate(h)).to(p.device),
            torch.from_numpy(np.concatenate(w)).to(p.device),
        )
    return out.float().cpu().numpy()


def grid_sample_exact(table: np.ndarray, rows, cols, target_h, target_w) -> np.ndarray:
    """`F.grid_sample(bicubic, align_corners=False, border)` in float64 with float64 sampling
    coordinates: the exact value both float32 implementations approximate.

    Args:
      table: [S*S, D] position table (any float dtype).
      rows, cols, target_h, target_w: [P] host integer arrays.
    """
    import torch
    import torch.nn.functional as F

    side = int(round(table.shape[0] ** 0.5))
    t2d = torch.from_numpy(np.asarray(table, np.float64)).view(side, side, -1).permute(2, 0, 1)
    norm = [
        (
            (torch.from_numpy(np.asarray(c, np.float64)) + 0.5)
            / torch.from_numpy(np.asarray(s, np.float64))
        )
        * 2
        - 1
        for c, s in ((cols, target_w), (rows, target_h))
    ]
    grid = torch.stack(norm, -1)[None, :, None, :]
    out = F.grid_sample(t2d[None], grid, mode="bicubic", align_corners=False, padding_mode="border")
    return out[0, :, :, 0].T.numpy()


def exact_pos_embeds(model, grid_thw, spatial_merge_size: int) -> np.ndarray:
    """`grid_sample_exact` of the transformers tower's table for a packed batch."""
    rows, cols, th, tw = [], [], [], []
    for t, h, w in grid_thw:
        r, c = merge_block_coords(h, w, spatial_merge_size)
        rows.append(np.tile(r, t))
        cols.append(np.tile(c, t))
        th.append(np.full(t * h * w, h))
        tw.append(np.full(t * h * w, w))
    table = model.embeddings.position_embedding.weight.detach().double().cpu().numpy()
    return grid_sample_exact(table, *(np.concatenate(a) for a in (rows, cols, th, tw)))
