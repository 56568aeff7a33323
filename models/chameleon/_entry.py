# ruff: noqa: F722 - jaxtyping shape strings are not forward references
"""`ChameleonImageEncoder`: Chameleon's sync-free image paths behind one host object.

Pixels -> VQ codes -> BPE image-token ids in one jitted program per batch bucket (vLLM post-PR
gathers through a cached device copy of `img2bpe`; pre-PR and HF read the codes back to the CPU
for the lookup). The same object offers the image-token logit mask, logits with the mask, and the
placeholder merge (`TextSidePaths`), each one jitted call with its tables from a `DeviceCache`.
Nothing is read back. The pure functions behind them (`forward`, `img2bpe`, `mask_image_logits`,
`compute_logits`, `merge_image_tokens`) are for a server's own jitted step.
"""

from __future__ import annotations

import functools as ft
import os
from typing import Any

import jax
import numpy as np
from jaxtyping import Array, Float, Int

import jaxsync
import jaxsync.check
from jaxsync.models.chameleon._config import ChameleonConfig
from jaxsync.models.chameleon._modules import ChameleonVQVAE, forward
from jaxsync.models.chameleon._placing import (
    batch_shards,
    check_same_devices,
    pad_rows,
    replicated_on,
    weights_devices,
)
from jaxsync.models.chameleon._plan import (
    bucket_batch_sizes,
    check_pixels,
    host_pixels,
    plan_images,
)
from jaxsync.models.chameleon._text import TextSidePaths
from jaxsync.models.chameleon._vocab import ImageVocabularyMapping, check_device_array, img2bpe
from jaxsync.models.chameleon._weights import load_model


def _tokens(model: ChameleonVQVAE, pixels, meta, table):  # -> ids [Bp*T], finite [Bp]
    codes, finite = forward(model, pixels, meta)
    return img2bpe(codes, table).reshape(-1), finite


@ft.partial(jax.jit, static_argnums=(1, 2))
def _token_rows(ids: jax.Array, n: int, t: int) -> jax.Array:  # [Bp*T] -> [n, T]
    return ids[: n * t].reshape(n, t)


@ft.partial(jax.jit, static_argnums=1)
def _take_rows(x: jax.Array, n: int) -> jax.Array:
    return x[:n]


def _as_embeddings(enc, ids, finite, n: int, rows: int, layout) -> jaxsync.Embeddings:
    flag = finite if n == rows else _take_rows(finite, n)
    return jaxsync.Embeddings.from_layout(ids, layout, {"finite": flag})


def _as_token_rows(enc, ids, finite, n: int, rows: int, layout) -> jax.Array:
    return _token_rows(ids, n, enc.tokens_per_image)


class ChameleonImageEncoder(TextSidePaths):
    """Image tokenizer, logit mask and embedding merge of one Chameleon model.

    Args:
      cfg: the model config.
      vq_model: the loaded VQ model (`load_model`); None builds the text-side paths only.
      missing_code_id: see `ImageVocabularyMapping` (None: with `vq_model`, a VQ code without a
        name is an error).
      cache: the `DeviceCache` for the constant tables (default: the process-wide one).
      buckets: image batch buckets (default: powers of two).
      placement: where host pixels go (a device, or a sharding; one that splits the batch
        axis over a mesh's data axis pads the batch to a multiple of that axis).

    The encoder snapshots the VQ weights: after `nnx.update(vq_model, ...)` call
    `load_state(vq_model)` (no recompile). Compilation: one program per batch bucket; the first
    call of a bucket also compiles the tiny row slices (and row pads for device pixels) for every
    batch size of that bucket, so later calls in the bucket compile nothing.

    >>> import jax.numpy as jnp
    >>> from jaxsync.paths.chameleon import reference as ref
    >>> enc = ChameleonImageEncoder(ChameleonConfig.from_hf_config(ref.tiny_hf_config()))
    >>> logits = enc.mask_image_logits(jnp.zeros((2, enc.cfg.vocab_size)))
    >>> bool(logits[0, enc.mapping.image_token_ids[0]] == jnp.finfo(jnp.float32).min)
    True
    """

    def __init__(
        self,
        cfg: ChameleonConfig,
        vq_model: ChameleonVQVAE | None = None,
        *,
        missing_code_id: int | None = None,
        cache: jaxsync.DeviceCache | None = None,
        buckets: tuple[int, ...] | None = None,
        placement: jax.Device | jax.sharding.Sharding | None = None,
    ):
        self.cfg = cfg
        self.mapping = ImageVocabularyMapping(
            cfg.vocabulary_map,
            num_embeddings=cfg.vq.num_embeddings,
            missing_code_id=missing_code_id,
            cache=cache,
        )
        self.buckets = buckets
        self.placement = placement
        self.image_shape = (cfg.vq.in_channels, cfg.vq.resolution, cfg.vq.resolution)
        self.tokens_per_image = cfg.vq.tokens_per_image
        self._plans = jaxsync.PlanCache()
        # Repeated calls on device pixels, one cache per output form.
        self._embedding_calls, self._token_calls = jaxsync.CallCache(), jaxsync.CallCache()
        self._warm: set[tuple] = set()
        self._placings: dict[Any, tuple[int, Any]] = {}
        self._program = None
        if vq_model is not None:
            if not isinstance(vq_model, ChameleonVQVAE) or vq_model.cfg != cfg.vq:
                raise ValueError("vq_model was not built from this config's vq config")
            self.mapping.check_code_table()  # the tokenizer needs every code named
            self._program = jaxsync.TowerProgram(vq_model, _tokens)
            self._encode = jaxsync.TowerProgram(vq_model, lambda m, x: m(x))
            self._devices, weights_at = weights_devices(vq_model)
            if placement is None and len(self._devices) > 1:  # host pixels go to the weights
                self.placement = replicated_on(weights_at)

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, *, dtype=None, mesh=None, **kwargs
    ) -> ChameleonImageEncoder:
        """Reads `config.json` and the `model.vqmodel.*` weights of a checkpoint directory."""
        cfg = ChameleonConfig.from_hf_config(path)
        return cls(cfg, load_model(path, cfg, dtype=dtype, mesh=mesh), **kwargs)

    def load_state(self, vq_model: ChameleonVQVAE) -> None:
        """Takes new weights of the same structure (e.g. after `nnx.update`), no recompile."""
        self._require_model()
        self._program.load_state(vq_model)
        self._encode.load_state(vq_model)

    # ------------------------------------------------------------ image tokens

    @jaxsync.check.entry_point
    def __call__(self, pixel_values) -> jaxsync.Embeddings:
        """Images -> BPE image-token ids, as `jaxsync.Embeddings`.

        Args:
          pixel_values: `[B, C, R, R]` normalised pixels: numpy or a torch CPU tensor (what
            `ChameleonImageProcessor` returns; refused if not finite), or a device `jax.Array`
            (possibly sharded over a mesh's data axis).

        Returns:
          `Embeddings` whose rows are token ids, not vectors: `embeddings` is int32 `[Bp * T]`
          (image `i` at rows `i*T : (i+1)*T`, raster order; rows past `B*T` are bucket padding).
          Chameleon's image tokens are ordinary vocabulary ids that the server embeds with its
          own table inside its own step. `extras["finite"]`: bool `[B]`, False where a device
          image held a NaN or inf (computed on the device, never read back).

        Raises:
          TypeError: wrong type or dtype, a torch tensor off the CPU.
          ValueError: wrong rank or image size, no image, non-finite host pixels, a deleted
            (donated) array, or pixels placed apart from the weights or split off the batch axis.
        """
        return self._run(pixel_values, self._embedding_calls, _as_embeddings)

    @jaxsync.check.entry_point
    def get_image_tokens(self, pixel_values) -> Int[Array, "B T"]:
        """BPE ids `[B, T]` of each image's tokens in raster order (HF `get_image_tokens`)."""
        return self._run(pixel_values, self._token_calls, _as_token_rows)

    def encode(self, pixel_values: jax.Array) -> tuple[Float[Array, "B h w L"], Int[Array, "B T"]]:
        """Encoder latents (NHWC, before `quant_conv`) and VQ codes, unbucketed (for parity)."""
        self._require_model()
        check_device_array(pixel_values, "pixel_values")
        return self._encode(pixel_values)

    def _require_model(self) -> None:
        if self._program is None:
            raise ValueError("built without a VQ model: pass vq_model= to tokenize images")

    def _run(self, pixel_values, calls: jaxsync.CallCache, finish):
        """`finish(self, ids, finite, n, rows, layout)` of the tokenized batch; a repeated call
        on device pixels runs the prepared call kept in `calls`."""
        run, key = calls.find(pixel_values)
        if run is not None:
            return run(pixel_values)
        self._require_model()
        on_device = isinstance(pixel_values, jax.Array)
        if on_device:
            check_device_array(pixel_values, "pixel_values")
            n = check_pixels(pixel_values, self.image_shape)
            traced = isinstance(pixel_values, jax.core.Tracer)  # static scans of jaxsync.check
            where = None if traced or not pixel_values.committed else pixel_values.sharding
            if where is not None:
                check_same_devices(where, self._devices, "pixel_values")
            shards, near = self._placing(where, "pixel_values")
        else:
            pixel_values = host_pixels(pixel_values)
            n = check_pixels(pixel_values, self.image_shape)
            where = self.placement
            shards, near = self._placing(where, "placement")
        # Host pixels: NaN / inf refused before a new plan's metadata goes up, or, on a known
        # plan, as they are copied into their staging buffer (one pass over them).
        check = None
        if not on_device:
            check = lambda: jaxsync.check_finite(pixel_values, name="pixel_values")  # noqa: E731
        plan, meta, table, layout = self._plans.get(
            (n, shards, near), lambda: self._plan(n, shards, near), on_miss=check
        )
        rows = plan.rows
        if not on_device:
            pixels = jaxsync.default_staging.put(
                pixel_values, (rows, *self.image_shape), placement=where, finite="pixel_values"
            )
            ids, finite = self._program(pixels, meta, table)
            self._warm_bucket(rows, shards, ids, finite, pixel_values, where)
            return finish(self, ids, finite, n, rows, layout)
        pad = None if n == rows else pad_rows(where)

        def tokens(x: jax.Array):
            ids, finite = self._program(x if pad is None else pad(x, rows), meta, table)
            return ids, finite, finish(self, ids, finite, n, rows, layout)

        ids, finite, out = tokens(pixel_values)
        self._warm_bucket(rows, shards, ids, finite, pixel_values, where)
        if pad is None:  # a full bucket: the program and the output's assembly, nothing else
            run = self._program.prepared(
                meta, table, finish=lambda outs: finish(self, *outs, n, rows, layout),
                name="pixel_values",
            )  # fmt: skip
        else:
            run = jaxsync.prepared_call(lambda x: tokens(x)[2], "pixel_values")
        calls.keep(key, run)
        return out

    def _placing(self, where, name: str) -> tuple[int, Any]:
        """(batch shards, replicated placement) of pixels at `where`, memoised per sharding."""
        hit = self._placings.get(where)
        if hit is None:
            hit = (batch_shards(where, name), replicated_on(where))
            self._placings[where] = hit  # only valid placements are kept
        return hit

    def _plan(self, n: int, shards: int, near):
        """(plan, uploaded meta, img2bpe table, output row layout) of n images."""
        plan = plan_images(n, self.buckets, batch_shards=shards)
        t = self.tokens_per_image
        layout = jaxsync.Embeddings.layout((t,) * n, range(0, n * t, t))
        meta = jaxsync.upload_packed(plan.fields, placement=near)
        return plan, meta, self.mapping.img2bpe_on(near), layout

    def _warm_bucket(self, rows, shards, ids, finite, pixel_values, where) -> None:
        # Compile the per-batch-size slice / pad programs of this bucket once, on its first use,
        # by dispatching them on arrays of the exact shardings later calls will pass.
        if isinstance(ids, jax.core.Tracer):  # traced by a static scan: nothing runs
            return
        on_device = isinstance(pixel_values, jax.Array)
        key = (rows, on_device, pixel_values.dtype, where)
        if key in self._warm:
            return
        self._warm.add(key)
        for n in bucket_batch_sizes(rows, self.buckets, shards):
            _token_rows(ids, n, self.tokens_per_image)
            if n < rows:
                _take_rows(finite, n)
                if on_device:
                    dummy = jax.device_put(
                        np.zeros((n, *self.image_shape), pixel_values.dtype), where
                    )
                    pad_rows(where)(dummy, rows)
