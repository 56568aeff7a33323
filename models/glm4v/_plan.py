"""Host-side plan of a packed vision batch: everything derived from `grid_thw`, in numpy.

Coordinates, per-patch target sizes, attention segments and item ids are pure functions of host
metadata: computed once in numpy and moved in ONE packed transfer (`jaxsync.upload_packed(plan)`).
Every static size of the device program (patches, items, attention slots) comes from a bucket,
so many batches share one program.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import numpy as np

import jaxsync
from jaxsync import _compat
from jaxsync._host import host_int, host_ints
from jaxsync._plans import content_key
from jaxsync.models.glm4v._config import Glm4vVisionConfig
from jaxsync.models.glm4v._segments import MAX_GROUPS, ragged_segments, segment_groups


# Merged-token buckets: powers of two and their 1.5x midpoints from 8 up (8, 12, 16, 24, ...), so
# padding wastes at most a third of a batch (a 336x336 image, 144 tokens, runs at 192, not 256)
# while one program still serves a whole range of image sizes. The largest (1.5 * 2^20) holds the
# released image processor's largest image (28 * 28 * 15000 pixels: 15,000 tokens) many times.
DEFAULT_GROUP_BUCKETS: tuple[int, ...] = tuple(
    sorted({b for k in range(3, 21) for b in (2**k, 3 * 2 ** (k - 1))})
)
# Item-count buckets (the length of the per-item finite flags): coarse, as the ragged layout's
# segment slots, so one program serves 1 to 8 images, 9 to 64, ...; a padding flag costs nothing.
DEFAULT_ITEM_BUCKETS: tuple[int, ...] = tuple(8**k for k in range(1, 8))
# Patch-count buckets of one segment (frame) in the "segments" attention layout: a layout is one
# compiled program, so they are coarse.
DEFAULT_SEGMENT_BUCKETS: tuple[int, ...] = (4, 8, 16, *(4 * b for b in DEFAULT_GROUP_BUCKETS))
LAYOUTS = ("dense", "segments", "ragged")
AttentionLayout = Literal["dense", "segments", "ragged", "auto"]
"""How each image / frame attends only to itself:
"ragged" (cuDNN's attention over the segments of the packed rows: work grows with the sum of
per-image squares; GPU towers with cuDNN attention; one program per patch bucket and
segment-slot bucket, 8 / 64 / 512 ... segments),
"dense" (a [P, P] segment mask: work grows with the square of the batch's patches; any backend;
one program per patch bucket),
"segments" (images of similar size batched, each attending alone: work grows with the sum of
per-image squares; any backend; one program per patch bucket and size mix),
or "auto" ("ragged" for a tower on one device whose attention runs on cuDNN, else "dense";
`plan(grid_thw, model.cfg)` resolves it the same way for one device). "ragged" on a tower
without cuDNN attention computes the dense mask."""


class Glm4vBuckets(NamedTuple):
    """The static sizes a plan pads to (each a strictly increasing tuple of positive ints).

    Attributes:
      tokens: merged-token buckets of a batch (patches = tokens * merge**2).
      items: item-count buckets (the length of the per-item finite flags).
      segment_rows: patch-count buckets of one segment in the "segments" layout.
    """

    tokens: tuple[int, ...] = DEFAULT_GROUP_BUCKETS
    items: tuple[int, ...] = DEFAULT_ITEM_BUCKETS
    segment_rows: tuple[int, ...] = DEFAULT_SEGMENT_BUCKETS


class Glm4vMeta(NamedTuple):
    """The device metadata of one batch: the arrays `jaxsync.upload_packed(plan)` moves.

    P is the padded patch count, I the padded item count. Every layout has every field; the
    fields of the layouts not in use are empty, so the forward tells the layout from static
    shapes.

    Attributes:
      h, w: int32 [P] patch row and column in merge-block order (0 for padding).
      th, tw: int32 [P] the target grid of the patch's image (1 for padding).
      seg: int32 [P] attention segment: one per frame; the padding rows form their own.
      item: int32 [P] item index; padding rows get I (outside every item).
      item_tokens: int32 [I] merged tokens per item (0 for padding items).
      seq_lengths, seq_offsets: int32 [M], [M + 1] (the "ragged" layout, else [0]): rows and
        first row of each segment, then the end; -1 in unused slots.
      group_0 .. group_3: int32 [G_k, L_k] (the "segments" layout, else [0, 0]): the rows of G_k
        segments of at most L_k patches, padded with the index P.
    """

    h: np.ndarray
    w: np.ndarray
    th: np.ndarray
    tw: np.ndarray
    seg: np.ndarray
    item: np.ndarray
    item_tokens: np.ndarray
    seq_lengths: np.ndarray
    seq_offsets: np.ndarray
    group_0: np.ndarray
    group_1: np.ndarray
    group_2: np.ndarray
    group_3: np.ndarray

    @property
    def groups(self) -> tuple[np.ndarray, ...]:
        """The non-empty segment groups."""
        return tuple(g for g in (self.group_0, self.group_1, self.group_2, self.group_3) if g.size)


class Glm4vPlan(NamedTuple):
    """Host plan of one packed batch.

    Attributes:
      meta: the device metadata (`jaxsync.upload_packed(plan)` uploads it in one transfer).
      lengths: merged output rows per item, t*h*w / merge**2.
      grid_thw: [B, 3] int64 (t, h, w) per item, in patches.
      layout: the attention layout the meta describes ("dense", "segments" or "ragged").
      num_patches: real patch count (sum of t*h*w).
      padded_patches: P, the bucketed patch count (a multiple of merge**2): pixel rows.
      padded_items: I, the bucketed item count: the length of the forward's finite flags.
    """

    meta: Glm4vMeta
    lengths: tuple[int, ...]
    grid_thw: np.ndarray
    layout: str
    num_patches: int
    padded_patches: int
    padded_items: int

    @property
    def num_items(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


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
    grid = host_ints(grid_thw, name="grid_thw", ndim=None, minimum=None)
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


def check_buckets(buckets: Glm4vBuckets | None) -> Glm4vBuckets:
    """`buckets` with every size a host int >= 1 (None: the defaults).

    Raises:
      TypeError: not a `Glm4vBuckets`, or a size that is not an int.
    """
    if buckets is None:
        return Glm4vBuckets()
    if not isinstance(buckets, Glm4vBuckets):
        raise TypeError(f"buckets must be a Glm4vBuckets, got {type(buckets).__name__}")
    return Glm4vBuckets(
        *(
            tuple(host_int(b, name=f"buckets.{name}", minimum=1) for b in sizes)
            for name, sizes in zip(Glm4vBuckets._fields, buckets, strict=True)
        )
    )


def merge_block_coords(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Row/column of every patch of an h x w grid, enumerated block-row, block-col, inner-row,
    inner-col (the order the patches arrive in and `rot_pos_emb` uses)."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    order = (0, 2, 1, 3)
    return rows.reshape(shape).transpose(order).ravel(), cols.reshape(shape).transpose(
        order
    ).ravel()


def resolve_layout(layout: str, attention: str, devices: int = 1) -> str:
    """The attention layout "auto" stands for: "ragged" for a tower on one device whose
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
        raise ValueError(f"layout must be one of {(*LAYOUTS, 'auto')}, got {layout!r}")
    return layout


def plan(
    grid_thw: Sequence[Sequence[int]] | np.ndarray,
    cfg: Glm4vVisionConfig,
    *,
    buckets: Glm4vBuckets | None = None,
    layout: AttentionLayout = "auto",
    devices: int = 1,
    num_patches: int | None = None,
) -> Glm4vPlan:
    """Plans a packed batch of images (t = 1) and videos (t frames, each its own segment).

    Args:
      grid_thw: [B, 3] (t, h, w) per item in patches, host data.
      cfg: the tower's config, `tower.cfg`: it carries the tower's resolved attention
        (`cfg.attention`), which "auto" reads; a bare `Glm4vVisionConfig` plans for XLA
        attention.
      buckets: the static sizes to pad to (default `Glm4vBuckets()`).
      layout: "dense" (one [P, P] segment mask: one program per patch bucket), "segments"
        (segments grouped by length bucket, attention work sum(G * L^2): one program per patch
        bucket and group mix), "ragged" (segment lengths and offsets for cuDNN's ragged
        attention, work sum(L^2): one program per patch bucket and slot bucket), or "auto"
        (`resolve_layout`: what `Glm4vVisionEncoder` runs for this tower).
      devices: the devices the tower's weights span ("auto" keeps the dense mask on several).
      num_patches: rows of the pixel array, checked against sum(t*h*w) when given.

    Raises:
      ValueError: see `check_grid`; `num_patches` disagrees with `grid_thw`; an unknown layout;
        a size past its largest bucket.
    """
    layout = resolve_layout(layout, getattr(cfg, "attention", "xla"), devices)
    buckets = check_buckets(buckets)
    merge = cfg.spatial_merge_size
    grid = check_grid(grid_thw, merge)
    real = int((grid[:, 0] * grid[:, 1] * grid[:, 2]).sum())
    if num_patches is not None and num_patches != real:
        raise ValueError(f"grid_thw describes {real} patches but the pixel array has {num_patches}")
    # Bucket the merged-token count so the padded patch count stays a multiple of merge**2: every
    # padding group is then a whole merge block and never mixes with a real one.
    padded = merge * merge * jaxsync.bucket(real // (merge * merge), buckets.tokens)
    items = jaxsync.bucket(len(grid), buckets.items)

    h = np.zeros(padded, np.int32)
    w = np.zeros(padded, np.int32)
    th = np.ones(padded, np.int32)
    tw = np.ones(padded, np.int32)
    seg = np.zeros(padded, np.int32)
    item = np.full(padded, items, np.int32)
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
    lengths = tuple(int(t * gh * gw) // (merge * merge) for t, gh, gw in grid.tolist())
    item_tokens = np.zeros(items, np.int32)
    item_tokens[: len(lengths)] = lengths
    seq_lengths = seq_offsets = np.zeros(0, np.int32)
    groups = [np.zeros((0, 0), np.int32)] * MAX_GROUPS
    if layout == "ragged":
        seq_lengths, seq_offsets = ragged_segments(seg)
    elif layout == "segments":
        found = segment_groups(grid, padded, buckets.segment_rows)
        groups[: len(found)] = found
    meta = Glm4vMeta(h, w, th, tw, seg, item, item_tokens, seq_lengths, seq_offsets, *groups)
    return Glm4vPlan(meta, lengths, grid, layout, real, padded, items)


def grid_planner(grid_thw: Any, cfg: Glm4vVisionConfig, **options: Any):
    """`planner(pixels, where)` of `TowerEntry.run`: `plan(grid, cfg, **options)` cached per grid
    content, host patch count and placement (the grid is checked on a miss)."""

    def planner(pixels: Any, where: Any):
        key, grid = content_key(grid_thw, lambda g: check_grid(g, cfg.spatial_merge_size))
        n = pixels.shape[0] if isinstance(pixels, np.ndarray) else None  # host pixels
        return (key, n, where), lambda: plan(grid, cfg, num_patches=n, **options)

    return planner
