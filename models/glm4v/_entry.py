"""The host entry of the GLM-4.1V vision tower: validate, plan (cached), upload, one dispatch."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import jaxsync
from jaxsync._calls import reads
from jaxsync._entry import TowerEntry, alive, on_devices
from jaxsync.check import entry_point
from jaxsync.models._sharding import OutSharding, check_placement, with_out_sharding
from jaxsync.models.glm4v import _plan
from jaxsync.models.glm4v._modules import (
    Glm4vVisionTower,
    forward,
    forward_encoder_only,
    pos_embeds,
)
from jaxsync.models.glm4v._plan import AttentionLayout, Glm4vBuckets, Glm4vPlan, check_grid


_pos_program = jax.jit(pos_embeds)


def _home(table: jax.Array) -> jax.Device | jax.sharding.Sharding:
    """Where per-call uploads go by default: beside the weights (replicated over their mesh)."""
    sharding = table.sharding
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec())
    return next(iter(sharding.device_set))


PIXELS = "pixel_values"


class Glm4vVisionEncoder:
    """Host entry around a `Glm4vVisionTower`: host plan, one packed upload, one dispatch.

    It runs `jaxsync.TowerProgram(model, forward)`: the function a server jits over the tower's
    state leaves, compiled once per tower structure and shared by every encoder of it, so a
    server may rebuild the encoder from its `(graphdef, state)` per call. The encoder snapshots
    the weights: after `nnx.update` of the module, call `load_state(model)` (no recompile).

    Args:
      model: the tower (e.g. from `load_model`).
      buckets: the static sizes plans pad to (default `Glm4vBuckets()`).
      placement: device or sharding for host uploads (None: replicated beside the weights;
        one on other devices than the weights is refused).
      plan_cache_size: host plans (and their uploaded metadata) kept per `grid_thw` mix.
      layout: how each image / frame attends only to itself:
        "ragged" (cuDNN's attention over the segments of the packed rows: work grows with the
        sum of per-image squares; GPU towers with cuDNN attention; one program per patch
        bucket and segment-slot bucket, 8 / 64 / 512 ... segments),
        "dense" (a [P, P] segment mask: work grows with the square of the batch's patches; any
        backend; one program per patch bucket),
        "segments" (images of similar size batched, each attending alone: work grows with the
        sum of per-image squares; any backend; one program per patch bucket and size mix),
        or "auto" (default: "ragged" for a tower on one device whose attention runs on cuDNN,
        else "dense"; `plan(grid_thw, model.cfg)` resolves it the same way for one device).
        "ragged" on a tower without cuDNN attention computes the dense mask.
      encoder_only: return the tokens before the patch merger as the rows (no merger runs).
      out_sharding: where the rows go (`forward`'s option): None replicates them over the
        weights' mesh; a `PartitionSpec` over that mesh or a `Sharding` as the server asks.

    Attributes:
      cfg: the tower's config (`model.cfg`, with its resolved attention).
      layout: the layout in use ("auto" resolved).
      buckets: the checked buckets.
    """

    def __init__(
        self,
        model: Glm4vVisionTower,
        *,
        buckets: Glm4vBuckets | None = None,
        placement=None,
        plan_cache_size: int = 64,
        layout: AttentionLayout = "auto",
        encoder_only: bool = False,
        out_sharding: OutSharding = None,
    ):
        if not isinstance(model, Glm4vVisionTower):
            raise TypeError(f"model must be a Glm4vVisionTower, got {type(model).__name__}")
        self.cfg = model.cfg
        self.devices = len(model.post_layernorm.weight[...].sharding.device_set)
        self.layout = _plan.resolve_layout(layout, self.cfg.attention, self.devices)
        self.dtype = model.dtype
        self.buckets = _plan.check_buckets(buckets)
        self.encoder_only = bool(encoder_only)
        self._table = model.embeddings.position_embedding[...]
        check_placement(placement, self._table)
        self.placement = _home(self._table) if placement is None else placement
        program = jaxsync.TowerProgram(
            model,
            with_out_sharding(forward_encoder_only if self.encoder_only else forward, out_sharding),
        )
        weights = self._table.sharding.device_set
        self._entry = TowerEntry(
            program,
            name=PIXELS,
            checks=(self._check_pixels, alive(PIXELS), on_devices(weights, PIXELS)),
            fits=_padded,
            plan_cache_size=plan_cache_size,
        )
        self._calls = self._entry.calls  # repeated calls on device pixels

    def load_state(self, model: Glm4vVisionTower) -> None:
        """Takes the weights of `model` (e.g. after `nnx.update`) without recompiling.

        Raises:
          ValueError: a different structure, shape, dtype or placement (build a new encoder).
        """
        self.program.load_state(model)
        self._table = model.embeddings.position_embedding[...]

    @property
    def program(self) -> jaxsync.TowerProgram:
        """The compiled forward over the tower's state leaves (`.leaves`, `.num_state_args`)."""
        return self._entry.program

    def plan(self, grid_thw, num_patches: int | None = None) -> Glm4vPlan:
        """The host plan of a batch with this encoder's buckets and layout (validates
        `grid_thw`)."""
        return _plan.plan(
            grid_thw,
            self.cfg,
            buckets=self.buckets,
            layout=self.layout,
            devices=self.devices,
            num_patches=num_patches,
        )

    def _planned(self, grid_thw, num_patches: int | None, placement):
        """(plan key, plan build): plans are cached per grid content, patches and placement.

        A grid of Python ints or a numpy array is keyed as given (a repeated call costs the
        key, not the checks); other host types are validated first and keyed as int64.
        """
        key = jaxsync.metadata_key(grid_thw)
        if key is None:
            grid_thw = check_grid(grid_thw, self.cfg.spatial_merge_size)
            key = jaxsync.metadata_key(grid_thw)

        def build():
            return self.plan(grid_thw, num_patches)  # validates the grid

        return (key, num_patches, placement), build

    def _device_placement(self, pixels: jax.Array):
        """Uploads beside checked device pixels (replicated over their mesh)."""
        if isinstance(pixels, jax.core.Tracer):  # traced by a checker: placement is the jit's
            return self.placement
        sharding = pixels.sharding
        if isinstance(sharding, NamedSharding):
            return NamedSharding(sharding.mesh, PartitionSpec())
        have = sharding.device_set
        return next(iter(have)) if len(have) == 1 else self.placement

    @reads("type", "shape", "dtype")
    def _check_pixels(self, pixel_values) -> None:
        shape, dtype = pixel_values.shape, np.dtype(pixel_values.dtype)
        if len(shape) != 2 or shape[1] != self.cfg.patch_dim:
            raise ValueError(f"pixel_values must be [P, {self.cfg.patch_dim}], got {shape}")
        if not np.issubdtype(dtype, np.floating) and dtype != np.dtype(self.dtype):
            raise TypeError(f"pixel_values must be floating point, got {dtype}")

    @entry_point
    def __call__(self, pixel_values, image_grid_thw) -> jaxsync.Embeddings:
        """Encodes a packed batch of images and videos (the image processor's outputs).

        Args:
          pixel_values: [sum(t*h*w), C*T*p*p] flattened patches in merge-block order, as the HF
            image processor emits them (numpy or a torch CPU tensor), or a device array already
            padded to the bucket (`plan(...).padded_patches` rows, zeros past the real ones).
          image_grid_thw: [B, 3] host (t, h, w) per item, in patches (numpy, list, torch CPU).

        Returns:
          `jaxsync.Embeddings`, `Embeddings.of(forward(...), plan)`: merged tokens
          [G_bucket, out_hidden_size] (item i at `offsets[i]`, `lengths[i]` = t*h*w / m^2 rows),
          extras "hidden" (the same rows before the patch merger; with `encoder_only` those are
          the rows and there is no "hidden") and "finite" (bool [I_bucket]: entry i < B is True
          when every output of item i is finite; computed on device, never read back).

        Raises:
          TypeError: non-integer or device `image_grid_thw`, non-float pixels.
          ValueError: empty batch, bad shapes, h/w not multiples of the merge size, a patch
            count that does not match the grid, non-finite host pixels, or device pixels away
            from the weights or not padded to the bucket; all before any upload or compile.
        """
        run, key = self._calls.find(pixel_values, image_grid_thw)
        if run is not None:
            return run(pixel_values)
        entry = self._entry
        if not isinstance(pixel_values, jax.Array):
            pixels = jaxsync.host_array(pixel_values, name=PIXELS)
            self._check_pixels(pixels)
            plan_key, build = self._planned(image_grid_thw, pixels.shape[0], self.placement)
            shape = lambda plan: (plan.padded_patches, self.cfg.patch_dim)  # noqa: E731
            return entry.host(
                pixels, plan_key, build, self.placement, shape=shape, dtype=self.dtype
            )
        entry.check(pixel_values)
        placement = self._device_placement(pixel_values)
        plan_key, build = self._planned(image_grid_thw, None, placement)
        return entry.device(pixel_values, key, entry.planned(plan_key, build, placement))

    def lower(self, pixels: jax.Array, meta: jaxsync.Packed) -> Any:
        """`jax.jit(...).lower` of the tower program (argument counts, HLO, cost analysis)."""
        return self.program.lower(pixels, meta)

    @entry_point
    def pos_embeds(self, image_grid_thw) -> jax.Array:
        """Interpolated position embeddings of a batch alone: [P_bucket, D] in the model dtype
        (upstream's `pos_embeds_interpolate`); rows >= sum(t*h*w) are padding."""
        key, build = self._planned(image_grid_thw, None, self.placement)
        return _pos_program(self._table, self._entry.planned(key, build, self.placement).meta)


@reads("shape", "metadata")
def _padded(pixels: jax.Array, plan: Glm4vPlan) -> None:
    """Device pixels come padded to the plan's patch bucket (zeros past the real ones)."""
    if pixels.shape[0] != plan.padded_patches:
        raise ValueError(
            f"a device pixel array must already be padded to the bucket: "
            f"{plan.padded_patches} rows, got {pixels.shape[0]}"
        )
