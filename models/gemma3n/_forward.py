"""The pure forwards of the Gemma 3n audio path: what a server calls inside its own jit.

    graphdef, state = nnx.split(model)
    p = gemma3n.plan(mask, model.cfg)                 # host numpy; cache it per mask
    meta = jaxsync.upload_packed(p)                   # one transfer
    out = gemma3n.forward(nnx.merge(graphdef, state), features, meta)   # inside jax.jit
    out.rows[: sum(p.lengths)]                        # soft_tokens rows per clip, clip order

`forward` is the audio part of `Gemma3nModel.forward` (tower, embedder, the padding token's
embedding at padded and missing positions); `encode` stops after the tower. Both return a
`jaxsync.Encoded` and run the conformer blocks as one scan (`jaxsync.LayerStack`).
"""

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import jaxsync
from jaxsync._out_sharding import OutSharding, place_rows
from jaxsync.models.gemma3n._modules import Gemma3nAudioModel


__all__ = ["PadEmbedding", "encode", "forward"]


def _check_fits(features: jax.Array, meta: Any, n_mel: int) -> jax.Array:
    """The plan's `valid` `[B_pad, S_pad]`, after checking (at trace time) that `features`
    `[B, T, F]` has exactly the planned clips, frames and mel bins."""
    valid = meta.valid
    if features.ndim != 3 or features.shape[:2] != valid.shape or features.shape[2] != n_mel:
        raise ValueError(
            f"features of shape {tuple(features.shape)} do not fit the plan: its meta is for "
            f"[{valid.shape[0]} clips, {valid.shape[1]} frames, {n_mel} mel bins] (pad the "
            "features to the plan's batch and frame_bucket)"
        )
    return valid


def _tower(model: Gemma3nAudioModel, features: jax.Array, meta: Any):
    """Encodings `[B, T_a, D_a]` (zero at padding), padding `[B, T_a]`, features' finite flags."""
    valid = _check_fits(features, meta, model.cfg.input_feat_size)
    tower = model.audio_tower
    enc, padding = tower(features, ~valid, meta.frames[0])
    return enc, padding, jnp.isfinite(features).all(axis=(1, 2))


def forward(
    model: Gemma3nAudioModel, features: jax.Array, meta: Any, *, out_sharding: OutSharding = None
) -> jaxsync.Encoded:
    """Features -> `soft_tokens` embedding rows per clip (the audio part of
    `Gemma3nModel.forward`).

    Pure: callable inside any jit, the weights arriving with `model` (`nnx.merge(graphdef,
    state)`).

    Args:
        model: the `Gemma3nAudioModel`.
        features: `[B_pad, S_pad, F]` log-mel features (any float dtype), zero padded to the
            plan's `batch` and `frame_bucket`.
        meta: the plan's `Gemma3nMeta`, uploaded (`jaxsync.upload_packed(plan)`) or as arrays.
        out_sharding: where the rows go: a `Sharding`, a `PartitionSpec` over the weights'
            mesh (e.g. `P("data")` for a batch the server splits), or None: replicated over the
            weights' mesh (unconstrained for weights on one device).

    Returns:
        `jaxsync.Encoded`: rows `[B_pad * soft_tokens, D]` in the model dtype (clip i owns rows
        `i*N : (i+1)*N`: tower positions first, padded positions and the tail up to
        `soft_tokens` take the padding token's embedding, positions past `soft_tokens` are
        dropped); finite `[B_pad]` (the clip's features and rows are all finite); no extras.

    Raises:
        ValueError: at trace time, features whose shape does not fit the plan.
    """
    enc, padding, finite = _tower(model, features, meta)  # [B, T_a, D_a], [B, T_a], [B]
    emb = model.embed_audio.embed_soft(enc).astype(model.dtype)  # [B, T_a, D]
    pad = model.pad_embedding()  # [D]
    b, t_a, d = emb.shape
    n = model.soft_tokens
    fill = jnp.broadcast_to(pad.astype(emb.dtype), (b, max(n, t_a), d))
    emb = jnp.where(padding[:, :, None], fill[:, :t_a], emb)
    emb = emb[:, :n] if t_a >= n else jnp.concatenate([emb, fill[:, : n - t_a]], axis=1)
    finite = finite & jnp.isfinite(emb).all(axis=(1, 2))
    return jaxsync.Encoded(place_rows(model, emb.reshape(b * n, d), out_sharding), finite)


def encode(
    model: Gemma3nAudioModel, features: jax.Array, meta: Any, *, out_sharding: OutSharding = None
) -> jaxsync.Encoded:
    """Features -> the audio tower's encodings per clip (before the multimodal embedder).

    Clip i owns `P = meta.positions` rows (the tower positions of the call's unbucketed frame
    count: transformers' `Gemma3nAudioEncoder` output for the same batch, zero at padded
    positions), at rows `i*P : (i+1)*P`; rows past the clips are zero.

    Args: as `forward` (`out_sharding` too).

    Returns:
        `jaxsync.Encoded`: rows `[B_pad * T_a, D_a]` in the model dtype (`T_a` the tower
        positions of the frame bucket), finite `[B_pad]`, no extras.
    """
    enc, _, finite = _tower(model, features, meta)
    b, t_a, d = enc.shape
    finite = finite & jnp.isfinite(enc).all(axis=(1, 2))
    # Clips' first P positions packed contiguously: P comes from the plan (a device scalar),
    # so every frame count of one bucket shares the program.
    p = jnp.maximum(meta.positions[0], 1)
    r = jnp.arange(b * t_a)
    clip, pos = r // p, r % p
    index = jnp.where(clip < b, clip * t_a + pos, b * t_a)  # past the clips: out of bounds
    rows = jnp.take(enc.reshape(b * t_a, d), index, axis=0, mode="fill", fill_value=0)
    return jaxsync.Encoded(place_rows(model, rows.astype(model.dtype), out_sharding), finite)


class PadEmbedding:
    """The padding token's embedding `[D]` (the rows `forward` puts at padded positions),
    computed once per weights and placement, then cached. It needs the embedder only: its state
    goes in as plain jit arguments, one program for the model's lifetime (`take` new weights)."""

    def __init__(self, model: Gemma3nAudioModel):
        graphdef = nnx.split(model.embed_audio)[0]
        pad_id, dtype = model.pad_id, model.dtype

        def pad_fn(state):
            ids = jnp.full((1,), pad_id, jnp.int32)
            return nnx.merge(graphdef, state).embed_ids(ids)[0].astype(dtype)

        self._fn = jax.jit(pad_fn)
        self.take(model)

    def take(self, model: Gemma3nAudioModel) -> None:
        """New weights: the cached embeddings are dropped."""
        self.home = jaxsync.replicated_near(jax.tree.leaves(nnx.state(model))[0])
        self._state = nnx.split(model.embed_audio)[1]
        self._pads: dict[Any, jax.Array] = {}

    def __call__(self, placement: Any = None) -> jax.Array:
        key = self.home if placement is None else placement
        hit = self._pads.get(key)
        if hit is not None:
            return hit
        pad = self._fn(self._state)  # async dispatch; nothing is read back
        if key != self.home and not isinstance(pad, jax.core.Tracer):
            pad = jax.device_put(pad, key)
        if not isinstance(pad, jax.core.Tracer):  # traced by a static scan: keep no tracer
            self._pads[key] = pad
        return pad
