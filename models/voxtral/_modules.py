"""Voxtral audio tower (a Whisper encoder plus the multimodal projector) and its pure forward.

Attribute names mirror transformers' `VoxtralEncoder` (`audio_tower.*`) with the projector as
`multi_modal_projector`, so the weight table in `_weights.py` is a rename plus layout transforms.

`forward(tower, features, meta)` is the pure function a server calls inside its own jit
(`forward(nnx.merge(graphdef, state), features, meta)`); `forward_waveforms` puts the on-device
log-mel front end in front of it. Every window ("chunk") is encoded on its own: no value of one
chunk reaches another, so a NaN in one item never changes another item's rows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import jaxsync
from jaxsync._out_sharding import OutSharding, place_rows
from jaxsync.models._activations import gelu as _gelu
from jaxsync.models._attention import AttentionImpl, resolve_attention
from jaxsync.models.voxtral._config import VoxtralAudioConfig
from jaxsync.models.voxtral._mel import MelSpec, log_mel_rows


class Attention(nnx.Module):
    """Bidirectional multi-head self-attention (k_proj has no bias, as in Whisper)."""

    def __init__(
        self,
        cfg: VoxtralAudioConfig,
        *,
        rngs: nnx.Rngs,
        dtype,
        param_dtype,
        attention: AttentionImpl = "auto",
    ):
        d = cfg.hidden_size
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        # cuDNN flash attention on GPU for 16-bit weights: a 1500-frame window's [N, T, T] scores
        # never reach HBM (the XLA form is several times slower on a GPU). Padding the windows to
        # whole 128-position tiles would need a key mask, and cuDNN's masked kernel is slower than
        # its unpadded one (docs/benchmarks.md).
        self.impl = resolve_attention(attention, dtype, cfg.head_dim)
        self.q_proj = nnx.Linear(d, d, use_bias=True, **kw)
        self.k_proj = nnx.Linear(d, d, use_bias=False, **kw)
        self.v_proj = nnx.Linear(d, d, use_bias=True, **kw)
        self.out_proj = nnx.Linear(d, d, use_bias=True, **kw)
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim

    def __call__(self, x: jax.Array) -> jax.Array:  # [C, T, D] -> [C, T, D]
        c, t, _ = x.shape
        shape = (c, t, self.num_heads, self.head_dim)
        # Scale q before the product, as upstream does (it matters for low-precision rounding).
        # XLA merges the three projections into one matmul and splits its output; compiled as
        # three matmuls the encoder runs slower on an H200 (docs/benchmarks.md).
        q = (self.q_proj(x) * self.head_dim**-0.5).reshape(shape)  # [C, T, N, H]
        k = self.k_proj(x).reshape(shape)
        v = self.v_proj(x).reshape(shape)
        out = jax.nn.dot_product_attention(q, k, v, scale=1.0, implementation=self.impl)
        return self.out_proj(out.reshape(c, t, -1))


class EncoderLayer(nnx.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: VoxtralAudioConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        d, eps = cfg.hidden_size, cfg.layer_norm_eps
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.self_attn = Attention(cfg, **kw)
        self.self_attn_layer_norm = nnx.LayerNorm(d, epsilon=eps, **kw)
        self.fc1 = nnx.Linear(d, cfg.intermediate_size, **kw)
        self.fc2 = nnx.Linear(cfg.intermediate_size, d, **kw)
        self.final_layer_norm = nnx.LayerNorm(d, epsilon=eps, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:  # [C, T, D]
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(_gelu(self.fc1(self.final_layer_norm(x))))


class Projector(nnx.Module):
    """`linear_2(gelu(linear_1(x)))` on groups of `frames_per_token` encoder frames (no biases)."""

    def __init__(self, cfg: VoxtralAudioConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        h = cfg.text_hidden_size
        kw = dict(use_bias=False, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.linear_1 = nnx.Linear(cfg.intermediate_size, h, **kw)
        self.linear_2 = nnx.Linear(h, h, **kw)
        self.group = cfg.frames_per_token

    def __call__(self, h: jax.Array) -> jax.Array:  # [C, P, D] -> [C, P / group, V_hidden]
        c, p, d = h.shape
        h = h.reshape(c, p // self.group, self.group * d)  # consecutive frames of one window
        return self.linear_2(_gelu(self.linear_1(h)))


class VoxtralAudioTower(nnx.Module):
    """Conv1d (k3) + GELU, Conv1d (k3, stride 2) + GELU, positions, layers, final LayerNorm
    (transformers `VoxtralEncoder`), then the projector on groups of encoder frames.

    Args:
      cfg: the audio config.
      rngs: initialiser keys (weights are usually loaded with `load_model`).
      dtype: compute dtype; param_dtype: parameter dtype (embed_positions stays float32, as
        transformers keeps it).
    """

    def __init__(
        self,
        cfg: VoxtralAudioConfig,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
    ):
        d = cfg.hidden_size
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.conv1 = nnx.Conv(cfg.num_mel_bins, d, kernel_size=(3,), padding=((1, 1),), **kw)
        self.conv2 = nnx.Conv(d, d, kernel_size=(3,), strides=(2,), padding=((1, 1),), **kw)
        self.embed_positions = nnx.Embed(
            cfg.max_source_positions, d, rngs=rngs, dtype=jnp.float32, param_dtype=jnp.float32
        )
        # Stacked [L, ...] and run as one scan: the state holds one leaf per weight kind.
        self.layers = jaxsync.LayerStack(
            lambda r: EncoderLayer(cfg, rngs=r, dtype=dtype, param_dtype=param_dtype),
            cfg.num_hidden_layers,
            rngs=rngs,
        )
        self.layer_norm = nnx.LayerNorm(d, epsilon=cfg.layer_norm_eps, **kw)
        self.multi_modal_projector = Projector(cfg, **kw)
        self.cfg = cfg
        self.dtype = dtype

    def embed(self, mel: jax.Array) -> jax.Array:  # [C, F, 2P] -> [C, P, D]
        """The convolutions and positions in front of the layers."""
        if mel.ndim != 3 or mel.shape[1:] != (self.cfg.num_mel_bins, self.cfg.chunk_frames):
            raise ValueError(
                f"encoder windows must be [C, {self.cfg.num_mel_bins}, "
                f"{self.cfg.chunk_frames}], got {mel.shape}"
            )
        h = jnp.swapaxes(mel.astype(self.dtype), 1, 2)  # [C, 2P, F]
        h = _gelu(self.conv1(h))
        h = _gelu(self.conv2(h))  # [C, P, D]
        pos = self.embed_positions.embedding[...]  # [P, D] float32
        return (h.astype(jnp.float32) + pos[None]).astype(h.dtype)

    def encode(self, mel: jax.Array) -> jax.Array:  # [C, F, 2P] -> [C, P, D]
        """transformers `audio_tower(mel).last_hidden_state`."""
        return self.layer_norm(self.layers(self.embed(mel)))

    def audio_features(self, mel: jax.Array) -> jax.Array:  # [C, F, 2P] -> [C * P/4, V_hidden]
        """transformers `get_audio_features(mel).pooler_output`."""
        out = self.multi_modal_projector(self.encode(mel))
        return out.reshape(-1, out.shape[-1])


def forward(
    tower: VoxtralAudioTower,
    features: jax.Array,
    meta: Any,
    *,
    project: bool = True,
    out_sharding: OutSharding = None,
) -> jaxsync.Encoded:
    """Pure forward: log-mel windows -> audio embeddings, callable inside any jit.

    Args:
      tower: the module (weights arrive as arguments when merged inside the caller's jit).
      features: `[C_pad, F, 2P]` log-mel windows (the processor's `input_features`, padded to
        the plan's window count).
      meta: `plan(...).meta`, uploaded (`jaxsync.upload_packed(plan)`) or as host arrays.
      project: the projector's rows (True) or the Whisper encoder's `last_hidden_state` rows
        (False); plan with the same `project`.
      out_sharding: where the rows go: a `Sharding`, a `PartitionSpec` over the weights' mesh
        (e.g. `P("data")` for a batch the server splits), or None: replicated over the weights'
        mesh (unconstrained for weights on one device).

    Returns:
      `jaxsync.Encoded`: rows `[C_pad * n, D]` (window c owns rows `c * n ...`, n =
      `plan.rows_per_chunk`, so item i's rows follow item i - 1's), and `finite` `[I_pad]`:
      every window of item i had finite features and rows (False for a padding item).

    Raises:
      ValueError: while tracing, features of another shape than the plan's windows.
    """
    cfg = tower.cfg
    want = (meta.row_audio.shape[0], cfg.num_mel_bins, cfg.chunk_frames)
    if tuple(features.shape) != want:
        raise ValueError(
            f"features {tuple(features.shape)} do not fit the plan: it has {want[0]} windows of "
            f"{want[1]} mel bins x {want[2]} frames ({list(want)})"
        )
    out = tower.encode(features)  # [C, P, D]
    if project:
        out = tower.multi_modal_projector(out)  # [C, P/g, V]
    ok = jnp.all(jnp.isfinite(features), axis=(1, 2)) & jnp.all(jnp.isfinite(out), axis=(1, 2))
    item_chunks = jnp.asarray(meta.item_chunks)  # host arrays: constants of the program
    # Padding windows (row_audio >= I) fall outside every segment; an empty item keeps the
    # identity of `segment_min` (the int32 max), so it needs its own "has windows" test.
    worst = jax.ops.segment_min(
        ok.astype(jnp.int32), jnp.asarray(meta.row_audio), num_segments=item_chunks.shape[0]
    )
    finite = (worst == 1) & (item_chunks > 0)
    rows = place_rows(tower, out.reshape(-1, out.shape[-1]), out_sharding)
    return jaxsync.Encoded(rows, finite)


def forward_waveforms(
    tower: VoxtralAudioTower,
    waveforms: jax.Array,
    meta: Any,
    *,
    mel: MelSpec,
    project: bool = True,
    out_sharding: OutSharding = None,
) -> jaxsync.Encoded:
    """`forward` behind the on-device log-mel: padded waveforms `[B_pad, W]` -> `Encoded`.

    `meta` is `plan_waveforms(...).meta` and `mel` its `plan.mel`; `finite[b]` also requires
    every real sample of audio b to be finite; `out_sharding` is `forward`'s.
    """
    features, samples_ok = log_mel_rows(waveforms, meta, spec=mel)  # [C, F, 2P], [B]
    out = forward(tower, features, meta, project=project, out_sharding=out_sharding)
    return out._replace(finite=out.finite & samples_ok)


def server_form(
    project: bool = True, mel: MelSpec | None = None, out_sharding: OutSharding = None
) -> Callable[..., Any]:
    """The pure function the entry compiles, `fn(tower, inputs, meta) -> Encoded`: `forward`
    over features (`mel=None`), else `forward_waveforms` with the front end `mel`; rows placed
    by `out_sharding` (`forward`'s).

    One object per settings, so every encoder of one structure shares its compiled programs.
    """
    return _server_form(project, mel, out_sharding)  # one cache key however it is called


@functools.cache
def _server_form(project: bool, mel: MelSpec | None, out_sharding: OutSharding) -> Callable:
    if mel is None:
        if project and out_sharding is None:
            return forward
        return functools.partial(forward, project=project, out_sharding=out_sharding)
    return functools.partial(forward_waveforms, mel=mel, project=project, out_sharding=out_sharding)
