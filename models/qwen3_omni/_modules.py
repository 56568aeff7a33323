# ruff: noqa: F722 - jaxtyping shape strings are not forward references
"""The Qwen3-Omni audio encoder as NNX modules, on the planner's window layout.

The encoder layers are one `jaxsync.LayerStack` (`tower.layers`, weights `[L, ...]`, run as one
scan): a server's state has one leaf per weight kind at any depth, and `tower.layers.at(i)` is
layer i alone.

Attribute names mirror HF's `Qwen3OmniMoeAudioEncoder` so the weight table stays one-to-one.
Shapes: S = chunk slots, W = attention-window slots, Q = token slots per window, T = frames
(or tokens), F = mel bins, C = conv channels, D = d_model, N = heads, H = head dim, O = output_dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float

import jaxsync
from jaxsync._out_sharding import OutSharding, place_rows
from jaxsync.models._activations import activation, gelu
from jaxsync.models.qwen3_omni._config import TOKENS_PER_FULL_CHUNK, Qwen3OmniAudioConfig
from jaxsync.models.qwen3_omni._plan import Qwen3OmniMeta


_LN_EPS = 1e-5  # torch.nn.LayerNorm default (nnx defaults to 1e-6)


# Built once per size and shared read-only: a constant of every trace, never a jit argument.
@functools.cache
def sinusoid_table(length: int, channels: int, max_timescale: float = 10000.0) -> np.ndarray:
    """[length, channels] `[sin | cos]` table, float32 like HF's `SinusoidsPositionEmbedding`."""
    increment = np.log(max_timescale) / (channels // 2 - 1)
    inv = np.exp(np.float32(-increment) * np.arange(channels // 2, dtype=np.float32))
    scaled = np.arange(length, dtype=np.float32)[:, None] * inv[None, :]
    table = np.concatenate([np.sin(scaled), np.cos(scaled)], axis=1).astype(np.float32)
    table.setflags(write=False)  # cached and shared: nobody may edit it
    return table


class AudioAttention(nnx.Module):
    """Bidirectional multi-head attention inside each window slot."""

    def __init__(self, cfg: Qwen3OmniAudioConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        d = cfg.d_model
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj, self.k_proj = nnx.Linear(d, d, **kw), nnx.Linear(d, d, **kw)
        self.v_proj, self.out_proj = nnx.Linear(d, d, **kw), nnx.Linear(d, d, **kw)
        self.num_heads, self.head_dim = cfg.encoder_attention_heads, cfg.head_dim

    def __call__(self, x: Float[Array, "W Q D"], window_lens: jax.Array) -> Float[Array, "W Q D"]:
        w, q_len, _ = x.shape
        heads = (w, q_len, self.num_heads, self.head_dim)
        q, k, v = (p(x).reshape(heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        # A window's valid tokens are a prefix (see _plan.py), so a key length is the whole mask.
        # Empty padding windows get length 1: their rows are never read, and no row is all-masked.
        out = jax.nn.dot_product_attention(
            q, k, v, scale=self.head_dim**-0.5, key_value_seq_lengths=jnp.maximum(window_lens, 1)
        )
        return self.out_proj(out.reshape(w, q_len, -1))


class AudioEncoderLayer(nnx.Module):
    """Pre-norm transformer layer (HF `Qwen3OmniMoeAudioEncoderLayer`)."""

    def __init__(self, cfg: Qwen3OmniAudioConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        d = cfg.d_model
        self.self_attn = AudioAttention(cfg, **kw)
        self.self_attn_layer_norm = nnx.LayerNorm(d, epsilon=_LN_EPS, **kw)
        self.fc1 = nnx.Linear(d, cfg.encoder_ffn_dim, **kw)
        self.fc2 = nnx.Linear(cfg.encoder_ffn_dim, d, **kw)
        self.final_layer_norm = nnx.LayerNorm(d, epsilon=_LN_EPS, **kw)
        self.act = activation(cfg.activation_function)

    def __call__(self, x: Float[Array, "W Q D"], window_lens: jax.Array) -> Float[Array, "W Q D"]:
        x = x + self.self_attn(self.self_attn_layer_norm(x), window_lens)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class Qwen3OmniAudioTower(nnx.Module):
    """The audio encoder: conv stem per chunk slot, windowed transformer, output projection.

    Args:
      cfg: the encoder config.
      rngs: initialisation randomness (weights usually come from `load_model`).
      dtype: computation dtype.
      param_dtype: parameter dtype.

    Attributes:
      cfg: the encoder config.
      layers: the `encoder_layers` transformer layers, a `jaxsync.LayerStack` (`layers.at(i)`
        is layer i; its parameters are `layers.layer.*`, stacked `[L, ...]`).
    """

    def __init__(
        self,
        cfg: Qwen3OmniAudioConfig,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
    ):
        self.cfg = cfg
        self.dtype = dtype
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        ch, d = cfg.downsample_hidden_size, cfg.d_model
        conv = dict(kernel_size=(3, 3), strides=(2, 2), padding=((1, 1), (1, 1)), **kw)
        self.conv2d1 = nnx.Conv(1, ch, **conv)
        self.conv2d2 = nnx.Conv(ch, ch, **conv)
        self.conv2d3 = nnx.Conv(ch, ch, **conv)
        # torch flattens conv features as (channel, freq); the kernel keeps both axes.
        self.conv_out = nnx.Einsum("STFC,CFD->STD", (ch, cfg.conv_freq_bins, d), None, **kw)
        # one scan over [L, ...] weights: the state's leaf count does not grow with depth
        self.layers = jaxsync.LayerStack(
            lambda r: AudioEncoderLayer(cfg, rngs=r, dtype=dtype, param_dtype=param_dtype),
            cfg.encoder_layers,
            rngs=rngs,
        )
        self.ln_post = nnx.LayerNorm(d, epsilon=_LN_EPS, **kw)
        self.proj1 = nnx.Linear(d, d, **kw)
        self.proj2 = nnx.Linear(d, cfg.output_dim, **kw)
        self.act = activation(cfg.activation_function)

    def __call__(self, features: Float[Array, "F T"], meta: Qwen3OmniMeta) -> jaxsync.Encoded:
        """`forward(self, features, meta)`."""
        return forward(self, features, meta)

    def embed(
        self, features: Float[Array, "F T"], meta: Qwen3OmniMeta
    ) -> tuple[Float[Array, "W Q D"], Bool[Array, " W"]]:
        """The part before the layers: chunk gather, conv stem, positions, window layout.

        Also returns whether each window's own frames are all finite (a window holds one
        audio's chunks, so a non-finite value stays inside its audio's windows).
        """
        cfg = self.cfg
        chunk, num_frames = cfg.chunk_len, features.shape[1]
        starts, lens = meta.slot_starts, meta.slot_lens  # [S]
        offs = jnp.arange(chunk, dtype=jnp.int32)
        frame = jnp.where(
            offs[None, :] < lens[:, None], starts[:, None] + offs[None, :], num_frames
        )
        if num_frames:
            x = jnp.take(features.T, frame, axis=0, mode="fill", fill_value=0)  # [S, 100, F]
        else:  # a batch of empty audios: jnp.take cannot gather from an empty axis
            x = jnp.zeros((*frame.shape, features.shape[0]), features.dtype)
        windows = meta.window_lens.shape[0]
        window_finite = jnp.isfinite(x).reshape(windows, -1).all(axis=1)  # [W]
        x = x.astype(self.dtype)[..., None]  # [S, 100, F, 1]: time is the conv's "height"

        limits = meta.conv_limits
        x = _mask_time(gelu(self.conv2d1(x)), limits[0])  # [S, 50, F/2, C]
        x = _mask_time(gelu(self.conv2d2(x)), limits[1])  # [S, 25, F/4, C]
        x = gelu(self.conv2d3(x))  # [S, 13, F/8, C]
        x = self.conv_out(x)  # [S, 13, D]
        # positions restart in every chunk: a compile-time constant, not a jit argument
        positions = sinusoid_table(TOKENS_PER_FULL_CHUNK, cfg.d_model)
        x = x + jnp.asarray(positions[: x.shape[1]], x.dtype)[None]
        return x.reshape(windows, cfg.window_tokens, cfg.d_model), window_finite  # [W, Q, D]

    def head(self, x: Float[Array, "W Q D"], meta: Qwen3OmniMeta) -> Float[Array, "WQ O"]:
        """The part after the layers: output projection and the gather into token order."""
        x = self.proj2(self.act(self.proj1(self.ln_post(x))))  # [W, Q, O]
        flat = x.reshape(-1, self.cfg.output_dim)
        return jnp.take(flat, meta.out_src, axis=0, mode="fill", fill_value=0)


def forward(
    tower: Qwen3OmniAudioTower,
    features: Float[Array, "F T"],
    meta: Qwen3OmniMeta,
    *,
    out_sharding: OutSharding = None,
) -> jaxsync.Encoded:
    """The pure forward of one planned batch; callable inside any jit, scan or shard_map.

    The encoder's last layers (`proj1`, `proj2`) are part of upstream's audio encoder, and no
    projector follows it: the rows are the thinker's audio embeddings.

    Args:
      tower: the module (a server passes `nnx.merge(graphdef, state)` from inside its jit).
      features: [F, T] mel features, all audios concatenated in time; T is the plan's
        `num_frames`.
      meta: the plan's `meta`, uploaded (`jaxsync.upload_packed(plan)`).
      out_sharding: where the rows go: a `Sharding`, a `PartitionSpec` over the weights' mesh
        (e.g. `P("data")` for a batch the server splits), or None: replicated over the weights'
        mesh (unconstrained for weights on one device).

    Returns:
      `jaxsync.Encoded`: rows [W * Q, O] (row r < sum(plan.lengths) is token r of the
      concatenated audios, later rows are zero); finite [I] bool, entry a False when audio a's
      frames hold a NaN or inf (padding entries True); no extras.

    Raises:
      ValueError: at trace time, features or meta whose static shapes do not fit each other or
        the tower's config (another plan's features, another config's plan).
    """
    _check_fits(tower.cfg, features, meta)
    x, window_finite = tower.embed(features, meta)
    x = tower.layers(x, meta.window_lens)
    # One flag per audio: the AND over its windows. Padding windows carry the out-of-range item
    # I (dropped); an audio without windows keeps segment_min's identity, read as True.
    items = meta.item_rows.shape[0]
    finite = jax.ops.segment_min(window_finite.astype(jnp.int32), meta.window_items, items) > 0
    return jaxsync.Encoded(place_rows(tower, tower.head(x, meta), out_sharding), finite)


def _check_fits(cfg: Qwen3OmniAudioConfig, features: jax.Array, meta: Qwen3OmniMeta) -> None:
    """Static shapes only: a mismatch is a ValueError naming both, not a broadcast error."""
    if features.ndim != 2 or features.shape[0] != cfg.num_mel_bins:
        raise ValueError(
            f"features have shape {tuple(features.shape)}; the tower expects [num_mel_bins, "
            f"frames] with {cfg.num_mel_bins} mel bins"
        )
    frames = meta.frames.shape[0]
    if features.shape[1] != frames:
        raise ValueError(
            f"features have {features.shape[1]} frames but the plan was made for {frames} "
            "(plan(..., num_frames=...) gives a plan for the features' own frame count)"
        )
    windows = meta.window_lens.shape[0]
    slots, rows = meta.slot_starts.shape[0], meta.out_src.shape[0]
    if (slots, rows) != (windows * cfg.chunks_per_window, windows * cfg.window_tokens):
        raise ValueError(
            f"the plan has {slots} chunk slots and {rows} rows for {windows} windows; this "
            f"tower's config needs {windows * cfg.chunks_per_window} and "
            f"{windows * cfg.window_tokens} (a plan made for another config)"
        )
    if meta.window_items.shape != (windows,):
        raise ValueError(
            f"the plan has {meta.window_items.shape} window items for {windows} windows"
        )


def _mask_time(x: Float[Array, "S T F C"], limit: jax.Array) -> Float[Array, "S T F C"]:
    # Upstream pads the chunk batch only to its longest chunk, so the next conv sees zero padding
    # past this stage's length of that chunk; we always pad to 100 frames and zero the rest.
    keep = jnp.arange(x.shape[1], dtype=jnp.int32) < limit
    return jnp.where(keep[None, :, None, None], x, jnp.zeros((), x.dtype))
