"""Entry calls on the serving thread: few jit arguments at any depth, and kept calls.

Every entry's main program (the one doing the most work of those a call dispatches) takes at
most 6 jit arguments, or its state's leaves and inputs for an entry on `jaxsync.TowerProgram`,
whatever the model's depth (a shallow and a deep model are compared). A
repeated call on device inputs is served by the entry's kept call: it skips the checks on a
short hot path and gives the same answer, refuses a deleted or misplaced input, sees new
weights, and keeps nothing traced.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsync
from jaxsync._calls import CallCache
from jaxsync.harness.bench._programs import main_program_args


def _glm4v(depth: int):
    from jaxsync.harness.paths.glm4v import reference as ref
    from jaxsync.models import glm4v

    cfg = glm4v.Glm4vVisionConfig(**{**ref.TINY, "depth": depth})
    enc = glm4v.Glm4vVisionEncoder(glm4v.Glm4vVisionTower(cfg, rngs=nnx.Rngs(0)))
    grid = [[1, 4, 6], [1, 6, 6]]
    pixels = jnp.zeros((enc.plan(grid).padded_patches, cfg.patch_dim), jnp.float32)
    return lambda x: enc(x, grid), pixels


def _voxtral(depth: int):
    from jaxsync.harness.paths.voxtral import reference as ref
    from jaxsync.models import voxtral

    cfg = voxtral.VoxtralAudioConfig(**{**ref.TINY_ENCODER, "num_hidden_layers": depth})
    enc = voxtral.VoxtralAudioEncoder(voxtral.VoxtralAudioTower(cfg, rngs=nnx.Rngs(0)))
    feats = jnp.zeros((4, cfg.num_mel_bins, cfg.chunk_frames), jnp.float32)
    return lambda x: enc(input_features=x, num_chunks=[1, 2]), feats


def _gemma3n(depth: int):
    from jaxsync.harness.paths.gemma3n import reference as ref
    from jaxsync.models.gemma3n import Gemma3nAudioEncoder, Gemma3nAudioModel

    cfg = dataclasses.replace(ref.tiny_config(), conf_num_hidden_layers=depth)
    enc = Gemma3nAudioEncoder(Gemma3nAudioModel(cfg, rngs=nnx.Rngs(0)))
    feats = jnp.zeros((3, 57, cfg.input_feat_size), jnp.float32)
    mask = np.arange(57)[None, :] < np.array([57, 40, 13])[:, None]
    return lambda x: enc(x, mask), feats


def _chameleon(depth: int):
    from jaxsync.harness.paths.chameleon import reference as ref
    from jaxsync.models import chameleon

    cfg = chameleon.ChameleonConfig.from_hf_config(ref.tiny_hf_config(num_res_blocks=depth))
    tower = chameleon.ChameleonImageTower(cfg, rngs=nnx.Rngs(0))
    enc = chameleon.ChameleonImageEncoder(tower, buckets=(4,))
    pixels = jnp.zeros((3, *enc.image_shape), jnp.float32)
    return lambda x: enc(x), pixels


def _qwen3_omni(depth: int):
    from jaxsync.harness.paths.qwen3_omni import reference as ref
    from jaxsync.models import qwen3_omni as q3

    cfg = q3.Qwen3OmniAudioConfig(**{**ref.TINY.__dict__, "encoder_layers": depth})
    enc = q3.Qwen3OmniAudioEncoder(q3.Qwen3OmniAudioTower(cfg, rngs=nnx.Rngs(0)))
    lens = [120, 0, 31]
    x = jaxsync.async_h2d(q3.pad_features(ref.random_features(cfg, lens), lens))
    return lambda x: enc(x, lens), x


def _kv_stacked(depth: int):
    from jaxsync import kv

    layout = kv.KVLayout(
        kind="packed", num_blocks=32, block_size=4, num_kv_heads=2, head_dim=8, stacked=True
    )
    cache = layout.random([f"layer{i}" for i in range(depth)], jax.random.key(0))
    other = layout.random([f"layer{i}" for i in range(depth)], jax.random.key(1))
    return lambda x: kv.copy_blocks(x, other, [1, 2, 3], [4, 5, 6]), cache


ENTRIES = {
    "glm4v": (_glm4v, (1, 5)),
    "voxtral": (_voxtral, (1, 5)),
    "gemma3n": (_gemma3n, (2, 5)),
    "chameleon": (_chameleon, (1, 3)),
    "qwen3_omni": (_qwen3_omni, (1, 7)),
    "kv_stacked": (_kv_stacked, (2, 17)),
}
# Entries on `jaxsync.TowerProgram`: the state's leaves (one per weight kind, the layers
# stacked) and the inputs.
MAX_ARGS = {"glm4v": 21 + 2, "qwen3_omni": 29 + 2, "gemma3n": 31 + 2}
MAX_ARGS["voxtral"] = 24 + 2  # the tower's 24 leaves, the input and the packed meta
# packed state: one flat buffer and one row buffer per layer stack (6), the pixels, the meta
MAX_ARGS["chameleon"] = 7 + 2


@pytest.mark.parametrize("family", sorted(ENTRIES))
def test_entry_main_program_takes_few_jit_arguments_at_any_depth(family):
    build, depths = ENTRIES[family]
    counts = []
    for depth in depths:
        call, x = build(depth)
        counts.append(main_program_args(lambda call=call, x=x: call(x)))
    assert counts[0] == counts[1] and 2 <= counts[0] <= MAX_ARGS.get(family, 6), counts


def test_argument_count_sees_a_per_leaf_program():
    # Negative control: a per-layer kv cache hands the copy program one array per layer.
    from jaxsync import kv

    layout = kv.KVLayout(kind="packed", num_blocks=32, block_size=4, num_kv_heads=2, head_dim=8)
    cache = layout.random([f"layer{i}" for i in range(9)], jax.random.key(0))
    other = layout.random([f"layer{i}" for i in range(9)], jax.random.key(1))
    assert main_program_args(lambda: kv.copy_blocks(cache, other, [1], [2])) == 9 + 9 + 1


TOWERS = sorted(f for f in ENTRIES if not f.startswith("kv"))


@pytest.fixture
def call_cache_spy(monkeypatch):
    """Records each `CallCache.find` answer (hit or miss) and each `keep` (a full-path call)."""
    seen: list[str] = []
    find, keep = CallCache.find, CallCache.keep

    def spy_find(self, x, *metadata):
        run, key = find(self, x, *metadata)
        seen.append("miss" if run is None else "hit")
        return run, key

    def spy_keep(self, key, run):
        seen.append("keep")
        return keep(self, key, run)

    monkeypatch.setattr(CallCache, "find", spy_find)
    monkeypatch.setattr(CallCache, "keep", spy_keep)
    return seen


def _host(out):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(out)]


@pytest.mark.parametrize("family", TOWERS)
def test_repeated_device_call_skips_the_checks_and_gives_the_same_answer(family, call_cache_spy):
    build, depths = ENTRIES[family]
    call, x = build(depths[0])
    first = _host(call(x))
    assert "keep" in call_cache_spy and "hit" not in call_cache_spy  # the full path, once
    call_cache_spy.clear()
    second = _host(call(x))
    assert call_cache_spy == ["hit"]  # no check, no plan lookup, no new entry
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("family", TOWERS)
def test_repeated_call_on_a_deleted_array_is_refused(family, call_cache_spy):
    build, depths = ENTRIES[family]
    call, x = build(depths[0])
    jax.block_until_ready(call(x))
    jax.block_until_ready(call(x))
    x.delete()
    call_cache_spy.clear()
    with pytest.raises(ValueError, match="deleted"):
        call(x)
    assert call_cache_spy == ["hit"]  # the prepared call itself refused it


@pytest.mark.parametrize("family", TOWERS)
def test_same_shape_on_other_devices_is_checked_again(family, call_cache_spy):
    build, depths = ENTRIES[family]
    call, x = build(depths[0])
    jax.block_until_ready(call(x))
    call_cache_spy.clear()
    away = jax.device_put(x, jax.devices()[1])  # same shape and dtype, away from the weights
    with pytest.raises(ValueError, match="on devices"):
        call(away)
    assert call_cache_spy[0] == "miss"


def _own_frames(fn) -> int:
    """Python frames of jaxsync's own code (core, models, kv) that one call of `fn` runs."""
    import os
    import sys

    roots = tuple(
        os.path.dirname(m.__file__) + os.sep
        for m in (jaxsync, __import__("jaxsync.models").models, __import__("jaxsync.kv").kv)
    )
    seen = [0]

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(roots):
            seen[0] += 1

    sys.setprofile(profile)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    jax.block_until_ready(out)
    return seen[0]


@pytest.mark.parametrize("family", TOWERS)
def test_repeated_device_call_runs_a_short_hot_path(family, monkeypatch):
    # What a serving thread pays per call right after a wait grows with the Python it runs:
    # a repeated call stays within a dozen frames of jaxsync's own code.
    build, depths = ENTRIES[family]
    call, x = build(depths[0])
    jax.block_until_ready(call(x))
    kept = _own_frames(lambda: call(x))
    assert kept <= 13, kept
    # control: the same call with every kept call missed runs the full checks
    find = CallCache.find
    monkeypatch.setattr(CallCache, "find", lambda self, x, *m: (None, find(self, x, *m)[1]))
    assert _own_frames(lambda: call(x)) >= kept + 8


def test_chameleon_full_bucket_kept_calls_match_and_refuse_deleted_pixels():
    from jaxsync.harness.paths.chameleon import reference as ref
    from jaxsync.models import chameleon

    cfg = chameleon.ChameleonConfig.from_hf_config(ref.tiny_hf_config(num_res_blocks=1))
    tower = chameleon.ChameleonImageTower(cfg, rngs=nnx.Rngs(0))
    enc = chameleon.ChameleonImageEncoder(tower, buckets=(4,))
    x = jax.random.normal(jax.random.key(0), (4, *enc.image_shape), jnp.float32)
    first_rows, first_ids = enc(x), enc.get_image_tokens(x)
    again_rows, again_ids = enc(x), enc.get_image_tokens(x)  # both kept: no pad, one program
    np.testing.assert_array_equal(np.asarray(again_rows.embeddings), first_rows.embeddings)
    np.testing.assert_array_equal(np.asarray(again_ids), np.asarray(first_ids))
    assert again_rows.lengths == first_rows.lengths and again_ids.shape == (4, enc.tokens_per_image)
    np.testing.assert_array_equal(
        np.asarray(again_ids).reshape(-1), np.asarray(again_rows.extras["ids"])
    )
    x.delete()
    for entry in (enc, enc.get_image_tokens):
        with pytest.raises(ValueError, match="pixel_values was deleted"):
            entry(x)


def test_gemma3n_kept_call_sees_new_weights_after_load_state():
    from jaxsync.harness.paths.gemma3n import reference as ref
    from jaxsync.models.gemma3n import Gemma3nAudioEncoder, Gemma3nAudioModel

    cfg = ref.tiny_config()
    model = Gemma3nAudioModel(cfg, rngs=nnx.Rngs(0))
    enc = Gemma3nAudioEncoder(model)
    feats = jnp.ones((2, 40, cfg.input_feat_size), jnp.float32)
    mask = np.arange(40)[None, :] < np.array([40, 9])[:, None]  # clip 1 ends in pad rows
    enc(feats, mask)
    before = np.asarray(enc(feats, mask).embeddings)  # a kept call
    state = nnx.state(model.embed_audio)
    nnx.update(model.embed_audio, jax.tree.map(lambda w: w * 1.5 + 0.25, state))
    enc.load_state(model)
    after = np.asarray(enc(feats, mask).embeddings)
    want = np.asarray(Gemma3nAudioEncoder(model)(feats, mask).embeddings)
    np.testing.assert_array_equal(after, want)  # pad rows included: no stale pad embedding
    assert not np.array_equal(after, before)


@pytest.mark.parametrize("family", TOWERS)
def test_a_call_traced_with_concrete_inputs_keeps_nothing_traced(family, monkeypatch):
    """An entry traced with concrete device inputs closed over (a checker's scan, a server's
    own jit) builds its uploads and prepared call as traced values: none may be kept, or the
    next real call would run on a leaked tracer."""
    build, depths = ENTRIES[family]
    call, x = build(depths[0])
    jax.make_jaxpr(lambda: call(x))()
    want = _host(call(x))  # a real call after the traced one
    again = _host(call(x))  # and its repeat (kept now)
    for a, b in zip(want, again, strict=True):
        np.testing.assert_array_equal(a, b)
    # control: keeping during the trace is what leaks
    call, x = build(depths[0])
    monkeypatch.setattr(jaxsync._compat, "tracing", lambda: False)
    jax.make_jaxpr(lambda: call(x))()
    with pytest.raises(jax.errors.UnexpectedTracerError):
        jax.block_until_ready(call(x))
