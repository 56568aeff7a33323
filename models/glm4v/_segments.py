"""Host planning of the attention segments (one per image, one per video frame) of a batch.

Two layouts let each segment attend only to itself without a [P, P] mask: "ragged" lists every
segment's rows and first row for cuDNN's ragged attention, "segments" gathers segments of
similar length into at most `MAX_GROUPS` batched groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import jaxsync


# Segment slots of the "ragged" layout: coarse, so nearly every batch of a patch bucket shares
# one program; unused slots cost the kernel next to nothing.
RAGGED_SLOTS: tuple[int, ...] = tuple(8**k for k in range(1, 8))
# Slot counts of one group of the "segments" layout (a layout is one compiled program).
GROUP_SLOTS: tuple[int, ...] = tuple(2**k for k in range(16))
# Length groups of the "segments" layout: a fixed count, so the plan's metadata has one type.
# Batches of more distinct lengths merge the shortest groups into longer ones.
MAX_GROUPS = 4


def ragged_segments(seg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lengths [M], offsets [M + 1]) of the runs of equal ids in `seg` [P] (every row in one
    segment), M the slot bucket of the run count, -1 in unused slots.

    Raises:
      ValueError: more runs than the largest slot bucket.
    """
    starts = np.flatnonzero(np.diff(seg, prepend=-1))  # first row of each run
    count = len(starts)
    slots = jaxsync.bucket(count, RAGGED_SLOTS, minimum=1)
    lengths = np.full(slots, -1, np.int32)
    offsets = np.full(slots + 1, -1, np.int32)
    lengths[:count] = np.diff(np.append(starts, len(seg)))
    offsets[: count + 1] = np.append(starts, len(seg))
    return lengths, offsets


def segment_groups(grid: np.ndarray, padded: int, buckets: Sequence[int]) -> list[np.ndarray]:
    """Row indices of every segment (frame), grouped by length bucket, shortest first: per group
    an int32 [G, L] with G slots (a power of two), empty places holding `padded` (one past the
    last row). At most `MAX_GROUPS` groups: beyond that, the shortest group joins the next."""
    lengths = [gh * gw for t, gh, gw in grid.tolist() for _ in range(t)]
    by_bucket: dict[int, list[tuple[int, int]]] = {}
    start = 0
    for n in lengths:
        by_bucket.setdefault(jaxsync.bucket(n, tuple(buckets), minimum=1), []).append((start, n))
        start += n
    sizes = sorted(by_bucket)
    while len(sizes) > MAX_GROUPS:  # the shortest segments pad up to the next length
        shortest = sizes.pop(0)
        by_bucket[sizes[0]] = by_bucket.pop(shortest) + by_bucket[sizes[0]]
    out = []
    for size in sizes:
        members = by_bucket[size]
        index = np.full((jaxsync.bucket(len(members), GROUP_SLOTS, minimum=1), size), padded)
        for slot, (first, n) in enumerate(members):
            index[slot, :n] = np.arange(first, first + n)
        out.append(index.astype(np.int32))
    return out
