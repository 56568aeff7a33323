"""Host entry points of the Gemma 3n audio path: validation, bucketing, one upload, one dispatch.

Host metadata (clip lengths, frame count, placeholder positions) is validated on the host before
anything is dispatched; device data is never read back.
"""

import warnings
from collections.abc import Sequence

import jax
import numpy as np

import jaxsync
from jaxsync import replicated_near
from jaxsync.check import entry_point
from jaxsync.models.gemma3n._config import Gemma3nAudioConfig
from jaxsync.models.gemma3n._model import Gemma3nAudioModel


__all__ = ["AudioEmbedder", "AudioTruncationWarning", "merge_audio_embeddings"]


class AudioTruncationWarning(UserWarning):
    """A clip produced more tower positions than `soft_tokens`; the excess was dropped."""


def _as_batch(features, mask, n_mel: int) -> tuple[np.ndarray, np.ndarray]:
    """Host features/mask in either upstream form -> `[B, S, F]` float32, `[B, S]` bool (valid)."""
    if isinstance(features, jax.Array) or isinstance(mask, jax.Array):
        raise TypeError(
            "features/mask must be host arrays (numpy): the path pads them to a bucket on the "
            "host and uploads them once; a device array would have to be read back"
        )
    if isinstance(features, list | tuple):  # vLLM's per-clip list form: zero-pad to s_max
        clips = [np.asarray(f, np.float32) for f in features]
        if not clips:
            raise ValueError("no audio clips given")
        for i, c in enumerate(clips):
            if c.ndim != 2 or c.shape[1] != n_mel:
                raise ValueError(f"clip {i}: features must be [frames, {n_mel}], got {c.shape}")
        masks = [np.ones(len(c), bool) for c in clips] if mask is None else list(mask)
        if len(masks) != len(clips):
            raise ValueError(f"{len(clips)} feature clips but {len(masks)} masks")
        s = max(len(c) for c in clips)
        feats = np.zeros((len(clips), s, n_mel), np.float32)
        valid = np.zeros((len(clips), s), bool)
        for i, (c, m) in enumerate(zip(clips, masks, strict=True)):
            m = np.asarray(m, bool)
            if m.shape != (len(c),):
                raise ValueError(f"clip {i}: mask shape {m.shape} != ({len(c)},)")
            feats[i, : len(c)], valid[i, : len(c)] = c, m
        return feats, valid
    feats = np.asarray(features, np.float32)
    if feats.ndim != 3:
        raise ValueError(f"features must be [B, frames, mel] (or a list), got {feats.shape}")
    if feats.shape[2] != n_mel:
        raise ValueError(f"features have {feats.shape[2]} mel bins; the config expects {n_mel}")
    if mask is None:
        raise ValueError("a batched features array needs its mask (True = valid frame)")
    valid = np.asarray(mask)
    if valid.shape != feats.shape[:2]:
        raise ValueError(f"mask shape {valid.shape} != features shape[:2] {feats.shape[:2]}")
    return feats, valid.astype(bool)


class AudioEmbedder:
    """Host entry point: audio features -> `[B_pad, soft_tokens, D]` embeddings on the device.

    One `upload_packed` transfer (features, frame mask, frame count) and one jitted dispatch per
    call. Frames are padded to `frame_buckets`, clips to `batch_buckets`; rows `>= B` of the
    result are padding clips (all padding embedding) and should be ignored.

    Overflow (more than `soft_tokens` tower positions for the unpadded frame count, i.e. more
    than ~30 s at the released config) follows `cfg.overflow`: "error" raises `ValueError` like
    transformers; "truncate" keeps the first `soft_tokens` like vLLM and emits an
    `AudioTruncationWarning` naming the clips that lose real (non-padding) positions.

    Args:
        model: the loaded `Gemma3nAudioModel` (its state is captured once).
        cfg: its config.
        frame_buckets: an int G rounds frames up to a multiple of G; a sequence lists buckets.
        batch_buckets: clip-count buckets; default powers of two.
        placement: where uploads land; must be where the weights live (default device).
    """

    def __init__(
        self,
        model: Gemma3nAudioModel,
        cfg: Gemma3nAudioConfig,
        *,
        frame_buckets: int | Sequence[int] = 512,
        batch_buckets: Sequence[int] | None = None,
        placement=None,
    ):
        self.cfg = cfg
        self.frame_buckets = frame_buckets
        self.batch_buckets = batch_buckets
        self.placement = placement
        self._embed = jaxsync.jit_method(model, "embed_packed")
        self._pad = jaxsync.jit_method(model, "pad_embedding")
        self._pad_cache: dict[object, jax.Array] = {}

    def pad_embedding(self) -> jax.Array:
        """Padding-token embedding `[D]`, computed on the device once per placement, then cached."""
        key = self.placement
        if key in self._pad_cache:
            return self._pad_cache[key]
        pad = self._pad()  # async dispatch; nothing is read back
        if not isinstance(pad, jax.core.Tracer):  # traced by a static scan: do not keep a tracer
            self._pad_cache[key] = pad
        return pad

    def _frame_bucket(self, s: int) -> int:
        if isinstance(self.frame_buckets, int):
            g = self.frame_buckets
            return -(-s // g) * g
        return jaxsync.bucket(s, self.frame_buckets)

    @entry_point
    def __call__(self, features, mask=None) -> jax.Array:
        """Embeds a batch of clips.

        Args:
            features: host `[B, S, F]` float array with `mask` `[B, S]` (True = valid frame, the
                processor's `input_features_mask`), or a list of `[S_i, F]` arrays (mask None =
                all valid, or a list of `[S_i]` masks), zero padded to the longest like vLLM.

        Returns:
            `[B_pad, soft_tokens, D]` embeddings in the model dtype.

        Raises:
            ValueError: mel-bin mismatch, features/mask shape mismatch, a clip without any valid
                frame, or (overflow="error") more tower positions than `soft_tokens`.
        """
        cfg = self.cfg
        feats, valid = _as_batch(features, mask, cfg.input_feat_size)
        b, s = valid.shape
        if s == 0 or not valid.any(axis=1).all():
            empty = [i for i in range(b) if s == 0 or not valid[i].any()]
            raise ValueError(f"audio clip(s) {empty} have no valid frame (all padding)")
        t_a = cfg.num_tower_positions(s)
        if t_a > cfg.soft_tokens:
            self._overflow(valid, t_a)
        b_pad = jaxsync.bucket(b, self.batch_buckets, minimum=1)
        s_pad = self._frame_bucket(s)
        f_up = np.zeros((b_pad, s_pad, cfg.input_feat_size), np.float32)
        f_up[:b, :s] = feats
        v_up = np.zeros((b_pad, s_pad), bool)
        v_up[:b, :s] = valid
        up = jaxsync.upload_packed(
            {"features": f_up, "valid": v_up, "frames": np.array([s], np.int32)},
            placement=self.placement,
        )
        return self._embed(up, self.pad_embedding())

    def _overflow(self, valid: np.ndarray, t_a: int) -> None:
        cfg = self.cfg
        msg = (
            f"audio gives {t_a} tower positions for {valid.shape[1]} frames, more than "
            f"soft_tokens={cfg.soft_tokens}"
        )
        if cfg.overflow == "error":
            raise ValueError(
                msg + " (overflow='error', as transformers; use 'truncate' to keep "
                "the first soft_tokens as vLLM does)"
            )
        # Real positions per clip, from the host mask exactly as the tower subsamples it.
        t_sub = cfg.num_subsampled(valid.shape[1])
        idx = np.minimum(np.arange(t_sub) * cfg.time_stride, valid.shape[1] - 1)
        dropped = valid[:, idx][:, :: cfg.conf_reduction_factor][:, cfg.soft_tokens :].sum(axis=1)
        lost = {i: int(r) for i, r in enumerate(dropped) if r}
        warnings.warn(
            f"{msg}; truncated to the first {cfg.soft_tokens} (vLLM behaviour); "
            f"real positions dropped per clip: {lost}",
            AudioTruncationWarning,
            stacklevel=3,
        )


@jax.jit
def _scatter(text: jax.Array, audio: jax.Array, up: jaxsync.Packed) -> jax.Array:
    d = text.shape[-1]
    flat = text.reshape(-1, d)  # [T, D]
    rows = audio.reshape(-1, d).astype(text.dtype)  # [B_pad * N, D]
    # Unused slots point past the end and are dropped: no boolean indexing, static shapes.
    return flat.at[up["positions"]].set(rows, mode="drop").reshape(text.shape)


@entry_point
def merge_audio_embeddings(
    text_embeds: jax.Array,
    audio_embeds: jax.Array,
    input_ids: np.ndarray,
    *,
    num_clips: int,
    audio_token_id: int,
) -> jax.Array:
    """Writes audio embeddings into the text embeddings at the audio placeholder tokens.

    Same result as transformers' `masked_scatter(input_ids == audio_token_id, audio_features)`;
    the placeholder positions come from the host token ids, so nothing is read back.

    Args:
        text_embeds: `[..., T, D]` device embeddings of the prompt.
        audio_embeds: `[B_pad, N, D]` from `AudioEmbedder`; the first `num_clips` rows are used.
        input_ids: host token ids with the shape of `text_embeds[..., 0]`.
        num_clips: clips in the batch (host metadata).
        audio_token_id: the placeholder id (`cfg.audio_token_id`).

    Raises:
        ValueError: shape mismatch, or placeholder count != num_clips * N (as transformers).
    """
    ids = np.asarray(input_ids)
    if ids.shape != tuple(text_embeds.shape[:-1]):
        raise ValueError(
            f"input_ids shape {ids.shape} != text_embeds shape[:-1] {tuple(text_embeds.shape[:-1])}"
        )
    b_pad, n, d = audio_embeds.shape
    if d != text_embeds.shape[-1] or not 0 < num_clips <= b_pad:
        raise ValueError(
            f"audio_embeds {audio_embeds.shape} do not fit text_embeds "
            f"{text_embeds.shape} with num_clips={num_clips}"
        )
    pos = np.flatnonzero(ids.reshape(-1) == audio_token_id)
    if pos.size != num_clips * n:
        raise ValueError(
            f"{pos.size} audio placeholder tokens but {num_clips} clips x {n} "
            f"embeddings = {num_clips * n}"
        )
    slots = np.full(b_pad * n, ids.size, np.int32)
    slots[: pos.size] = pos
    up = jaxsync.upload_packed({"positions": slots}, placement=replicated_near(text_embeds))
    return _scatter(text_embeds, audio_embeds, up)
