# ruff: noqa: F722 - jaxtyping shape strings are not forward references
"""Host entry point: validate and plan on the host, one packed upload, one compiled program."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

import jaxsync
from jaxsync._calls import reads
from jaxsync._entry import Planned, TowerEntry, alive
from jaxsync._host import host_array, host_ints
from jaxsync.check import entry_point
from jaxsync.models._sharding import OutSharding, check_placement, with_out_sharding
from jaxsync.models.qwen3_omni._config import Qwen3OmniAudioConfig
from jaxsync.models.qwen3_omni._features import check_feature_lens, features_from_processor
from jaxsync.models.qwen3_omni._modules import Qwen3OmniAudioTower, forward
from jaxsync.models.qwen3_omni._plan import Qwen3OmniBuckets, Qwen3OmniPlan, plan


FEATURES = "features"


def _devices(sharding: jax.sharding.Sharding) -> list[str]:
    return sorted(str(d) for d in sharding.device_set)


class Qwen3OmniAudioEncoder:
    """Sync-free Qwen3-Omni audio encoder: host lengths in, device embeddings out.

    A call validates and plans on the host (`plan`, cached per length mix with its one packed
    upload), uploads host features, and dispatches `jaxsync.TowerProgram(tower, forward)`: the
    very function a server jits, `forward(nnx.merge(state leaves), features, meta)`, so the two
    forms give the same rows. The layers are one `jaxsync.LayerStack`, so the program's state
    arguments (one per weight kind) do not grow with depth.

    The config is the tower's (`tower.cfg`). No projector follows this encoder (`proj1` and
    `proj2` are upstream's encoder's own last layers), so it has no encoder-only option.

    The encoder reads the tower's weights when built: after `nnx.update` of the tower, call
    `load_state(tower)` (no recompile).

    Args:
      model: the `Qwen3OmniAudioTower` (e.g. from `load_model`).
      placement: device or sharding for the per-call uploads; None puts them next to device
        features, or next to the weights (replicated over their mesh) for host features. One
        on other devices than the weights is refused.
      buckets: the sizes programs are compiled for (`Qwen3OmniBuckets`; default: frames,
        windows and items at about four sizes per octave, items from 16).
      window_buckets: attention-window counts alone (replaces `buckets.windows`); coarser
        buckets mean fewer programs and more padding.
      plan_cache_size: length mixes whose plan and uploads are kept (least recently used).
      out_sharding: where the rows go (`forward`'s option): None replicates them over the
        weights' mesh; a `PartitionSpec` over that mesh or a `Sharding` as the server asks.

    Attributes:
      program: the `jaxsync.TowerProgram` (`program.lower(features, meta)` for inspection).
      plans: the `jaxsync.PlanCache` of plans and their uploads (`len()`, `clear()`).

    Usage: `Qwen3OmniAudioEncoder(load_model(ckpt))(features, [310, 0, 99])`, or with the
    processor's outputs: `encoder(input_features=..., feature_attention_mask=...)`.
    """

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
        if not isinstance(model, Qwen3OmniAudioTower):
            raise TypeError(f"model must be a Qwen3OmniAudioTower, got {type(model).__name__}")
        if placement is not None and not isinstance(placement, jax.Device | jax.sharding.Sharding):
            raise TypeError(
                f"placement must be a jax.Device, a Sharding or None, got {placement!r}"
            )
        if buckets is None:
            buckets = Qwen3OmniBuckets()
        elif not isinstance(buckets, Qwen3OmniBuckets):
            raise TypeError(f"buckets must be a Qwen3OmniBuckets, got {type(buckets).__name__}")
        if window_buckets is not None:
            sizes = host_ints(window_buckets, name="window_buckets", minimum=1)
            if not sizes.size or (np.diff(sizes) <= 0).any():
                raise ValueError(f"window_buckets must be ascending and non-empty, got {sizes}")
            buckets = buckets._replace(windows=tuple(sizes.tolist()))
        for sizes in buckets:  # refused here rather than at the first call
            jaxsync.bucket(0, sizes)
        self.cfg: Qwen3OmniAudioConfig = model.cfg
        self.placement = placement
        self.buckets = buckets
        leaf = jax.tree.leaves(model)[0]
        self._weight_devices = leaf.sharding.device_set
        self._home = jaxsync.replicated_near(leaf)  # host features go up next to the weights
        check_placement(placement, leaf)
        self._entry = TowerEntry(
            jaxsync.TowerProgram(model, with_out_sharding(forward, out_sharding)),
            name=FEATURES,
            checks=(alive(FEATURES), self._check_features, self._check_devices),
            plan_cache_size=plan_cache_size,
        )
        self.program, self.plans = self._entry.program, self._entry.plans
        self._calls = self._entry.calls  # repeated calls on device features

    def load_state(self, tower: Qwen3OmniAudioTower) -> None:
        """Takes the tower's current weights (e.g. after `nnx.update`) without recompiling.

        Raises:
          ValueError: another structure, shape, dtype or placement than the encoder was built
            with (build a new encoder for another model).
        """
        self.program.load_state(tower)

    def plan(self, features_shape: Sequence[int], feature_lens: Any) -> Qwen3OmniPlan:
        """Validates shapes and lengths on the host and plans the batch (no device work).

        Raises:
          ValueError / TypeError: wrong rank or mel-bin count, invalid lengths, or a frame count
            that is neither `sum(feature_lens)` nor its frame bucket.
        """
        if len(features_shape) != 2:
            raise ValueError(f"features must be [num_mel_bins, frames], got shape {features_shape}")
        if features_shape[0] != self.cfg.num_mel_bins:
            raise ValueError(
                f"features have {features_shape[0]} mel bins, the encoder expects "
                f"{self.cfg.num_mel_bins} (shape must be [num_mel_bins, frames])"
            )
        return plan(feature_lens, self.cfg, buckets=self.buckets, num_frames=features_shape[1])

    @reads("dtype")
    def _check_features(self, features: Any) -> None:
        if not jnp.issubdtype(features.dtype, jnp.floating):
            raise TypeError(f"features must be floating point, got dtype {features.dtype}")

    @reads("sharding")
    def _check_devices(self, features: jax.Array) -> None:
        """Refuses device features away from the weights or from the upload placement."""
        if isinstance(features, jax.core.Tracer):
            return
        have = features.sharding.device_set
        if have != self._weight_devices:
            raise ValueError(
                f"features are on devices {_devices(features.sharding)} but the encoder's weights "
                f"are on {sorted(str(d) for d in self._weight_devices)}: place them on the same "
                "devices (or mesh)"
            )
        target = self.placement
        if target is not None:
            if ({target} if isinstance(target, jax.Device) else target.device_set) != have:
                raise ValueError(
                    f"features are on devices {_devices(features.sharding)} but the encoder "
                    f"uploads to placement {target}"
                )

    def _planned(self, features: Any, feature_lens: Any, placement: Any) -> Planned:
        """`plan()` and its upload, cached per (shape, dtype, placement, lengths); host features
        are checked finite first when the plan is new.

        A list or tuple of ints (what a server passes) becomes the key without numpy; other
        lengths pass the type checks first. `type(n) is int` keeps floats and bools (equal to
        ints, same hash) off the fast key.
        """
        if type(feature_lens) in (list, tuple) and all(type(n) is int for n in feature_lens):
            lens = tuple(feature_lens)
        else:
            lens = tuple(check_feature_lens(feature_lens).tolist())  # the same key
        where = getattr(features, "sharding", None)
        key = (features.shape, features.dtype, where, lens)
        return key, lambda: self.plan(features.shape, lens)

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
        key, name = None, "features"
        if input_features is None and feature_attention_mask is None:  # a kept call, if any
            run, key = self._calls.find(features, feature_lens)
            if run is not None:
                return run(features)
        if input_features is not None or feature_attention_mask is not None:
            if features is not None or feature_lens is not None:
                raise TypeError(
                    "pass features + feature_lens or input_features + feature_attention_mask, "
                    "not both"
                )
            if input_features is None or feature_attention_mask is None:
                raise TypeError("input_features and feature_attention_mask go together")
            features, feature_lens = features_from_processor(
                input_features, feature_attention_mask, check_finite=False
            )
            name = "input_features"
        elif features is None or feature_lens is None:
            raise TypeError("features and feature_lens are required")
        entry = self._entry
        if not isinstance(features, jax.Array):
            features = host_array(features, name=FEATURES)
            self._check_features(features)
            placement = self.placement if self.placement is not None else self._home
            key, build = self._planned(features, feature_lens, placement)
            return entry.host(features, key, build, placement, dtype=np.float32, name=name)
        entry.check(features)
        placement = self.placement
        if placement is None and not isinstance(features, jax.core.Tracer):
            placement = jaxsync.replicated_near(features)
        plan_key, build = self._planned(features, feature_lens, placement)
        return entry.device(features, key, entry.planned(plan_key, build, placement))
