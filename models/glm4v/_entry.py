"""The host entry of the GLM-4.1V vision tower: validate, plan (cached), upload, one dispatch."""

from __future__ import annotations

import collections
import copy
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import jaxsync
from jaxsync.check import entry_point
from jaxsync.models.glm4v._modules import Glm4vVisionTower, forward, pos_embeds
from jaxsync.models.glm4v._plan import (
    AttentionLayout,
    VisionPlan,
    check_grid,
    plan_batch,
    resolve_layout,
)


# Compiled tower programs shared by every encoder of the same module structure, shapes, dtypes
# and placements: an encoder rebuilt per call (e.g. from a server's `(graphdef, state)`) reuses
# the compiled program and only repacks its weights. Each entry keeps the packed weights of the
# last encoder built for it alive.
_PROGRAMS: collections.OrderedDict[Any, jaxsync.TowerProgram] = collections.OrderedDict()
_PROGRAMS_LOCK = threading.Lock()
_MAX_PROGRAMS = 8
_pos_program = jax.jit(pos_embeds)


def _program_for(model: Glm4vVisionTower) -> jaxsync.TowerProgram:
    graphdef, state = nnx.split(model)
    key = (graphdef, tuple((x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(state)))
    with _PROGRAMS_LOCK:
        shared = _PROGRAMS.get(key)
    if shared is None:
        program = jaxsync.TowerProgram(model, forward)
    else:  # same compiled function, this model's weights
        program = copy.copy(shared)
        program.load_state(model)
    with _PROGRAMS_LOCK:
        _PROGRAMS[key] = program
        _PROGRAMS.move_to_end(key)
        while len(_PROGRAMS) > _MAX_PROGRAMS:
            _PROGRAMS.popitem(last=False)
    return program


def _home(table: jax.Array) -> jax.Device | jax.sharding.Sharding:
    """Where per-call uploads go by default: beside the weights (replicated over their mesh)."""
    sharding = table.sharding
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec())
    return next(iter(sharding.device_set))


PIXELS = "pixel_values"


class Glm4vVisionEncoder:
    """Host entry around a `Glm4vVisionTower`: host plan, one packed upload, one dispatch.

    Building one is cheap after the first of its kind: compiled programs are shared by every
    encoder of the same config, dtype and placement, so a server may rebuild the encoder from
    its `(graphdef, state)` per call. The encoder snapshots the weights: after `nnx.update` of
    the module, call `load_state(model)` (no recompile).

    Args:
      model: the tower (e.g. from `load_model`).
      group_buckets: buckets for the merged-token count (default `DEFAULT_GROUP_BUCKETS`).
      placement: device or sharding for host uploads (None: beside the weights).
      plan_cache_size: host plans (and their uploaded metadata) kept per `grid_thw` mix.
      attention_layout: how each image / frame attends only to itself:
        "ragged" (cuDNN's attention over the segments of the packed rows: work grows with the
        sum of per-image squares; GPU towers with cuDNN attention; one program per patch
        bucket and segment-slot bucket, 8 / 64 / 512 ... segments),
        "dense" (a [P, P] segment mask: work grows with the square of the batch's patches; any
        backend; one program per patch bucket),
        "segments" (images of similar size batched, each attending alone: work grows with the
        sum of per-image squares; any backend; one program per patch bucket and size mix),
        or "auto" (default: "ragged" for a tower on one device whose attention runs on cuDNN,
        else "dense").
        "ragged" on a tower without cuDNN attention computes the dense mask.

    Attributes:
      attention_layout: the layout in use ("auto" resolved).
    """

    def __init__(
        self,
        model: Glm4vVisionTower,
        *,
        group_buckets: Sequence[int] | None = None,
        placement=None,
        plan_cache_size: int = 64,
        attention_layout: AttentionLayout = "auto",
    ):
        if not isinstance(model, Glm4vVisionTower):
            raise TypeError(f"model must be a Glm4vVisionTower, got {type(model).__name__}")
        attention = model.blocks[0].attn.impl if len(model.blocks) else "xla"
        devices = len(model.post_layernorm.weight[...].sharding.device_set)
        self.attention_layout = resolve_layout(attention_layout, attention, devices)
        self.cfg = model.cfg
        self.dtype = model.dtype
        self.group_buckets = (
            None
            if group_buckets is None
            else tuple(jaxsync.host_int(b, name="group_buckets", minimum=1) for b in group_buckets)
        )
        self._program = _program_for(model)
        self._table = model.embeddings.position_embedding[...]
        self.placement = _home(self._table) if placement is None else placement
        self._plans: jaxsync.PlanCache = jaxsync.PlanCache(plan_cache_size)
        self._calls = jaxsync.CallCache(plan_cache_size)  # repeated calls on device pixels

    def load_state(self, model: Glm4vVisionTower) -> None:
        """Takes the weights of `model` (e.g. after `nnx.update`) without recompiling.

        Raises:
          ValueError: a different structure, shape, dtype or placement (build a new encoder).
        """
        self._program.load_state(model)
        self._table = model.embeddings.position_embedding[...]

    def plan(self, grid_thw, num_patches: int | None = None) -> VisionPlan:
        """The host plan of a batch (validates `grid_thw`)."""
        return plan_batch(
            grid_thw,
            self.cfg,
            num_patches=num_patches,
            group_buckets=self.group_buckets,
            attention_layout=self.attention_layout,
        )

    def _planned(self, grid_thw, num_patches: int | None, placement, on_miss=None):
        """(plan, uploaded meta, output row layout), cached per grid content and placement.

        A grid of Python ints or a numpy array is keyed as given (a repeated call costs the
        key, not the checks); other host types are validated first and keyed as int64.
        `on_miss` runs before a new plan is built (and its metadata uploaded).
        """
        key = jaxsync.metadata_key(grid_thw)
        if key is None:
            grid_thw = check_grid(grid_thw, self.cfg.spatial_merge_size)
            key = jaxsync.metadata_key(grid_thw)

        def build():
            plan = self.plan(grid_thw, num_patches)  # validates the grid
            meta = jaxsync.upload_packed(plan.fields, placement=placement)
            return plan, meta, jaxsync.Embeddings.layout(plan.tokens_per_item)

        return self._plans.get((key, num_patches, placement), build, on_miss=on_miss)

    def _device_placement(self, pixels: jax.Array):
        """Uploads beside device pixels; refuses pixels away from the weights."""
        if isinstance(pixels, jax.core.Tracer):  # traced by a checker: placement is the jit's
            return self.placement
        if pixels.is_deleted():
            raise ValueError("pixel_values is a deleted (donated) device array")
        have = pixels.sharding.device_set
        weights = self._table.sharding.device_set
        if have != weights:
            raise ValueError(
                f"pixel_values live on {sorted(d.id for d in have)} but the tower's weights on "
                f"{sorted(d.id for d in weights)}: put them on the same devices"
            )
        sharding = pixels.sharding
        if isinstance(sharding, NamedSharding):
            return NamedSharding(sharding.mesh, PartitionSpec())
        return next(iter(have)) if len(have) == 1 else self.placement

    def _host_pixels(self, pixel_values, plan: VisionPlan) -> jax.Array:
        shape = (plan.padded_patches, self.cfg.patch_dim)  # padding patches are zero pixels
        return jaxsync.default_staging.put(  # NaN / inf refused as they are copied
            pixel_values, shape, dtype=self.dtype, placement=self.placement, finite=PIXELS
        )

    def _check_pixels(self, pixel_values) -> tuple[Any, bool]:
        is_device = isinstance(pixel_values, jax.Array)
        if not is_device:
            pixel_values = jaxsync.host_array(pixel_values, name="pixel_values")
        shape, dtype = pixel_values.shape, np.dtype(pixel_values.dtype)
        if len(shape) != 2 or shape[1] != self.cfg.patch_dim:
            raise ValueError(f"pixel_values must be [P, {self.cfg.patch_dim}], got {shape}")
        if not np.issubdtype(dtype, np.floating) and dtype != np.dtype(self.dtype):
            raise TypeError(f"pixel_values must be floating point, got {dtype}")
        return pixel_values, is_device

    @entry_point
    def __call__(self, pixel_values, image_grid_thw) -> jaxsync.Embeddings:
        """Encodes a packed batch of images and videos (the image processor's outputs).

        Args:
          pixel_values: [sum(t*h*w), C*T*p*p] flattened patches in merge-block order, as the HF
            image processor emits them (numpy or a torch CPU tensor), or a device array already
            padded to the bucket (`plan(...).padded_patches` rows, zeros past the real ones).
          image_grid_thw: [B, 3] host (t, h, w) per item, in patches (numpy, list, torch CPU).

        Returns:
          `jaxsync.Embeddings`: merged tokens [G_bucket, out_hidden_size] (item i at
          `offsets[i]`, `lengths[i]` = t*h*w / m^2 rows), extras "hidden" (the same rows before
          the patch merger) and "finite" (bool [G_bucket]: entry i < B is True when every
          output of item i is finite; computed on device, never read back).

        Raises:
          TypeError: non-integer or device `image_grid_thw`, non-float pixels.
          ValueError: empty batch, bad shapes, h/w not multiples of the merge size, a patch
            count that does not match the grid, non-finite host pixels, or device pixels away
            from the weights or not padded to the bucket; all before any upload or compile.
        """
        run, key = self._calls.find(pixel_values, image_grid_thw)
        if run is not None:
            return run(pixel_values)
        pixels, is_device = self._check_pixels(pixel_values)
        if not is_device:  # finite: checked before a new plan's upload, or while staged
            check = lambda: jaxsync.check_finite(pixels, name=PIXELS)  # noqa: E731
            plan, meta, layout = self._planned(
                image_grid_thw, pixels.shape[0], self.placement, on_miss=check
            )
            return self._encode(self._host_pixels(pixels, plan), meta, layout)
        placement = self._device_placement(pixels)
        plan, meta, layout = self._planned(image_grid_thw, None, placement)
        if pixels.shape[0] != plan.padded_patches:
            raise ValueError(
                f"a device pixel array must already be padded to the bucket: "
                f"{plan.padded_patches} rows, got {pixels.shape[0]}"
            )
        finish = jaxsync.Embeddings.assembler(layout, ("hidden", "finite"))
        run = self._program.prepared(meta, finish=finish, name="pixel_values")
        return self._calls.keep(key, run)(pixels)

    def _encode(self, pixels: jax.Array, meta: jaxsync.Packed, layout) -> jaxsync.Embeddings:
        merged, hidden, finite = self._program(pixels, meta)
        return jaxsync.Embeddings.from_layout(
            merged, layout, extras={"hidden": hidden, "finite": finite}
        )

    def lower(self, pixels: jax.Array, meta: jaxsync.Packed):
        """`jax.jit(...).lower` of the tower program (argument counts, HLO, cost analysis)."""
        return self._program.lower(pixels, meta)

    @entry_point
    def pos_embeds(self, image_grid_thw) -> jax.Array:
        """Interpolated position embeddings of a batch alone: [P_bucket, D] in the model dtype
        (upstream's `pos_embeds_interpolate`); rows >= sum(t*h*w) are padding."""
        _, meta, _ = self._planned(image_grid_thw, None, self.placement)
        return _pos_program(self._table, meta)
