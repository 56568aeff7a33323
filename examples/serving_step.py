"""A small but honest serving loop built from jaxsync paths, run under the sync guard.

One multimodal request at a time, the way a server runs it:

1. prefill: the image goes through Chameleon's VQ tokenizer (pixels -> BPE ids, on device), the
   image-token embeddings are merged into the prompt at the `<image>` placeholders (positions from
   the host-side prompt), and the prompt's KV rows are written into a paged cache at slots computed
   from a host-side block table;
2. decode: each step embeds the previous token *on device*, writes its KV row, computes logits with
   the image-token mask, and picks the next token on device;
3. between steps the scheduler swaps a block out to pinned host memory and back (block ids are
   host data), as a KV offload would.

The sampled tokens are read back the way tpu-inference does it: `copy_to_host_async` after the next
step is dispatched, read one step later. That is the only deliberate readback, counted separately;
every other host sync raises (`JAXSYNC_SYNC_CHECK=error` plus `sync_guard("error")`), and
`no_recompile()` proves the steady state compiles nothing.

The "language model" is a toy (one tanh layer over embeddings): the point is the data movement.

Run: python examples/serving_step.py --steps 64
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxsync
from jaxsync import check
from jaxsync.kv import host_pool, inject_kv, swap_in, swap_out
from jaxsync.models.chameleon import ChameleonConfig, ChameleonImageEncoder, ChameleonVQVAE
from jaxsync.paths.chameleon.reference import tiny_hf_config


BLOCK, HEADS, HEAD_DIM, LAYERS, NUM_BLOCKS = 4, 2, 8, 2, 64


class ToyLM:
    """Embedding table, one tanh layer, K/V projections and an LM head; jitted step functions."""

    def __init__(self, vocab: int, dim: int, seed: int = 0):
        k = jax.random.split(jax.random.key(seed), 4)
        self.embed = jax.random.normal(k[0], (vocab, dim)) * 0.1  # [V, D]
        self.w = jax.random.normal(k[1], (dim, dim)) / np.sqrt(dim)  # [D, D]
        self.w_kv = jax.random.normal(k[2], (dim, LAYERS, HEADS, 2 * HEAD_DIM)) * 0.1
        self.lm_head = jax.random.normal(k[3], (vocab, dim)) * 0.1  # [V, D]

    @staticmethod
    @jax.jit
    def layer(w, w_kv, x):
        # x: [T, D] -> hidden [T, D], per-layer KV rows {layer: [T, K, 2H]}
        h = jnp.tanh(x @ w)
        kv = jnp.einsum("TD,DLKX->LTKX", h, w_kv)
        return h, kv

    @staticmethod
    @jax.jit
    def embed_ids(table, ids):
        return jnp.take(table, ids, axis=0)


@partial(jax.jit, static_argnums=1)
def _kv_dict(kv: jax.Array, size: int) -> dict[str, jax.Array]:
    # [L, T, K, 2H] -> {layer: [size, K, 2H]}, rows padded to the slot bucket inject_kv expects.
    pad = ((0, size - kv.shape[1]), (0, 0), (0, 0))
    return {f"layer{i}": jnp.pad(kv[i], pad) for i in range(LAYERS)}


@jax.jit
def _argmax_last(logits):  # [T, V] -> [1] int32, the next token (greedy)
    return jnp.argmax(logits[-1:], axis=-1).astype(jnp.int32)


class Server:
    def __init__(self, seed: int = 0):
        cfg = ChameleonConfig.from_hf_config(tiny_hf_config())
        self.paths = ChameleonImageEncoder(
            cfg, ChameleonVQVAE(cfg.vq, rngs=nnx.Rngs(seed)), buckets=(1,)
        )
        self.cfg = cfg
        self.lm = ToyLM(cfg.vocab_size, 32, seed)
        shape = (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM)
        self.cache = {f"layer{i}": jnp.zeros(shape) for i in range(LAYERS)}
        # Block-major pinned-host swap space: one DMA moves a block of every layer.
        self.swap_pool = host_pool(self.cache, NUM_BLOCKS)
        self.free_blocks = list(range(NUM_BLOCKS))
        self.deliberate_reads = 0

    def prefill(self, pixels: np.ndarray, text_ids: list[int]) -> tuple[jax.Array, list[int], int]:
        t = self.cfg.vq.tokens_per_image
        image_id = self.paths.mapping.image_token_id
        prompt = np.array([1, *([image_id] * t), *text_ids], np.int32)
        tokens = self.paths.get_image_tokens(pixels)  # [1, T] BPE ids, on device
        image = self.lm.embed_ids(self.lm.embed, tokens)  # [1, T, D]
        text = self.lm.embed_ids(
            self.lm.embed, jaxsync.async_h2d(np.where(prompt == image_id, 0, prompt))
        )
        merged = self.paths.merge_image_embeddings(text[None], image, input_ids=prompt[None])[0]
        hidden, kv = self.lm.layer(self.lm.w, self.lm.w_kv, merged)
        n = len(prompt)
        blocks = [self.free_blocks.pop(0) for _ in range(-(-(n + 1) // BLOCK))]
        slots = (np.asarray(blocks)[:, None] * BLOCK + np.arange(BLOCK)).reshape(-1)[:n]
        size = jaxsync.bucket(n)
        self.cache = inject_kv(self.cache, _kv_dict(kv, size), slots)
        logits = self.paths.compute_logits(hidden, self.lm.lm_head)
        return _argmax_last(logits), blocks, n

    def decode_step(self, token: jax.Array, blocks: list[int], pos: int) -> jax.Array:
        if pos // BLOCK >= len(blocks):
            blocks.append(self.free_blocks.pop(0))  # host-side block table grows
        x = self.lm.embed_ids(self.lm.embed, token)  # [1, D], the token never leaves the device
        hidden, kv = self.lm.layer(self.lm.w, self.lm.w_kv, x)
        slot = [blocks[pos // BLOCK] * BLOCK + pos % BLOCK]
        self.cache = inject_kv(self.cache, _kv_dict(kv, 8), slot)
        logits = self.paths.compute_logits(hidden, self.lm.lm_head)
        return _argmax_last(logits)

    def swap_out_and_in(self, block: int, spare: int) -> None:
        # Offload one block to pinned host, then bring it back (ids are host data).
        self.swap_pool = swap_out(self.cache, self.swap_pool, [block], [spare])
        self.cache = swap_in(self.swap_pool, self.cache, [spare], [block])


def run(steps: int = 64, seed: int = 0, quiet: bool = False) -> dict[str, float]:
    os.environ.setdefault(check.ENV_VAR, "error")
    server = Server(seed)
    rng = np.random.default_rng(seed)
    pixels = rng.standard_normal((1, *server.paths.image_shape)).astype(np.float32)
    token, blocks, pos = server.prefill(pixels, [5, 6, 7])
    # Warm-up: one step of each kind compiles every program the loop uses.
    token = server.decode_step(token, blocks, pos)
    server.swap_out_and_in(blocks[0], 0)
    pos += 1
    jax.block_until_ready(token)

    generated, pending = [], None
    t0 = time.perf_counter()
    with check.no_recompile(), check.sync_guard("error"):
        for step in range(steps):
            token = server.decode_step(token, blocks, pos)
            pos += 1
            if step % 8 == 7:
                server.swap_out_and_in(blocks[0], 1 + step % 4)
            if pending is not None:  # read the previous step's token: its copy has finished
                with check.allow_sync():
                    generated.append(int(np.asarray(pending)[0]))
                    server.deliberate_reads += 1
            with check.allow_sync():
                token.copy_to_host_async()  # start the next readback without waiting
            pending = token
    with check.allow_sync():
        generated.append(int(np.asarray(pending)[0]))
    elapsed = time.perf_counter() - t0
    result = {
        "steps": steps,
        "steps_per_s": steps / elapsed,
        "unintended_host_syncs": 0,  # any would have raised inside sync_guard("error")
        "deliberate_delayed_reads": server.deliberate_reads + 1,
        "tokens": generated,
    }
    if not quiet:
        print(
            f"{steps} decode steps in {elapsed * 1e3:.1f} ms "
            f"({result['steps_per_s']:.0f} steps/s) on {jax.devices()[0].device_kind}; "
            "unintended host syncs: 0; compiles in the loop: 0; "
            f"deliberate delayed token reads: {result['deliberate_delayed_reads']}"
        )
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    run(args.steps, args.seed)
