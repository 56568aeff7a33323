"""Bicubic position-embedding interpolation, exactly as torch `grid_sample` does it.

Upstream samples the S x S table with `F.grid_sample(mode="bicubic", align_corners=False,
padding_mode="border")` at each patch centre of the target grid. That is cubic convolution with
A = -0.75 (not `jax.image.resize`'s Keys a = -0.5 with antialiasing), half-pixel centres, and each
of the 4 x 4 taps clamped to the table; the coordinate itself is never clamped. The gather below
takes traced coordinates, so every image size shares one compiled program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


_A = -0.75  # torch's cubic-convolution constant


def _weights(t: jax.Array) -> jax.Array:
    """The 4 tap weights at fractional offset t in [0, 1): [P] -> [P, 4].

    Near taps (|d| <= 1): (A+2)d^3 - (A+3)d^2 + 1. Far taps (1 < |d| < 2): A d^3 - 5A d^2 + 8A d
    - 4A, which factors as A (d-1)(d-2)^2. torch evaluates the expanded cubic, whose terms cancel
    (float32 error ~1.2e-6 per weight); the factored form is accurate to a few ulp, so our error
    stays well below torch's own and does not depend on FMA contraction.
    """
    u = 1.0 - t
    near_t = ((_A + 2.0) * t - (_A + 3.0)) * t * t + 1.0
    near_u = ((_A + 2.0) * u - (_A + 3.0)) * u * u + 1.0
    return jnp.stack([_A * t * u * u, near_t, near_u, _A * u * t * t], axis=-1)


def _source(coord: jax.Array, target: jax.Array, side: int) -> tuple[jax.Array, jax.Array]:
    """Patch index on a `target` grid -> table coordinate, split into (floor, fraction).

    Upstream samples at norm = ((c + 0.5) / target) * 2 - 1, which grid_sample maps back to
    ((norm + 1) * side - 1) / 2 = ((2c + 1) * side - target) / (2 target). That is a ratio of
    integers, so the floor is exact integer arithmetic and the fraction one correctly rounded
    division: no float32 coordinate rounding (torch's chain of float32 ops loses up to ~1e-6 of a
    table cell at side 24), and nothing XLA can re-associate.
    """
    num = (2 * coord.astype(jnp.int32) + 1) * side - target.astype(jnp.int32)  # [P]
    den = 2 * target.astype(jnp.int32)
    base = jnp.floor_divide(num, den)
    frac = (num - base * den).astype(jnp.float32) / den.astype(jnp.float32)
    return base, frac


def interpolate_pos_embed(
    table: jax.Array,
    h_coords: jax.Array,
    w_coords: jax.Array,
    target_h: jax.Array,
    target_w: jax.Array,
) -> jax.Array:
    """Samples the position table at patch centres of per-patch target grids.

    Equals `F.interpolate(table_2d, size=(target_h, target_w), mode="bicubic",
    align_corners=False)` read at `(h_coords, w_coords)`, for every patch independently.

    Args:
      table: [S*S, D] (row-major S x S grid, rows are height) or [S, S, D].
      h_coords: [P] integer row of each patch on its image's grid.
      w_coords: [P] integer column.
      target_h: [P] integer grid height (patches) of the patch's image.
      target_w: [P] integer grid width.

    Returns:
      [P, D] float32 interpolated embeddings.
    """
    d = table.shape[-1]
    side = table.shape[0] if table.ndim == 3 else int(round(table.shape[0] ** 0.5))
    if side * side * d != table.size:
        raise ValueError(f"position table {table.shape} is not a square grid")
    flat = table.reshape(side * side, d).astype(jnp.float32)  # [S*S, D]

    y0, ty = _source(h_coords, target_h, side)  # [P]
    x0, tx = _source(w_coords, target_w, side)
    wy, wx = _weights(ty), _weights(tx)  # [P, 4]
    taps = jnp.arange(-1, 3, dtype=jnp.int32)[None, :]  # [1, 4]
    # "border" padding: each tap index is clamped, so out-of-range taps repeat the edge row/col.
    rows = jnp.clip(y0[:, None] + taps, 0, side - 1)  # [P, 4]
    cols = jnp.clip(x0[:, None] + taps, 0, side - 1)  # [P, 4]

    # Interpolate along x within each of the 4 rows, then along y, in torch's order. One row at a
    # time keeps the gathered block at [P, 4, D] instead of [P, 16, D].
    out = jnp.zeros((h_coords.shape[0], d), jnp.float32)
    for a in range(4):
        vals = jnp.take(flat, rows[:, a : a + 1] * side + cols, axis=0)  # [P, 4, D]
        row = jnp.einsum("PT,PTD->PD", wx, vals, precision=jax.lax.Precision.HIGHEST)
        out = out + wy[:, a : a + 1] * row
    return out
