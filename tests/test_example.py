"""examples/serving_step.py runs sync-free and recompile-free at a tiny size."""

import pytest


EXAMPLE = "serving_step"


def test_serving_loop_is_sync_free_and_deterministic(monkeypatch, load_example):
    monkeypatch.setenv("JAXSYNC_SYNC_CHECK", "error")
    example = load_example(EXAMPLE)
    first = example.run(steps=20, quiet=True)
    second = example.run(steps=20, quiet=True)
    assert first["unintended_host_syncs"] == 0
    assert len(first["tokens"]) == 20 and first["deliberate_delayed_reads"] == 20
    assert first["tokens"] == second["tokens"]


def test_serving_loop_guard_would_catch_a_sync(monkeypatch, load_example):
    # Negative control: a server that reads the token back inside the step is caught.
    from jaxsync.check import SyncError

    monkeypatch.setenv("JAXSYNC_SYNC_CHECK", "error")
    example = load_example(EXAMPLE)
    original = example.Server.decode_step

    def reads_back(self, token, blocks, pos):
        out = original(self, token, blocks, pos)
        int(out[0])
        return out

    monkeypatch.setattr(example.Server, "decode_step", reads_back)
    with pytest.raises(SyncError):
        example.run(steps=4, quiet=True)


def test_prefill_step_equals_the_standalone_entry_points(load_example):
    # The server's one jitted prefill step (pure forwards) against the encoder's entry points.
    import jax
    import jax.numpy as jnp
    import numpy as np

    example = load_example(EXAMPLE)
    server = example.Server(0)
    enc = server.encoder
    pixels = np.random.default_rng(3).standard_normal((1, *enc.image_shape)).astype(np.float32)
    prompt = server.prompt([5, 6, 7])
    token, _, n = server.prefill(pixels, [5, 6, 7])
    assert n == len(prompt)
    image = enc(pixels).rows  # the tower's embedded image tokens (the LM's own table)
    want = jnp.take(server.lm["embed"], enc.get_image_tokens(pixels).reshape(-1), axis=0)
    np.testing.assert_array_equal(np.asarray(image), np.asarray(want))
    text = jnp.take(server.lm["embed"], jnp.asarray(prompt), axis=0)
    merged = enc.merge_image_embeddings(text, image, input_ids=prompt)
    hidden, kv = example._layer(server.lm, merged)
    logits = enc.compute_logits(hidden, server.lm["lm_head"])
    assert int(np.asarray(token)[0]) == int(np.argmax(np.asarray(logits)[-1]))
    # the step wrote the prompt's KV rows where inject_kv puts them
    from jaxsync.kv import StackedCache, inject_kv
    from jaxsync.testing import assert_close

    blocks = np.arange(-(-(n + 1) // example.BLOCK))  # a fresh server's first free blocks
    slots = (blocks[:, None] * example.BLOCK + np.arange(example.BLOCK)).reshape(-1)[:n]
    size = example.jaxsync.bucket(n)
    rows = StackedCache(jnp.pad(kv, ((0, size - n), (0, 0), (0, 0), (0, 0))), server.cache.layers)
    empty = jax.tree.map(jnp.zeros_like, server.cache)
    assert_close(server.cache.kv, inject_kv(empty, rows, slots).kv, rtol=1e-5)
    # the step takes the server's own arguments only: image tower weights, LM weights, pixels,
    # one packed request upload (KV slots included), the cached mask and the cache (one
    # stacked array, whatever the layer count)
    leaves = jax.tree.leaves(server.tower_leaves) + jax.tree.leaves(server.lm)
    req = example.jaxsync.upload_packed(
        {
            "valid": np.ones(1, bool),
            "img2bpe": enc.plan(1).meta.img2bpe,
            "positions": np.zeros(128, np.int32),
            "slots": np.zeros(128, np.int32),
            "prompt": np.zeros(128, np.int32),
            "last": np.zeros(1, np.int32),
        }
    )
    lowered = example.prefill_step.lower(
        server.tower_merge,
        server.tower_leaves,
        server.lm,
        jnp.zeros((1, *enc.image_shape)),
        req,
        server.mask,
        server.cache,
    )
    assert len(jax.tree.leaves(lowered.args_info)) == len(leaves) + 4


def test_each_step_is_one_program_with_the_kv_write_inside(load_example):
    # No kv entry point and no extra dispatch: a prefill (uploads, then one program) and a
    # decode step each execute one XLA program, and the cache is donated to it.
    import numpy as np

    from jaxsync.harness.bench._programs import jax_executions_per_call

    example = load_example(EXAMPLE)
    server = example.Server(0)
    pixels = np.random.default_rng(3).standard_normal((1, *server.encoder.image_shape))
    pixels = pixels.astype(np.float32)

    def prefill():
        server.free_blocks = list(range(example.NUM_BLOCKS))  # host block table: reuse blocks
        before = server.cache
        token, blocks, pos = server.prefill(pixels, [5, 6, 7])
        assert before.kv.is_deleted()  # written in place by the step
        return token, blocks, pos

    token, blocks, pos = prefill()
    assert jax_executions_per_call(lambda: prefill()[0]) == 1
    assert jax_executions_per_call(lambda: server.decode_step(token, blocks, pos)) == 1
    # control: the counter sees a second program in the same call
    assert jax_executions_per_call(lambda: server.decode_step(prefill()[0], blocks, pos)) == 2
