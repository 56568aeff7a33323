"""GLM-4.1V's image input: the processor's flattened patches, checked before any upload.

`Glm4vImageProcessor` gives `pixel_values` `[sum(t*h*w), C*T*p*p]` (patches in merge-block order)
with `image_grid_thw` `[B, 3]`; a server may pass device patches instead, already padded to the
plan's patch bucket. The grid is host metadata, checked by the planner (`_plan.check_grid`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxsync._calls import reads
from jaxsync.models.glm4v._plan import Glm4vPlan


PIXELS = "pixel_values"


def pixel_check(patch_dim: int, dtype: Any):
    """The check of patches (host or device): `[P, patch_dim]`, floating point (or the model's
    dtype)."""

    @reads("type", "shape", "dtype")
    def check(pixel_values: Any) -> None:
        shape, have = pixel_values.shape, np.dtype(pixel_values.dtype)
        if len(shape) != 2 or shape[1] != patch_dim:
            raise ValueError(f"{PIXELS} must be [P, {patch_dim}], got {shape}")
        if not np.issubdtype(have, np.floating) and have != np.dtype(dtype):
            raise TypeError(f"{PIXELS} must be floating point, got {have}")

    return check


@reads("shape", "metadata")
def padded(pixels: jax.Array, plan: Glm4vPlan) -> None:
    """Device patches come padded to the plan's patch bucket (zeros past the real ones)."""
    if pixels.shape[0] != plan.padded_patches:
        raise ValueError(
            f"a device pixel array must already be padded to the bucket: "
            f"{plan.padded_patches} rows, got {pixels.shape[0]}"
        )
