"""Host entry of the Gemma 3n audio path: validation, cached plan, one upload, one dispatch.

Host metadata (the frame mask, frame count, placeholder positions) is validated on the host
before anything is dispatched; device data is never read back.
"""

import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

import jaxsync
from jaxsync.check import entry_point
from jaxsync.models._merge import scatter_rows
from jaxsync.models.gemma3n._config import Gemma3nAudioConfig
from jaxsync.models.gemma3n._modules import Gemma3nAudioModel, forward
from jaxsync.models.gemma3n._plan import (
    FEATURES,
    AudioTruncationWarning,
    check_host_finite,
    frame_mask,
    host_clips,
    host_features,
    plan_audio,
    stage_features,
)


__all__ = ["Gemma3nAudioEncoder", "merge_audio_embeddings"]


def _devices(placement: jax.Device | jax.sharding.Sharding) -> frozenset:
    if isinstance(placement, jax.Device):
        return frozenset((placement,))
    return frozenset(placement.device_set)


class Gemma3nAudioEncoder:
    """Audio features -> `soft_tokens` embedding rows per clip, on the device.

    A call is host validation, a cached plan (frame mask and count, uploaded once per distinct
    mask), one upload of host features, and one dispatch of `jaxsync.TowerProgram` over
    `forward`. The padding token's embedding is computed once per weights and placement and
    cached on the device. The entry snapshots the model's weights: after `nnx.update`, call
    `load_state(model)` (no recompile).

    Overflow (more than `soft_tokens` tower positions, i.e. more than ~30 s at the released
    config) follows `cfg.overflow`: "error" raises `ValueError` like transformers; "truncate"
    keeps the first `soft_tokens` like vLLM and emits an `AudioTruncationWarning` naming the
    clips that lose real (non-padding) positions.

    Args:
        model: the loaded `Gemma3nAudioModel`.
        cfg: its config.
        frame_buckets: an int G rounds host frames up to a multiple of G; a sequence lists them.
        batch_buckets: clip-count buckets for host features; default powers of two.
        placement: where host features go (a device, or a sharding such as
            `NamedSharding(mesh, P("data"))` for data-parallel clips); default: next to the
            weights. Device features stay where they are.
        plan_cache_size: distinct (mask, placement) plans kept.
    """

    def __init__(
        self,
        model: Gemma3nAudioModel,
        cfg: Gemma3nAudioConfig,
        *,
        frame_buckets: int | Sequence[int] = 512,
        batch_buckets: Sequence[int] | None = None,
        placement: Any = None,
        plan_cache_size: int = 64,
    ):
        self.cfg = cfg
        self.frame_buckets = (
            tuple(jaxsync.host_ints(frame_buckets, name="frame_buckets", minimum=1).tolist())
            if isinstance(frame_buckets, Sequence | np.ndarray)
            else jaxsync.host_int(frame_buckets, name="frame_buckets", minimum=1)
        )
        self.batch_buckets = (
            None
            if batch_buckets is None
            else tuple(jaxsync.host_ints(batch_buckets, name="batch_buckets", minimum=1).tolist())
        )
        self.program = jaxsync.TowerProgram(model, forward)
        # The padding embedding needs the embedder only: its state as plain jit arguments.
        graphdef = nnx.split(model.embed_audio)[0]
        pad_id, dtype = model.pad_id, model.dtype

        def pad_fn(state):
            ids = jax.numpy.full((1,), pad_id, jax.numpy.int32)
            return nnx.merge(graphdef, state).embed_ids(ids)[0].astype(dtype)

        self._pad_fn = jax.jit(pad_fn)
        self.plans: jaxsync.PlanCache = jaxsync.PlanCache(plan_cache_size)
        self._calls = jaxsync.CallCache(plan_cache_size)  # repeated calls on device features
        self._take_weights(model)
        self.placement = self._home if placement is None else placement
        if _devices(self.placement) != self._devices:
            raise ValueError(
                f"placement uses devices {sorted(map(str, _devices(self.placement)))} but the "
                f"weights live on {sorted(map(str, self._devices))}"
            )

    def _take_weights(self, model: Gemma3nAudioModel) -> None:
        leaf = jax.tree.leaves(nnx.state(model))[0]
        self._home = jaxsync.replicated_near(leaf)
        self._devices = _devices(leaf.sharding)
        self._pad_state = nnx.split(model.embed_audio)[1]
        self._pads: dict[Any, jax.Array] = {}

    def load_state(self, model: Gemma3nAudioModel) -> None:
        """Takes new weights (same structure and placement) without recompiling."""
        self.program.load_state(model)
        self._take_weights(model)
        self._calls.clear()  # kept calls hold the old pad embedding

    def pad_embedding(self, placement: Any = None) -> jax.Array:
        """The padding token's embedding `[D]`, computed once per placement, then cached."""
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

    def _plan(self, key: Any, valid: Any, placement: Any, on_miss: Any = None, **buckets: Any):
        """(plan, uploaded meta, row layout) cached per mask content, placement and buckets;
        `valid()` gives the checked mask on a miss, after `on_miss()`."""

        def build():
            plan = plan_audio(valid(), self.cfg, **buckets)
            meta = jaxsync.upload_packed(plan.fields, placement=placement)
            return plan, meta, jaxsync.Embeddings.layout(plan.lengths, plan.offsets)

        key = (key, placement, tuple(sorted(buckets.items())))
        return self.plans.get(key, build, on_miss=on_miss)

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
            `jaxsync.Embeddings`: `[R, D]` rows, `soft_tokens` per clip in order, in the model
            dtype; `extras["finite"]` `[B]` bool (on the device) is False for a clip whose
            features or rows hold a NaN / inf (host features are refused instead).

        Raises:
            TypeError: non-float features, a non-integer mask, traced input.
            ValueError: mel bins, shapes, a clip without a real frame, non-finite host
                features, deleted or misplaced device features, or (overflow="error") more
                tower positions than `soft_tokens`.
        """
        run, call_key = self._calls.find(input_features, input_features_mask)
        if run is not None:
            return run(input_features)
        cfg = self.cfg
        if isinstance(input_features, jax.core.Tracer):
            raise TypeError(f"{FEATURES} is traced: inside a jit call `forward` directly")
        on_device = isinstance(input_features, jax.Array)
        if on_device:
            feats, mask = input_features, input_features_mask
            self._check_device(feats)
            shape = feats.shape[:2]
            # Keyed by the mask's content (checked on a miss); other host types checked first.
            key = jaxsync.metadata_key(mask)
            if key is None:
                mask = frame_mask(mask, shape)
                key = jaxsync.metadata_key(mask)
            placement = jaxsync.replicated_near(feats)
            plan, meta, layout = self._plan(
                (key, shape), lambda: frame_mask(mask, shape), placement,
                frame_buckets=shape[1], batch_buckets=(shape[0],),
            )  # fmt: skip
        else:
            n_mel = cfg.input_feat_size
            if isinstance(input_features, list | tuple):  # clips go straight into the bucket
                host, valid = host_clips(input_features, input_features_mask, n_mel)
            else:
                host, valid = host_features(
                    input_features, input_features_mask, n_mel, check_finite=False
                )
            placement = self._meta_placement()
            buckets = dict(frame_buckets=self.frame_buckets, batch_buckets=self.batch_buckets)
            key = (valid.shape, valid.tobytes())
            # NaN / inf refused before a new plan's metadata goes up, or, on a known plan, as
            # the features are copied into their staging buffer (one pass over them).
            plan, meta, layout = self._plan(
                key, lambda: valid, placement, lambda: check_host_finite(host), **buckets
            )
            feats = stage_features(host, (plan.batch, plan.frame_bucket, n_mel), self.placement)
        if not on_device:
            return self._embed(feats, plan, meta, layout, placement, stacklevel=4)
        if plan.truncation or plan.num_clips != plan.batch:
            run = jaxsync.prepared_call(  # the caller is 6 frames up: call, lambda, _embed
                lambda x: self._embed(x, plan, meta, layout, placement, stacklevel=6), FEATURES
            )
        else:  # the common case: the program and the output's assembly, nothing else
            finish = jaxsync.Embeddings.assembler(layout, ("finite",))
            pad = self.pad_embedding(placement)  # `load_state` drops the kept calls
            run = self.program.prepared(meta, pad, finish=finish, name=FEATURES)
        return self._calls.keep(call_key, run)(feats)

    def _embed(self, feats, plan, meta, layout, placement, stacklevel) -> jaxsync.Embeddings:
        if plan.truncation:  # stacklevel: the warning points at the caller's line
            warnings.warn(plan.truncation, AudioTruncationWarning, stacklevel=stacklevel)
        rows, finite = self.program(feats, meta, self.pad_embedding(placement))
        if plan.num_clips != plan.batch:
            finite = _head(finite, plan.num_clips)
        return jaxsync.Embeddings.from_layout(rows, layout, extras={"finite": finite})

    def _meta_placement(self) -> Any:
        p = self.placement
        if isinstance(p, jax.sharding.NamedSharding):
            return jax.sharding.NamedSharding(p.mesh, jax.P(), memory_kind="device")
        return p

    def _check_device(self, feats: jax.Array) -> None:
        if feats.is_deleted():
            raise ValueError(f"{FEATURES} is a deleted (donated) device array")
        if feats.ndim != 3 or feats.shape[2] != self.cfg.input_feat_size:
            raise ValueError(
                f"{FEATURES} must be [B, frames, {self.cfg.input_feat_size}], got {feats.shape}"
            )
        if not jax.numpy.issubdtype(feats.dtype, jax.numpy.floating):
            raise TypeError(f"{FEATURES} must be floating point, got {feats.dtype}")
        if _devices(feats.sharding) != self._devices:
            raise ValueError(
                f"{FEATURES} live on {sorted(map(str, feats.sharding.device_set))} but the "
                f"weights on {sorted(map(str, self._devices))}: put them on the same devices"
            )


# The first n entries; jitted with n static (an eager slice would upload its start index).
_head = jax.jit(lambda x, n: x[:n], static_argnums=1)


@jax.jit
def _scatter(text: jax.Array, rows: jax.Array, up: jaxsync.Packed) -> jax.Array:
    return scatter_rows(text, rows, up["positions"])


@entry_point
def merge_audio_embeddings(
    text_embeds: jax.Array, audio: jaxsync.Embeddings, input_ids: Any, *, audio_token_id: int
) -> jax.Array:
    """Writes audio embeddings into the text embeddings at the audio placeholder tokens.

    Same result as transformers' `masked_scatter(input_ids == audio_token_id, audio_features)`;
    the placeholder positions come from the host token ids, so nothing is read back.

    Args:
        text_embeds: `[..., T, D]` device embeddings of the prompt.
        audio: the encoder's `Embeddings` (its `num_tokens` rows fill the placeholders in order).
        input_ids: host token ids with the shape of `text_embeds[..., 0]`.
        audio_token_id: the placeholder id (`cfg.audio_token_id`).

    Raises:
        TypeError: non-integer ids or placeholder id.
        ValueError: shape mismatch, or placeholder count != `audio.num_tokens` (as transformers).
    """
    ids = jaxsync.host_ints(input_ids, name="input_ids", ndim=None, minimum=None)
    token = jaxsync.host_int(audio_token_id, name="audio_token_id")
    if ids.shape != tuple(text_embeds.shape[:-1]):
        raise ValueError(
            f"input_ids shape {ids.shape} != text_embeds shape[:-1] {tuple(text_embeds.shape[:-1])}"
        )
    rows = audio.embeddings
    if rows.ndim != 2 or rows.shape[1] != text_embeds.shape[-1]:
        raise ValueError(f"audio rows {rows.shape} do not fit text_embeds {text_embeds.shape}")
    pos = np.flatnonzero(ids.reshape(-1) == token)
    if pos.size != audio.num_tokens:
        raise ValueError(
            f"{pos.size} audio placeholder tokens but {audio.num_tokens} audio embeddings"
        )
    slots = np.full(rows.shape[0], ids.size, np.int32)
    slots[: pos.size] = pos
    up = jaxsync.upload_packed({"positions": slots}, placement=jaxsync.replicated_near(text_embeds))
    return _scatter(text_embeds, rows, up)
