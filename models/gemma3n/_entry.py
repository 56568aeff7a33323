"""Host entry of the Gemma 3n audio path: host metadata validated on the host, cached plan, one
upload, one dispatch; device data is never read back."""

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

import jaxsync
from jaxsync._encoder import TowerEncoder, expect
from jaxsync._entry import alive
from jaxsync._out_sharding import OutSharding
from jaxsync.check import entry_point
from jaxsync.models.gemma3n._forward import PadEmbedding, encode, forward
from jaxsync.models.gemma3n._inputs import (
    FEATURES,
    check_host_finite,
    device_check,
    host_inputs,
    stage_features,
)
from jaxsync.models.gemma3n._modules import Gemma3nAudioModel
from jaxsync.models.gemma3n._plan import entry_buckets, host_planner, mask_planner
from jaxsync.models.gemma3n._weights import load_model


class Gemma3nAudioEncoder(TowerEncoder):
    """Audio features -> `soft_tokens` embedding rows per clip, on the device, in one dispatch
    of `jaxsync.TowerProgram(model, forward)` (see `TowerEncoder`).

    Overflow (more than `soft_tokens` tower positions, i.e. more than ~30 s at the released
    config) follows `cfg.overflow`: "error" raises `ValueError` like transformers; "truncate"
    keeps the first `soft_tokens` like vLLM and emits an `AudioTruncationWarning` naming the
    clips that lose real (non-padding) positions.

    Args:
        model: the loaded `Gemma3nAudioModel`.
        embed: True: the embedder's rows (`forward`); False: the audio tower's encodings
            `[*, D_a]` per clip, before the embedder (`encode`; no overflow policy).
        overflow: "error" or "truncate" in place of `model.cfg.overflow`; None keeps it.
        frame_buckets: frame buckets for host features: increasing sizes, or an int G (a
            multiple of G); default `gemma3n.FRAME_BUCKETS` (the released processor's shapes).
        batch_buckets: clip-count buckets for host features; default `gemma3n.CLIP_BUCKETS`.
        placement, plan_cache_size, out_sharding: as `TowerEncoder`'s.

    Attributes:
        cfg: the config the entry plans with.
    """

    load_model = staticmethod(load_model)

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
        expect(model, Gemma3nAudioModel)
        self.embed = bool(embed)
        self.buckets = entry_buckets(frame_buckets, batch_buckets)
        checks = (alive(FEATURES), device_check(model.cfg.input_feat_size))
        super().__init__(model, forward if self.embed else encode, name=FEATURES, checks=checks,
                         inside=FEATURES, placement=placement, out_sharding=out_sharding,
                         plan_cache_size=plan_cache_size, miss=self._miss)  # fmt: skip
        if overflow is not None:
            self.cfg = dataclasses.replace(self.cfg, overflow=overflow)
        self._pad = PadEmbedding(model)

    def _took(self, model: Gemma3nAudioModel) -> None:
        self._pad.take(model)
        self._calls.clear()

    def pad_embedding(self, placement: Any = None) -> jax.Array:
        """The padding token's embedding `[D]` (the rows `forward` puts at padded positions),
        computed once per weights and placement, then cached."""
        return self._pad(placement)

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
        return self._entry(input_features, input_features_mask)

    def _miss(self, features: Any, key: Any, mask: Any) -> jaxsync.Embeddings:
        """A call the call cache missed: device features planned at their shape (the caller's
        bucket); host ones padded to their buckets, NaN / inf refused before a new plan's
        metadata goes up or, on a known plan, as they are copied into it (one pass)."""
        if isinstance(features, jax.core.Tracer):
            raise TypeError(f"{FEATURES} is traced: inside a jit call `forward` directly")
        if isinstance(features, jax.Array):
            planner = mask_planner(mask, self.cfg, embed=self.embed)
            return self._entry.run(features, key, planner)
        n_mel = self.cfg.input_feat_size
        host, valid = host_inputs(features, mask, n_mel)
        planner = host_planner(valid, self.cfg, buckets=self.buckets, embed=self.embed)
        stage = lambda p: stage_features(host, p, n_mel, self.placement)  # noqa: E731
        return self._entry.host(host, *planner(host, self._meta_at), self._meta_at, stage=stage,
                                finite=lambda: check_host_finite(host))  # fmt: skip
