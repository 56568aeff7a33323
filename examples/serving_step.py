"""A small but honest serving loop built from jaxsync paths, run under the sync guard.

One multimodal request at a time, the way a server runs it:

1. prefill, ONE jitted step of the server's own: Chameleon's image tower (`forward`: pixels ->
   VQ codes -> BPE ids -> their text embedding rows) with the tower's weights as step
   arguments, the embedded image tokens merged into the prompt at the `<image>` placeholders
   (`merge_image_tokens`, positions planned on the host from the prompt), the toy layer, and the
   logits with the image-token mask (`compute_logits`), and the prompt's KV rows written into
   the paged cache (`jaxsync.kv.write_slots`, the cache donated: updated in place). The
   request's host metadata (image validity, merge positions, prompt ids, and the KV slots
   planned by `jaxsync.kv.plan_slots` from a host-side block table) goes up in one packed
   transfer; the cached logit mask column is a plain step argument;
2. decode: each step embeds the previous token *on device*, computes the masked logits, picks
   the next token and writes its KV row, in one jitted step with one packed upload (the slot);
3. between steps the scheduler swaps a block out to pinned host memory and back (block ids are
   host data), as a KV offload would.

The cache is a `StackedCache` (all layers in one block-major array), so the steps' arguments do
not grow with the layer count.

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
from jaxsync.harness.paths.chameleon.reference import tiny_hf_config
from jaxsync.kv import (
    StackedCache,
    host_pool,
    plan_slots,
    stack_layers,
    swap_in,
    swap_out,
    write_slots,
)
from jaxsync.models.chameleon import (
    ChameleonConfig,
    ChameleonImageEncoder,
    ChameleonImageTower,
    compute_logits,
    forward,
    merge_image_tokens,
    plan_merge,
)


BLOCK, HEADS, HEAD_DIM, LAYERS, NUM_BLOCKS = 4, 2, 8, 2, 64


def toy_lm(vocab: int, dim: int, seed: int = 0) -> dict[str, jax.Array]:
    """Embedding table, one tanh layer, K/V projections and an LM head."""
    k = jax.random.split(jax.random.key(seed), 4)
    return {
        "embed": jax.random.normal(k[0], (vocab, dim)) * 0.1,  # [V, D]
        "w": jax.random.normal(k[1], (dim, dim)) / np.sqrt(dim),  # [D, D]
        "w_kv": jax.random.normal(k[2], (dim, LAYERS, HEADS, 2 * HEAD_DIM)) * 0.1,
        "lm_head": jax.random.normal(k[3], (vocab, dim)) * 0.1,  # [V, D]
    }


def _layer(lm, x):  # x: [T, D] -> hidden [T, D], KV rows of the stacked cache [T, L, K, 2H]
    h = jnp.tanh(x @ lm["w"])
    return h, jnp.einsum("TD,DLKX->TLKX", h, lm["w_kv"])


def _write(cache, kv, slots):
    # [T, L, K, 2H] rows at slots [N] (N = T's bucket; padding slots are no-ops)
    pad = ((0, slots.shape[0] - kv.shape[0]), (0, 0), (0, 0), (0, 0))
    return write_slots(cache, StackedCache(jnp.pad(kv, pad), cache.layers), slots)


def _next_token(logits, last):  # [T, V], index of the last real row -> [1] int32 (greedy)
    return jnp.argmax(jax.lax.dynamic_slice_in_dim(logits, last, 1), axis=-1).astype(jnp.int32)


@partial(jax.jit, static_argnums=0, donate_argnums=6)
def prefill_step(tower_merge, tower_leaves, lm, pixels, req, mask, cache):
    """Image tokens, merge, layer, masked logits and the KV write of one request: one program of
    the server."""
    image = forward(tower_merge(tower_leaves), pixels, req)  # rows [Bp*T, D], finite [Bp]
    text = jnp.take(lm["embed"], req["prompt"], axis=0)  # [S, D], S = the prompt's bucket
    hidden, kv = _layer(lm, merge_image_tokens(text, image.rows, req.positions))
    logits = compute_logits(hidden, lm["lm_head"], mask)  # image columns at finfo.min
    return _next_token(logits, req["last"][0]), _write(cache, kv, req["slots"]), image.finite


@partial(jax.jit, donate_argnums=3)
def decode_step(lm, token, mask, cache, slot):
    x = jnp.take(lm["embed"], token, axis=0)  # [1, D], the token never leaves the device
    hidden, kv = _layer(lm, x)
    token = _next_token(compute_logits(hidden, lm["lm_head"], mask), 0)
    return token, _write(cache, kv, slot["slots"])


class Server:
    def __init__(self, seed: int = 0):
        cfg = ChameleonConfig.from_hf_config(tiny_hf_config())
        tower = ChameleonImageTower(cfg, rngs=nnx.Rngs(seed))
        # The encoder supplies the plans and the mask; the server runs the pure forwards itself.
        self.encoder = ChameleonImageEncoder(tower, buckets=(1,))
        self.tower_leaves, self.tower_merge = jaxsync.flat_state(*nnx.split(tower))
        self.cfg = cfg
        self.lm = toy_lm(cfg.vocab_size, cfg.hidden_size, seed)
        # One text embedding: the tower embeds the image tokens with the table the LM uses.
        self.lm["embed"] = tower.embed_tokens.embedding[...]
        self.mask = self.encoder.mask_column(cfg.vocab_size)
        shape = (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM)
        self.cache = stack_layers({f"layer{i}": jnp.zeros(shape) for i in range(LAYERS)})
        # Block-major pinned-host swap space: one DMA moves a block of every layer.
        self.swap_pool = host_pool(self.cache, NUM_BLOCKS)
        self.free_blocks = list(range(NUM_BLOCKS))
        self.deliberate_reads = 0

    def prompt(self, text_ids: list[int]) -> np.ndarray:
        t, image_id = self.cfg.vq.tokens_per_image, self.encoder.mapping.image_token_id
        return np.array([1, *([image_id] * t), *text_ids], np.int32)

    def prefill(self, pixels: np.ndarray, text_ids: list[int]) -> tuple[jax.Array, list[int], int]:
        prompt = self.prompt(text_ids)
        n, size = len(prompt), jaxsync.bucket(len(prompt))
        images = self.encoder.plan(len(pixels))
        merge = plan_merge(
            (size,),
            images.rows * self.cfg.vq.tokens_per_image,
            input_ids=np.pad(prompt, (0, size - n)),
            image_token_id=self.encoder.mapping.image_token_id,
            num_image_tokens=len(pixels) * self.cfg.vq.tokens_per_image,
        )
        blocks = [self.free_blocks.pop(0) for _ in range(-(-(n + 1) // BLOCK))]
        slots = (np.asarray(blocks)[:, None] * BLOCK + np.arange(BLOCK)).reshape(-1)[:n]
        fields = {
            **images.meta._asdict(),
            **merge.meta._asdict(),
            **plan_slots(self.cache, slots),  # validated and padded to the prompt's bucket
            "prompt": np.pad(prompt, (0, size - n)),
            "last": np.array([n - 1], np.int32),
        }
        req = jaxsync.upload_packed(fields)  # the request's host metadata: one transfer
        staging = np.zeros((images.rows, *self.encoder.image_shape), np.float32)
        staging[: len(pixels)] = pixels
        px = jaxsync.async_h2d(staging, copy=False)
        token, self.cache, _ = prefill_step(
            self.tower_merge, self.tower_leaves, self.lm, px, req, self.mask, self.cache
        )
        return token, blocks, n

    def decode_step(self, token: jax.Array, blocks: list[int], pos: int) -> jax.Array:
        if pos // BLOCK >= len(blocks):
            blocks.append(self.free_blocks.pop(0))  # host-side block table grows
        slot = plan_slots(self.cache, [blocks[pos // BLOCK] * BLOCK + pos % BLOCK])
        token, self.cache = decode_step(
            self.lm, token, self.mask, self.cache, jaxsync.upload_packed(slot)
        )
        return token

    def swap_out_and_in(self, block: int, spare: int) -> None:
        # Offload one block to pinned host, then bring it back (ids are host data).
        self.swap_pool = swap_out(self.cache, self.swap_pool, [block], [spare])
        self.cache = swap_in(self.swap_pool, self.cache, [spare], [block])


def run(steps: int = 64, seed: int = 0, quiet: bool = False) -> dict[str, float]:
    server = Server(seed)
    rng = np.random.default_rng(seed)
    pixels = rng.standard_normal((1, *server.encoder.image_shape)).astype(np.float32)
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
    os.environ.setdefault(check.ENV_VAR, "error")  # armed for the process, as at server start
    run(args.steps, args.seed)
