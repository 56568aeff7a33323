# ruff: noqa: F722 - jaxtyping shape strings are not forward references
"""Host entry point: validate and plan on the host, one packed upload, one compiled program."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from jaxtyping import Array, Float

import jaxsync
from jaxsync._encoder import TowerEncoder, expect
from jaxsync._entry import alive
from jaxsync._out_sharding import OutSharding
from jaxsync.check import entry_point
from jaxsync.models.qwen3_omni._features import call_inputs, check_dtype
from jaxsync.models.qwen3_omni._modules import Qwen3OmniAudioTower, forward
from jaxsync.models.qwen3_omni._plan import (
    Qwen3OmniBuckets,
    Qwen3OmniPlan,
    entry_buckets,
    lengths_planner,
    plan_features,
)
from jaxsync.models.qwen3_omni._weights import load_model


FEATURES = "features"


class Qwen3OmniAudioEncoder(TowerEncoder):
    """Sync-free Qwen3-Omni audio encoder: host lengths in, device embeddings out, in one
    dispatch of `jaxsync.TowerProgram(tower, forward)` (see `TowerEncoder`). No projector follows
    this encoder (`proj1` and `proj2` are its own last layers), so it has no encoder-only option.

    Args:
      model: the `Qwen3OmniAudioTower` (e.g. from `load_model`).
      buckets: the sizes programs are compiled for (`Qwen3OmniBuckets`; default: frames,
        windows and items at about four sizes per octave, items from 16).
      window_buckets: attention-window counts alone (replaces `buckets.windows`); coarser
        buckets mean fewer programs and more padding.
      placement, plan_cache_size, out_sharding: as `TowerEncoder`'s.

    Usage: `Qwen3OmniAudioEncoder(load_model(ckpt))(features, [310, 0, 99])`, or with the
    processor's outputs: `encoder(input_features=..., feature_attention_mask=...)`.
    """

    load_model = staticmethod(load_model)

    def __init__(
        self,
        model: Qwen3OmniAudioTower,
        *,
        placement: Any = None,
        buckets: Qwen3OmniBuckets | None = None,
        window_buckets: Sequence[int] | None = None,
        plan_cache_size: int = 64,
        out_sharding: OutSharding = None,
    ):
        expect(model, Qwen3OmniAudioTower)
        self.buckets = entry_buckets(buckets, window_buckets)
        super().__init__(model, forward, name=FEATURES, inside=FEATURES,
                         checks=(alive(FEATURES), check_dtype), placement=placement,
                         out_sharding=out_sharding, plan_cache_size=plan_cache_size,
                         plan_of=lambda lens: lengths_planner(lens, self.cfg, self.buckets),
                         dtype=np.float32)  # fmt: skip

    def plan(self, features_shape: Sequence[int], feature_lens: Any) -> Qwen3OmniPlan:
        """Validates shapes and lengths on the host and plans the batch (no device work).

        Raises:
          ValueError / TypeError: wrong rank or mel-bin count, invalid lengths, or a frame count
            that is neither `sum(feature_lens)` nor its frame bucket.
        """
        return plan_features(features_shape, feature_lens, self.cfg, self.buckets)

    @entry_point
    def __call__(
        self,
        features: Float[Array, "F T"] | np.ndarray | None = None,
        feature_lens: Sequence[int] | np.ndarray | None = None,
        *,
        input_features: Any = None,
        feature_attention_mask: Any = None,
    ) -> jaxsync.Embeddings:
        """Encodes a batch of audios.

        Args:
          features: [num_mel_bins, T] log-mel features of all audios concatenated in time
            (upstream's layout). T is `sum(feature_lens)`, or `frame_bucket(sum)` with any
            padding at the end so that many batches share one compiled program. A device array,
            or host data (numpy, torch CPU tensor), which must be finite and is uploaded.
          feature_lens: host mel-frame count per audio; 0 gives an empty output for that audio.
          input_features: instead of the two above, the processor's [B, F, T] padded features
            (numpy or torch CPU), with
          feature_attention_mask: its [B, T] 0/1 frame mask.

        Returns:
          `jaxsync.Embeddings.of(forward(...), plan)`: `W * window_tokens` rows (W = window
          bucket), audio a's at `offsets[a]`, and `finite`: [I] bool on the device (I = item
          bucket), False at entry a when audio a's frames hold a NaN or inf (other audios' rows
          never depend on it); entries past the audios are True.

        Raises:
          TypeError / ValueError: bad arguments, shapes, dtypes, lengths, placements or
            non-finite host features, before any upload or compile.
        """
        direct = features is not None and feature_lens is not None
        if direct and input_features is None and feature_attention_mask is None:
            return self._entry(features, feature_lens)  # repeated: the call it kept
        features, feature_lens, name = call_inputs(
            features, feature_lens, input_features, feature_attention_mask
        )
        return self._entry.run(features, None, self._entry.plan_of(feature_lens), name=name)
