"""Host-side plan of a packed vision batch: everything derived from `grid_thw`, in numpy.

Upstream derives coordinates, per-patch target sizes and attention segment lengths on the device
(post-PR still with a blocking `lengths` upload and a `lengths[i]` read-back). Here they are pure
functions of host metadata, computed once in numpy and moved in ONE packed transfer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import numpy as np

import jaxsync
from jaxsync import _compat
from jaxsync.models.glm4v._config import Glm4vVisionConfig


# Merged-token buckets: powers of two and their 1.5x midpoints from 8 up (8, 12, 16, 24, ...), so
# padding wastes at most a third of a batch (a 336x336 image, 144 tokens, runs at 192, not 256)
# while one program still serves a whole range of image sizes.
DEFAULT_GROUP_BUCKETS: tuple[int, ...] = tuple(
    sorted({b for k in range(3, 21) for b in (2**k, 3 * 2 ** (k - 1))})
)


# Patch-count buckets of one segment (frame) in the "segments" attention layout, and the slot
# counts of a group: a layout is one compiled program, so both are coarse.
DEFAULT_SEGMENT_BUCKETS: tuple[int, ...] = (4, 8, 16, *(4 * b for b in DEFAULT_GROUP_BUCKETS))
_SLOT_BUCKETS: tuple[int, ...] = tuple(2**k for k in range(16))
# Field-name prefix of a segment group's row index in the plan (`segment_L` -> [G, L]).
SEGMENT_GROUP = "segment_"
# Segment slots of the "ragged" layout: coarse, so nearly every batch of a patch bucket shares
# one program; unused slots cost the kernel next to nothing.
_RAGGED_SLOTS: tuple[int, ...] = tuple(8**k for k in range(1, 8))
LAYOUTS = ("dense", "segments", "ragged")
AttentionLayout = Literal["dense", "segments", "ragged", "auto"]


@dataclasses.dataclass(frozen=True)
class VisionPlan:
    """Host metadata of one packed batch.

    Attributes:
      grid_thw: [B, 3] int64 (t, h, w) per item, in patches.
      num_patches: real patch count (sum of t*h*w).
      padded_patches: the bucketed patch count (a multiple of merge_size**2).
      tokens_per_item: merged output tokens per item (t*h*w / merge_size**2).
      fields: the arrays for `upload_packed`, each [padded_patches]:
        h, w (int32 patch coordinates in merge-block order), th, tw (int32 target grid of the
        patch's image), seg (int32 attention segment: one per frame; padding gets its own),
        item (int32 item index; padding gets the item count). The "segments" layout adds, per
        segment length bucket L, `segment_L` [G, L]: the rows of G segments (frames) of at most
        L patches, padded with the index P. The "ragged" layout adds `seq_lengths` [M] and
        `seq_offsets` [M + 1] (rows per segment and first row of each, then the end; -1 in
        unused slots), the padding rows forming the last segment.
    """

    grid_thw: np.ndarray
    num_patches: int
    padded_patches: int
    tokens_per_item: tuple[int, ...]
    fields: dict[str, np.ndarray]

    @property
    def num_tokens(self) -> int:
        return sum(self.tokens_per_item)


def _holds_bool(x) -> bool:
    """A bool anywhere in a nested list / tuple (arrays carry their dtype instead)."""
    if isinstance(x, bool | np.bool_):
        return True
    return isinstance(x, list | tuple) and any(_holds_bool(v) for v in x)


def check_grid(grid_thw: Sequence[Sequence[int]] | np.ndarray, merge: int) -> np.ndarray:
    """Validates `grid_thw` on the host; returns it as [B, 3] int64.

    Raises:
      TypeError: device data (a jax array, a torch tensor off the CPU), or non-integers (floats,
        even integral ones, and bools: truncating them would encode another image size).
      ValueError: empty batch, wrong shape or ragged rows, non-positive sizes, or h/w not
        multiples of `merge`.
    """
    if _holds_bool(grid_thw):  # numpy would silently widen [[True, 6, 6]] to int64
        raise TypeError("grid_thw must hold integers, got a bool")
    grid = jaxsync.host_ints(grid_thw, name="grid_thw", ndim=None, minimum=None)
    if grid.size == 0:
        raise ValueError("empty batch: grid_thw has no items")
    if grid.ndim != 2 or grid.shape[1] != 3:
        raise ValueError(f"grid_thw must have shape [B, 3], got {grid.shape}")
    if (grid < 1).any():
        raise ValueError(f"grid_thw entries must be >= 1, got {grid.tolist()}")
    bad = [row for row in grid.tolist() if row[1] % merge or row[2] % merge]
    if bad:
        raise ValueError(f"h and w must be multiples of spatial_merge_size={merge}; got {bad}")
    return grid


def merge_block_coords(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Row/column of every patch of an h x w grid, enumerated block-row, block-col, inner-row,
    inner-col (the order the patches arrive in and `rot_pos_emb` uses)."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    order = (0, 2, 1, 3)
    return rows.reshape(shape).transpose(order).ravel(), cols.reshape(shape).transpose(
        order
    ).ravel()


def plan_batch(
    grid_thw: Sequence[Sequence[int]] | np.ndarray,
    cfg: Glm4vVisionConfig,
    *,
    num_patches: int | None = None,
    group_buckets: Sequence[int] | None = None,
    attention_layout: AttentionLayout = "dense",
    segment_buckets: Sequence[int] | None = None,
    attention: str = "xla",
) -> VisionPlan:
    """Plans a packed batch of images (t = 1) and videos (t frames, each its own segment).

    Args:
      grid_thw: [B, 3] (t, h, w) per item in patches, host data.
      cfg: the tower config.
      num_patches: rows of the pixel array, checked against sum(t*h*w) when given.
      group_buckets: buckets for the merged-token count (default `DEFAULT_GROUP_BUCKETS`).
      attention_layout: "dense" (one [P, P] segment mask: one program per patch bucket),
        "segments" (segments grouped by length bucket, attention work sum(G * L^2): one
        program per patch bucket and group mix) or "ragged" (segment lengths and offsets for
        cuDNN's ragged attention, work sum(L^2): one program per patch bucket and slot bucket),
        or "auto" (see `resolve_layout`).
      segment_buckets: patch-count buckets of one segment (default `DEFAULT_SEGMENT_BUCKETS`).
      attention: the tower's attention implementation (`model.blocks[0].attn.impl`), which
        "auto" resolves by.

    Raises:
      ValueError: see `check_grid`; or `num_patches` disagrees with `grid_thw`; or an unknown
        layout.
    """
    attention_layout = resolve_layout(attention_layout, attention)
    merge = cfg.spatial_merge_size
    grid = check_grid(grid_thw, merge)
    real = int((grid[:, 0] * grid[:, 1] * grid[:, 2]).sum())
    if num_patches is not None and num_patches != real:
        raise ValueError(f"grid_thw describes {real} patches but the pixel array has {num_patches}")
    # Bucket the merged-token count so the padded patch count stays a multiple of merge**2: every
    # padding group is then a whole merge block and never mixes with a real one.
    padded = (
        merge
        * merge
        * jaxsync.bucket(real // (merge * merge), group_buckets or DEFAULT_GROUP_BUCKETS)
    )

    h = np.zeros(padded, np.int32)
    w = np.zeros(padded, np.int32)
    th = np.ones(padded, np.int32)
    tw = np.ones(padded, np.int32)
    seg = np.zeros(padded, np.int32)
    item = np.full(padded, len(grid), np.int32)
    start, frame = 0, 0
    for index, (t, gh, gw) in enumerate(grid.tolist()):
        item[start : start + t * gh * gw] = index
        rows, cols = merge_block_coords(gh, gw, merge)
        for _ in range(t):  # every frame gets the same coordinates and its own segment
            end = start + gh * gw
            h[start:end], w[start:end], th[start:end], tw[start:end] = rows, cols, gh, gw
            seg[start:end] = frame
            start, frame = end, frame + 1
    seg[real:] = frame  # padding attends only to padding, so its rows stay finite
    tokens = tuple(int(t * gh * gw) // (merge * merge) for t, gh, gw in grid.tolist())
    fields = {"h": h, "w": w, "th": th, "tw": tw, "seg": seg, "item": item}
    if attention_layout == "segments":
        fields.update(segment_groups(grid, padded, segment_buckets or DEFAULT_SEGMENT_BUCKETS))
    elif attention_layout == "ragged":
        fields.update(ragged_segments(seg))
    return VisionPlan(grid, real, padded, tokens, fields)


def resolve_layout(layout: str, attention: str, devices: int = 1) -> str:
    """The layout an encoder plans with: "auto" is "ragged" for a tower on one device whose
    attention runs on cuDNN (and the installed jax offers its ragged form), else "dense"; both
    compile one program per patch bucket. A tower over several devices keeps the dense mask
    under "auto": the ragged call's partitioning over a mesh is not proven here.

    Raises:
      ValueError: an unknown layout.
    """
    if layout == "auto":
        ragged = attention == "cudnn" and devices == 1 and _compat.ragged_attention_available()
        return "ragged" if ragged else "dense"
    if layout not in LAYOUTS:
        raise ValueError(f"attention_layout must be one of {(*LAYOUTS, 'auto')}, got {layout!r}")
    return layout


def ragged_segments(seg: np.ndarray) -> dict[str, np.ndarray]:
    """`seq_lengths` [M] and `seq_offsets` [M + 1] of the runs of equal ids in `seg` [P] (every
    row in one segment), M the slot bucket of the run count, -1 in unused slots."""
    starts = np.flatnonzero(np.diff(seg, prepend=-1))  # first row of each run
    count = len(starts)
    slots = jaxsync.bucket(count, _RAGGED_SLOTS, minimum=1)
    lengths = np.full(slots, -1, np.int32)
    offsets = np.full(slots + 1, -1, np.int32)
    lengths[:count] = np.diff(np.append(starts, len(seg)))
    offsets[: count + 1] = np.append(starts, len(seg))
    return {"seq_lengths": lengths, "seq_offsets": offsets}


def segment_groups(grid: np.ndarray, padded: int, buckets: Sequence[int]) -> dict[str, np.ndarray]:
    """Row indices of every segment (frame), grouped by length bucket: `segment_L` [G, L] with G
    slots (a power of two), empty places holding `padded` (one past the last row)."""
    lengths = [gh * gw for t, gh, gw in grid.tolist() for _ in range(t)]
    by_bucket: dict[int, list[tuple[int, int]]] = {}
    start = 0
    for n in lengths:
        by_bucket.setdefault(jaxsync.bucket(n, tuple(buckets), minimum=1), []).append((start, n))
        start += n
    out = {}
    for size in sorted(by_bucket):
        members = by_bucket[size]
        index = np.full((jaxsync.bucket(len(members), _SLOT_BUCKETS, minimum=1), size), padded)
        for slot, (first, n) in enumerate(members):
            index[slot, :n] = np.arange(first, first + n)
        out[f"{SEGMENT_GROUP}{size:08d}"] = index.astype(np.int32)
    return out
