"""Host entry of the Gemma 3n audio path: validation, cached plan, one upload, one dispatch.

Host metadata (the frame mask, frame count, placeholder positions) is validated on the host
before anything is dispatched; device data is never read back.
"""

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

import jaxsync
from jaxsync._calls import prepared_call, reads
from jaxsync._entry import Planned, TowerEntry, alive, devices_of, on_devices
from jaxsync._host import host_int, host_ints
from jaxsync._plans import metadata_key
from jaxsync.check import entry_point
from jaxsync.models._sharding import OutSharding, with_out_sharding
from jaxsync.models.gemma3n._forward import encode, forward
from jaxsync.models.gemma3n._inputs import (
    FEATURES,
    check_host_finite,
    frame_mask,
    host_clips,
    host_features,
    stage_features,
)
from jaxsync.models.gemma3n._modules import Gemma3nAudioModel
from jaxsync.models.gemma3n._plan import AudioTruncationWarning, Gemma3nBuckets, plan


__all__ = ["Gemma3nAudioEncoder"]


class Gemma3nAudioEncoder:
    """Audio features -> `soft_tokens` embedding rows per clip, on the device.

    A call is host validation, a cached plan (`gemma3n.plan`, uploaded once per distinct mask),
    one upload of host features, and one dispatch of `jaxsync.TowerProgram(model, forward)`: the
    function a server jits, over the state's leaves. The entry snapshots the model's weights:
    after `nnx.update`, call `load_state(model)` (no recompile).

    Overflow (more than `soft_tokens` tower positions, i.e. more than ~30 s at the released
    config) follows `cfg.overflow`: "error" raises `ValueError` like transformers; "truncate"
    keeps the first `soft_tokens` like vLLM and emits an `AudioTruncationWarning` naming the
    clips that lose real (non-padding) positions.

    Args:
        model: the loaded `Gemma3nAudioModel` (its `cfg` is the entry's).
        embed: True: the embedder's rows (`forward`); False: the audio tower's encodings
            `[*, D_a]` per clip, before the embedder (`encode`; no overflow policy).
        overflow: "error" or "truncate" in place of `model.cfg.overflow`; None keeps it.
        frame_buckets: frame buckets for host features: increasing sizes, or an int G (a
            multiple of G); default `gemma3n.FRAME_BUCKETS` (the released processor's shapes).
        batch_buckets: clip-count buckets for host features; default `gemma3n.CLIP_BUCKETS`.
        placement: where host features go (a device, or a sharding such as
            `NamedSharding(mesh, P("data"))` for data-parallel clips); default: next to the
            weights. Device features stay where they are.
        plan_cache_size: distinct (mask, placement) plans kept.
        out_sharding: where the rows go (`forward`'s option): None replicates them over the
            weights' mesh; a `PartitionSpec` over that mesh or a `Sharding` as the server asks.

    Attributes:
        cfg: the config the entry plans with.
        program: the `jaxsync.TowerProgram`.
    """

    def __init__(
        self,
        model: Gemma3nAudioModel,
        *,
        embed: bool = True,
        overflow: str | None = None,
        frame_buckets: int | Sequence[int] | None = None,
        batch_buckets: Sequence[int] | None = None,
        placement: Any = None,
        plan_cache_size: int = 64,
        out_sharding: OutSharding = None,
    ):
        cfg = model.cfg
        self.cfg = cfg if overflow is None else dataclasses.replace(cfg, overflow=overflow)
        self.embed = bool(embed)
        self.buckets = _buckets(frame_buckets, batch_buckets)
        program = jaxsync.TowerProgram(
            model, with_out_sharding(forward if self.embed else encode, out_sharding)
        )
        # The padding embedding needs the embedder only: its state as plain jit arguments.
        graphdef = nnx.split(model.embed_audio)[0]
        pad_id, dtype = model.pad_id, model.dtype

        def pad_fn(state):
            ids = jax.numpy.full((1,), pad_id, jax.numpy.int32)
            return nnx.merge(graphdef, state).embed_ids(ids)[0].astype(dtype)

        self._pad_fn = jax.jit(pad_fn)
        self._take_weights(model)
        self.placement = self._home if placement is None else placement
        if devices_of(self.placement) != self._devices:
            raise ValueError(
                f"placement uses devices {sorted(map(str, devices_of(self.placement)))} but the "
                f"weights live on {sorted(map(str, self._devices))}"
            )
        self._entry = TowerEntry(
            program,
            name=FEATURES,
            checks=(alive(FEATURES), self._check_device, on_devices(self._devices, FEATURES)),
            plan_cache_size=plan_cache_size,
        )
        self.program, self.plans = program, self._entry.plans
        self._calls = self._entry.calls  # repeated calls on device features

    def _take_weights(self, model: Gemma3nAudioModel) -> None:
        leaf = jax.tree.leaves(nnx.state(model))[0]
        self._home = jaxsync.replicated_near(leaf)
        self._devices = devices_of(leaf.sharding)
        self._pad_state = nnx.split(model.embed_audio)[1]
        self._pads: dict[Any, jax.Array] = {}

    def load_state(self, model: Gemma3nAudioModel) -> None:
        """Takes new weights (same structure and placement) without recompiling."""
        self.program.load_state(model)
        self._take_weights(model)
        self._calls.clear()

    def pad_embedding(self, placement: Any = None) -> jax.Array:
        """The padding token's embedding `[D]` (the rows `forward` puts at padded positions),
        computed once per weights and placement, then cached."""
        key = self._home if placement is None else placement
        hit = self._pads.get(key)
        if hit is not None:
            return hit
        pad = self._pad_fn(self._pad_state)  # async dispatch; nothing is read back
        if key != self._home and not isinstance(pad, jax.core.Tracer):
            pad = jax.device_put(pad, key)
        if not isinstance(pad, jax.core.Tracer):  # traced by a static scan: keep no tracer
            self._pads[key] = pad
        return pad

    def _plan(self, valid: Any, buckets: Gemma3nBuckets):
        return lambda: plan(valid(), self.cfg, buckets=buckets, embed=self.embed)

    @entry_point
    def __call__(self, input_features: Any, input_features_mask: Any = None) -> jaxsync.Embeddings:
        """Embeds a batch of clips.

        Args:
            input_features: transformers' `Gemma3nAudioFeatureExtractor` output `[B, S, F]`
                (numpy or torch CPU) with its `input_features_mask` `[B, S]` (True = real
                frame); a list of `[S_i, F]` clips (mask None = all real, or a list of `[S_i]`
                masks), zero padded to the longest like vLLM; or a device `[B, S, F]` array
                (already bucketed: used at its shape) with a host mask.

        Returns:
            `jaxsync.Embeddings.of(forward(...), plan)`: `[R, D]` rows, `soft_tokens` per clip
            in order (with `embed=False`: the tower's positions per clip, `[R, D_a]`), in the
            model dtype; `extras["finite"]` `[B_pad]` bool (on the device, clip i at entry i) is
            False for a clip whose features or rows hold a NaN / inf (host features are
            refused instead).

        Raises:
            TypeError: non-float features, a non-integer mask, traced input.
            ValueError: mel bins, shapes, a clip without a real frame, non-finite host
                features, deleted or misplaced device features, more frames or clips than the
                largest bucket, or (overflow="error") more tower positions than `soft_tokens`.
        """
        run, call_key = self._calls.find(input_features, input_features_mask)
        if run is not None:
            return run(input_features)
        if isinstance(input_features, jax.core.Tracer):
            raise TypeError(f"{FEATURES} is traced: inside a jit call `forward` directly")
        entry = self._entry
        if not isinstance(input_features, jax.Array):
            n_mel = self.cfg.input_feat_size
            if isinstance(input_features, list | tuple):  # clips go straight into the bucket
                host, valid = host_clips(input_features, input_features_mask, n_mel)
            else:
                host, valid = host_features(
                    input_features, input_features_mask, n_mel, check_finite=False
                )
            placement = self._meta_placement()
            key = ((valid.shape, valid.tobytes()), placement, self.buckets)
            # NaN / inf refused before a new plan's metadata goes up, or, on a known plan, as
            # the features are copied into their staging buffer (one pass over them).
            build = self._plan(lambda: valid, self.buckets)
            p = entry.planned(key, build, placement, on_miss=lambda: check_host_finite(host))
            shape = (p.plan.batch, p.plan.frame_bucket, n_mel)
            return self._embed(stage_features(host, shape, self.placement), p, stacklevel=4)
        entry.check(input_features)
        feats, mask = input_features, input_features_mask
        shape = feats.shape[:2]
        # Keyed by the mask's content (checked on a miss); other host types checked first.
        key = metadata_key(mask)
        if key is None:
            mask = frame_mask(mask, shape)
            key = metadata_key(mask)
        placement = jaxsync.replicated_near(feats)
        exact = Gemma3nBuckets(frames=(shape[1],), clips=(shape[0],))
        build = self._plan(lambda: frame_mask(mask, shape), exact)
        p = entry.planned(((key, shape), placement, exact), build, placement)
        if not p.plan.truncation:  # the common case: the program and the output's assembly
            return entry.device(feats, call_key, p)
        run = prepared_call(  # the caller is 6 frames up: call, lambda, _embed
            lambda x: self._embed(x, p, stacklevel=6), FEATURES
        )
        return self._calls.keep(call_key, run)(feats)

    def _embed(self, feats, p: Planned, stacklevel: int) -> jaxsync.Embeddings:
        if p.plan.truncation:  # stacklevel: the warning points at the caller's line
            warnings.warn(p.plan.truncation, AudioTruncationWarning, stacklevel=stacklevel)
        return p.finish(self.program(feats, p.meta))

    def _meta_placement(self) -> Any:
        p = self.placement
        if isinstance(p, jax.sharding.NamedSharding):
            return jax.sharding.NamedSharding(p.mesh, jax.P(), memory_kind="device")
        return p

    @reads("shape", "dtype")
    def _check_device(self, feats: jax.Array) -> None:
        if feats.ndim != 3 or feats.shape[2] != self.cfg.input_feat_size:
            raise ValueError(
                f"{FEATURES} must be [B, frames, {self.cfg.input_feat_size}], got {feats.shape}"
            )
        if not jax.numpy.issubdtype(feats.dtype, jax.numpy.floating):
            raise TypeError(f"{FEATURES} must be floating point, got {feats.dtype}")


def _buckets(frames: Any, clips: Any) -> Gemma3nBuckets:
    """The entry's bucket options, checked (ints >= 1); None takes the planner's default."""
    default = Gemma3nBuckets()
    if frames is None:
        frames = default.frames
    elif isinstance(frames, Sequence | np.ndarray):
        frames = tuple(host_ints(frames, name="frame_buckets", minimum=1).tolist())
    else:
        frames = host_int(frames, name="frame_buckets", minimum=1)
    if clips is None:
        return Gemma3nBuckets(frames, default.clips)
    return Gemma3nBuckets(frames, tuple(host_ints(clips, name="batch_buckets", minimum=1).tolist()))
