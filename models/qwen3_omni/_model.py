# ruff: noqa: F722 - jaxtyping shape strings are not forward references
"""Host entry point: validate and plan on the host, one packed upload, one jitted program."""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float

import jaxsync
from jaxsync.check import entry_point
from jaxsync.models.qwen3_omni._config import TOKENS_PER_FULL_CHUNK, Qwen3OmniAudioConfig
from jaxsync.models.qwen3_omni._modules import Qwen3OmniAudioTower, sinusoid_table
from jaxsync.models.qwen3_omni._plan import (
    ChunkPlan,
    check_feature_lens,
    frame_bucket,
    plan_chunks,
)


@jax.tree_util.register_pytree_node_class
class AudioEmbeddings:
    """Encoder output: padded device rows plus host-side per-audio lengths.

    Attributes:
      embeddings: [R, O] device array; rows `offsets[a] : offsets[a] + lengths[a]` belong to
        audio `a` (audios in input order, contiguous), rows past the last audio are zero.
      lengths: per-audio token counts (host ints; 0 for an empty audio).
      offsets: per-audio first row (host ints).
    """

    __slots__ = ("embeddings", "lengths", "offsets")  # built per call: no instance dict

    def __init__(self, embeddings: jax.Array, lengths: tuple[int, ...], offsets: tuple[int, ...]):
        self.embeddings = embeddings
        self.lengths = lengths
        self.offsets = offsets

    def tree_flatten(self):
        return (self.embeddings,), (self.lengths, self.offsets)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    @property
    def num_tokens(self) -> int:
        """Real rows (all audios)."""
        return int(sum(self.lengths))

    def split(self) -> list[jax.Array]:
        """Per-audio device slices `[lengths[a], O]` (no device->host read).

        Each distinct (offset, length) is a small slice program of its own; consumers that scatter
        all audio tokens at once should use `embeddings[:num_tokens]` or the padded rows instead.
        """
        return [self.embeddings[o : o + n] for o, n in zip(self.offsets, self.lengths, strict=True)]


PLAN_CACHE_SIZE = 64
"""Length mixes whose plan and uploaded metadata an `AudioEncoder` keeps (least recently used)."""


class _Planned(NamedTuple):
    """What `AudioEncoder` keeps per length mix: all a repeated call needs besides dispatch."""

    plan: ChunkPlan
    meta: jaxsync.Packed  # the plan's device fields, uploaded
    tokens: tuple[int, ...]  # output tokens per audio
    offsets: tuple[int, ...]  # each audio's first row in the embeddings


class AudioEncoder:
    """Sync-free Qwen3-Omni audio encoder: host lengths in, device embeddings out.

    Args:
      tower: the NNX module (e.g. from `load_audio_encoder`).
      placement: device or sharding for the per-call uploads (metadata, host features).
      window_buckets: attention-window counts to compile for (default `WINDOW_BUCKETS`, about
        four sizes per octave); coarser buckets mean fewer programs and more padding.
      scan_layers: keep the layers' weights stacked [L, ...] and run them with `jax.lax.scan`
        (`jaxsync.split_layers`); the default. The program takes ~1/L of the state arguments
        (released size: 29 instead of 525) and traces one layer instead of L. Measured on an
        H200 (2026-11-29, released size, 4 audios): host-blocked 2.8 ms instead of 5.2 ms
        (0.2 ms of jit dispatch under the TFRT GPU client), device time 10.9 ms instead of
        9.7 ms. False keeps one array per layer weight (the lowest device time). The encoder
        keeps only the stacked copy: construction briefly holds both until the caller drops
        `tower`.
      pack_weights: pass the state as one buffer per dtype instead of ~29 arrays (jit dispatch
        costs ~3 us per argument under the TFRT GPU client). "rows" (what "auto", the default,
        picks with `scan_layers`): one [L + k, S] buffer per dtype, row l holding layer l's
        weights and the last k rows the other leaves (`jaxsync.PackedTower`); the scan slices
        one row per layer as it slices stacked leaves, so device time does not move. "flat":
        every leaf in one flat buffer per dtype (XLA copies the weights out of it first: +7%
        device time). None: one argument per leaf. The position table is a compile-time
        constant, so a call passes the state, the features and the metadata: 3 arguments with
        "rows" at one dtype. H200, released size, TFRT client (2026-11-29, docs/benchmarks.md):
        host-blocked 0.11-0.13 ms "rows", 0.09-0.14 "flat", 0.16-0.28 None; device time
        10.58-10.67 / 11.42-11.70 / 10.76-10.98 ms. Bit-identical outputs. Construction
        briefly holds the packed weights twice.

    Usage: `AudioEncoder(load_audio_encoder(cfg, ckpt))(features, [310, 0, 99])`.
    """

    def __init__(
        self,
        tower: Qwen3OmniAudioTower,
        *,
        placement: Any = None,
        window_buckets: Sequence[int] | None = None,
        scan_layers: bool = True,
        pack_weights: Literal["auto", "rows", "flat"] | None = "auto",
    ):
        if pack_weights not in ("auto", "rows", "flat", None):  # before any work on the weights
            raise ValueError(
                f"pack_weights must be 'auto', 'rows', 'flat' or None, got {pack_weights!r}"
            )
        if pack_weights == "rows" and not scan_layers:
            raise ValueError("pack_weights='rows' packs stacked layers: it needs scan_layers=True")
        if pack_weights == "auto":
            pack_weights = "rows" if scan_layers else None
        self.pack_weights = pack_weights
        self.cfg: Qwen3OmniAudioConfig = tower.cfg
        self.placement = placement
        self.window_buckets = None if window_buckets is None else tuple(window_buckets)
        self.scan_layers = scan_layers
        # The NNX state is flattened once: flattening it per call walks every Variable in Python
        # (about 1 us per leaf, over 500 leaves at the released size), a list of arrays is not.
        # With scan_layers the list is the non-layer leaves, then the stacked layer leaves.
        if scan_layers:
            graphdef, state, layer_graphdef, layer_state = jaxsync.split_layers(tower)
        else:
            (graphdef, state), layer_graphdef, layer_state = nnx.split(tower), None, []
        layer_leaves, layer_treedef = jax.tree_util.tree_flatten(layer_state)
        self._leaves, merge = jaxsync.flat_state(graphdef, state)
        num_own = self._num_own = len(self._leaves)
        self._leaves += layer_leaves

        # The position table is a compile-time constant: one jit argument fewer per call.
        table = sinusoid_table(TOKENS_PER_FULL_CHUNK, self.cfg.d_model)

        def run(own, layer_xs, unpack, features, meta):
            module = merge(own)
            positions = jnp.asarray(table)
            if not scan_layers:
                return module(features, positions, meta)
            x = module.embed(features, positions, meta)
            x = jaxsync.scan_layers(layer_graphdef, layer_xs, x, meta["window_lens"], unpack=unpack)
            return module.head(x, meta)

        def layer_tree(layer_leaves):
            return jax.tree_util.tree_unflatten(layer_treedef, layer_leaves)

        # `_leaves` are the jitted program's state arguments: the leaves, or their packed buffers.
        if pack_weights == "rows":  # one [L + k, S] buffer per dtype: layer rows, then the rest
            tower_pack = jaxsync.PackedTower(self._leaves[:num_own], self._leaves[num_own:])
            self._leaves = tower_pack.buffers
            steps = tower_pack.num_layers

            def forward(bufs, *args):
                # Scanning layer indices over the whole buffer slices one row per step; scanning
                # a [:L] slice of it would copy every layer's weights first.
                unpack = lambda i: layer_tree(tower_pack.layer(bufs, i))  # noqa: E731
                return run(tower_pack.own(bufs), jnp.arange(steps), unpack, *args)

        elif pack_weights == "flat":
            pack = jaxsync.PackedLeaves(self._leaves)
            self._leaves = pack.buffers

            def forward(bufs, *args):
                leaves = pack.unpack(bufs)
                return run(leaves[:num_own], leaves[num_own:], layer_tree, *args)

        else:

            def forward(leaves, *args):
                return run(leaves[:num_own], leaves[num_own:], layer_tree, *args)

        self._jitted = jax.jit(forward)
        # Servers see the same length mixes again (fixed windows, retried requests): planning and
        # the packed upload cost ~0.9 ms of host time on an H200 host, a dictionary hit ~2 us.
        self._plans: collections.OrderedDict[tuple, _Planned] = collections.OrderedDict()
        self._plans_lock = threading.Lock()

    def _forward(self, features: jax.Array, meta: jaxsync.Packed):
        return self._jitted(self._leaves, features, meta)

    def plan(self, features_shape: Sequence[int], feature_lens: Any) -> ChunkPlan:
        """Validates shapes and lengths on the host and plans the batch (no device work).

        Raises:
          ValueError / TypeError: wrong rank or mel-bin count, invalid lengths, or a frame count
            that is neither `sum(feature_lens)` nor `frame_bucket` of it.
        """
        if len(features_shape) != 2:
            raise ValueError(f"features must be [num_mel_bins, frames], got shape {features_shape}")
        if features_shape[0] != self.cfg.num_mel_bins:
            raise ValueError(
                f"features have {features_shape[0]} mel bins, the encoder expects "
                f"{self.cfg.num_mel_bins} (shape must be [num_mel_bins, frames])"
            )
        return plan_chunks(
            feature_lens, self.cfg, num_frames=features_shape[1], window_buckets=self.window_buckets
        )

    def _planned(self, shape: tuple[int, ...], feature_lens: Any) -> _Planned:
        """`plan()` and its packed device upload, memoised per exact (shape, lengths) input.

        The key holds the lengths as a tuple of Python ints. A list or tuple of ints (what a
        server passes) becomes it without numpy: one call's host time is mostly cold Python,
        and numpy's checks made a cached lookup 4x slower (0.09 against 0.025 ms, CPU CI
        machine). Other lengths pass the type checks first (device data, floats, wrong rank
        raise before any lookup). Failed plans are not cached, so a cached key is a valid
        input; `type(n) is int` keeps floats and bools (equal to ints, same hash) off it.
        """
        if type(feature_lens) in (list, tuple) and all(type(n) is int for n in feature_lens):
            key = (shape, tuple(feature_lens))
        else:
            key = (shape, tuple(check_feature_lens(feature_lens).tolist()))  # the same key
        hit = self._plans.get(key)  # one C call each, atomic: the hit path takes no lock
        if hit is not None:
            try:
                self._plans.move_to_end(key)
            except KeyError:  # evicted by another thread meanwhile: still a valid plan
                pass
            return hit
        plan = self.plan(shape, feature_lens)
        meta = jaxsync.upload_packed(plan.device_fields(), placement=self.placement)
        tokens = tuple(int(n) for n in plan.audio_tokens)
        offsets = tuple(int(o) for o in plan.audio_offsets)
        planned = _Planned(plan, meta, tokens, offsets)
        traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(meta))
        if not traced:  # a static scan traces through here: keep nothing from a trace
            with self._plans_lock:
                self._plans[key] = planned
                while len(self._plans) > PLAN_CACHE_SIZE:
                    self._plans.popitem(last=False)
        return planned

    @entry_point
    def __call__(
        self, features: Float[Array, "F T"] | np.ndarray, feature_lens: Sequence[int] | np.ndarray
    ) -> AudioEmbeddings:
        """Encodes a batch of audios.

        Args:
          features: [num_mel_bins, T] log-mel features of all audios concatenated in time
            (upstream's layout). T is `sum(feature_lens)`, or `frame_bucket(sum)` with zero (or
            any) padding at the end so that many batches share one compiled program. Host numpy
            is uploaded explicitly.
          feature_lens: host mel-frame count per audio; 0 gives an empty output for that audio.

        Returns:
          `AudioEmbeddings` with `W * window_tokens` rows (W = window bucket).
        """
        planned = self._planned(features.shape, feature_lens)  # numpy and jax shapes are tuples
        if not isinstance(features, jax.Array):
            features = jaxsync.async_h2d(np.asarray(features, np.float32), placement=self.placement)
        out = self._jitted(self._leaves, features, planned.meta)
        return AudioEmbeddings(out, planned.tokens, planned.offsets)


def pad_features(features: np.ndarray, feature_lens: Any) -> np.ndarray:
    """Host helper: zero-pads [F, sum(lens)] features to [F, frame_bucket(sum(lens))]."""
    total = int(np.sum(np.asarray(feature_lens, np.int64)))
    if features.shape[-1] != total:
        raise ValueError(f"features have {features.shape[-1]} frames, feature_lens sum to {total}")
    out = np.zeros((features.shape[0], frame_bucket(total)), np.float32)
    out[:, :total] = features
    return out
