"""Hostile inputs to every public Gemma 3n entry point: a typed error naming the problem, raised
before any upload or compile, inputs untouched; or a correct result."""

import copy
import dataclasses
import json
import pathlib

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings

import jaxsync
import jaxsync.testing
from jaxsync.check import no_recompile
from jaxsync.harness.paths.gemma3n import reference as R
from jaxsync.models.gemma3n import (
    Gemma3nAudioEncoder,
    Gemma3nAudioModel,
    Gemma3nBuckets,
    from_hf_config,
    host_features,
    load_model,
    merge_audio_embeddings,
    plan,
)
from jaxsync.weights import WeightError


BUCKET = 64


@pytest.fixture(scope="module")
def cfg():
    return R.tiny_config()


@pytest.fixture(scope="module")
def encoder(cfg):
    enc = Gemma3nAudioEncoder(Gemma3nAudioModel(cfg, rngs=nnx.Rngs(0)), frame_buckets=BUCKET)
    feats, mask = R.mel_batch([20, 9], 20, cfg.input_feat_size)
    enc(feats, mask)  # warm: a refused call must not compile either
    return enc


def _refused(monkeypatch, exc, match, fn, *args, **kwargs):
    """`fn(*args)` raises `exc` matching `match` with no upload, no compile, inputs unchanged."""
    before = copy.deepcopy([a for a in args if isinstance(a, np.ndarray | list)])
    with monkeypatch.context() as patch:
        uploads = jaxsync.testing.watch_uploads(patch)
        with no_recompile(), pytest.raises(exc, match=match):
            fn(*args, **kwargs)
    assert not uploads
    after = [a for a in args if isinstance(a, np.ndarray | list)]
    assert _same(before, after)


def _same(a, b) -> bool:
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, np.ndarray):
        nan = a.dtype.kind == "f"
        return a.dtype == b.dtype and np.array_equal(a, b, equal_nan=nan)
    return a == b


def _good(cfg):
    return R.mel_batch([20, 9], 20, cfg.input_feat_size)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_host_features(monkeypatch, cfg, encoder, bad):
    feats, mask = _good(cfg)
    feats[1, 3, 4] = bad
    _refused(monkeypatch, ValueError, "input_features holds a non-finite", encoder, feats, mask)
    feats[1, 3, 4] = 0.0
    feats[1, 15, 0] = bad  # in a padded frame: upstream's reverse-causal conv reads it too
    _refused(monkeypatch, ValueError, "non-finite", encoder, feats, mask)
    _refused(monkeypatch, ValueError, "non-finite", encoder, [feats[0], feats[1]])


@pytest.mark.parametrize(
    "mask_of, exc, match",
    [
        (lambda m: m.astype(np.float32), TypeError, "bools or 0/1 integers"),
        (lambda m: m.astype(np.float64) * 1.0, TypeError, "dtype float64"),
        (lambda m: m.astype(np.int64) * 2, ValueError, "0/1"),
        (lambda m: m[:, :-1], ValueError, "shape"),
        (lambda m: m[:1], ValueError, "shape"),
        (lambda m: m.tolist(), None, None),  # nested lists of bools: accepted
        (lambda m: m.astype(np.int32), None, None),  # 0/1 ints: accepted
        (lambda m: jnp.asarray(m), TypeError, "host data"),
        (lambda m: None, ValueError, "required"),
        (lambda m: np.stack([m[0], np.zeros_like(m[1])]), ValueError, r"clip\(s\) \[1\]"),
    ],
)
def test_frame_masks(monkeypatch, cfg, encoder, mask_of, exc, match):
    feats, mask = _good(cfg)
    bad = mask_of(mask)
    if exc is None:
        got, want = encoder(feats, bad), encoder(feats, mask)
        assert np.array_equal(got.embeddings, want.embeddings)
    else:
        _refused(monkeypatch, exc, match, encoder, feats, bad)


@pytest.mark.parametrize(
    "features_of, exc, match",
    [
        (lambda f: f.astype(np.int32), TypeError, "floating point"),
        (lambda f: f.astype(bool), TypeError, "floating point"),
        (lambda f: f[0], ValueError, "rank|frames, mel"),
        (lambda f: f[..., :-1], ValueError, "mel bins"),
        (lambda f: np.zeros((2, 0, f.shape[2]), np.float32), ValueError, "shape|no valid frame"),
        (lambda f: f.astype(object), TypeError, "numeric"),
        (lambda f: [], ValueError, "no audio clip"),
        (lambda f: [f[0][:, :5]], ValueError, r"\[frames, 13\]"),
        (lambda f: [f[0], [[1.0] * 13, [2.0] * 12]], ValueError, "ragged"),
    ],
)
def test_host_features(monkeypatch, cfg, encoder, features_of, exc, match):
    feats, mask = _good(cfg)
    bad = features_of(feats)
    m = None if isinstance(bad, list) else mask
    if isinstance(bad, np.ndarray) and bad.ndim == 3 and bad.shape[1] == 0:
        m = np.zeros((2, 0), bool)
    _refused(monkeypatch, exc, match, encoder, bad, m)


def test_device_features(monkeypatch, cfg, encoder):
    feats, mask = _good(cfg)
    x = jnp.asarray(feats)
    _refused(monkeypatch, ValueError, r"\[B, frames, 13\]", encoder, x[..., :-1], mask)
    _refused(monkeypatch, TypeError, "floating point", encoder, x.astype(jnp.int32), mask)
    _refused(monkeypatch, ValueError, "shape", encoder, x, mask[:, :-1])
    other = jax.device_put(feats, jax.devices()[-1])
    _refused(monkeypatch, ValueError, "same devices", encoder, other, mask)
    donated = jnp.asarray(feats)
    donated.delete()
    _refused(monkeypatch, ValueError, "deleted", encoder, donated, mask)
    with pytest.raises(TypeError, match="traced"):
        jax.jit(lambda f: encoder(f, mask).embeddings)(x)


def test_overflow_refused_before_upload(monkeypatch, cfg, encoder):
    feats, mask = R.mel_batch([71, 3], 71, cfg.input_feat_size)
    _refused(monkeypatch, ValueError, "soft_tokens", encoder, feats, mask)


def test_merge(monkeypatch, cfg, encoder):
    feats, mask = _good(cfg)
    audio = encoder(feats, mask)
    ids = np.zeros((1, 13), np.int64)
    ids[0, 1 : 1 + audio.num_tokens] = cfg.audio_token_id
    text = jnp.zeros((1, 13, cfg.text_hidden_size), jnp.float32)
    tok = cfg.audio_token_id
    merge_audio_embeddings(text, audio, ids, audio_token_id=tok)  # warm
    refuse = lambda exc, m, *a, **k: _refused(monkeypatch, exc, m, merge_audio_embeddings, *a, **k)  # noqa: E731
    refuse(TypeError, "integers", text, audio, ids.astype(np.float32), audio_token_id=tok)
    refuse(TypeError, "audio_token_id", text, audio, ids, audio_token_id=float(tok))
    refuse(TypeError, "audio_token_id", text, audio, ids, audio_token_id=True)
    refuse(ValueError, "shape", text, audio, ids[:, :-1], audio_token_id=tok)
    refuse(ValueError, "placeholder", text, audio, np.roll(ids, 1) * 0, audio_token_id=tok)
    refuse(ValueError, "do not fit", text[..., :-1], audio, ids, audio_token_id=tok)


@pytest.mark.parametrize(
    "field, value, exc",
    [
        ("conf_num_hidden_layers", True, TypeError),
        ("conf_num_hidden_layers", 2.0, TypeError),
        ("soft_tokens", np.float32(5), TypeError),
        ("sscp_conv_kernel_size", ((3, 3.0), (3, 3)), TypeError),
        ("rms_norm_eps", "1e-6", TypeError),
        ("conf_num_attention_heads", 4, ValueError),
        ("overflow", "drop", ValueError),
        ("text_vocab_size", 10_000, ValueError),
    ],
)
def test_config_fields(cfg, field, value, exc):
    with pytest.raises(exc, match=field.split("_")[0]):
        dataclasses.replace(cfg, **{field: value})


def test_config_sources(cfg, tmp_path):
    t = R.TINY_HF
    full = {"audio_config": t["audio"], "text_config": t["text"], **t["top"]}
    assert from_hf_config(full) == cfg
    with pytest.raises(ValueError, match="audio_config"):
        from_hf_config(t["audio"])
    with pytest.raises(ValueError, match="conf_new"):
        from_hf_config({**full, "audio_config": {**t["audio"], "conf_new": 1}})
    with pytest.raises(TypeError, match="conf_num_hidden_layers"):
        from_hf_config({**full, "audio_config": {**t["audio"], "conf_num_hidden_layers": 2.0}})
    with pytest.raises(TypeError, match="HF config"):
        from_hf_config(42)
    with pytest.raises(FileNotFoundError):
        from_hf_config(tmp_path)  # a directory without config.json
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(json.JSONDecodeError):
        from_hf_config(tmp_path)


def test_wrong_and_corrupt_weights(cfg, tmp_path):
    pytest.importorskip("torch")
    ref = R.build_reference(tmp_path)
    bigger = dataclasses.replace(ref.cfg, hidden_size=24)
    with pytest.raises(WeightError):
        load_model(ref.checkpoint, bigger)  # shapes do not match the config
    deeper = dataclasses.replace(ref.cfg, conf_num_hidden_layers=3)
    with pytest.raises(WeightError):
        load_model(ref.checkpoint, deeper)  # a parameter left unassigned
    with pytest.raises(TypeError, match="Gemma3nAudioConfig"):
        load_model(ref.checkpoint, {"hidden_size": 22})
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(pathlib.Path(ref.checkpoint).read_bytes()[:200])
    with pytest.raises(WeightError):
        load_model(truncated, ref.cfg)
    with pytest.raises(FileNotFoundError):
        load_model(truncated)  # no config.json next to it


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=5),
    frames=st.integers(1, 40),
    dtype=st.sampled_from(["bool", "int8", "int64", "float32", "float16"]),
)
def test_plan_on_any_mask(cfg, lengths, frames, dtype):
    """Prefix masks of any dtype: planned exactly (rows, frame count), or a typed refusal."""
    mask = (np.arange(frames)[None, :] < np.asarray(lengths)[:, None]).astype(dtype)
    feats = np.zeros((len(lengths), frames, cfg.input_feat_size), np.float32)
    if dtype.startswith("float"):
        with pytest.raises(TypeError):
            host_features(feats, mask, cfg.input_feat_size)
        with pytest.raises(TypeError):
            plan(mask, cfg)
        return
    _, valid = host_features(feats, mask, cfg.input_feat_size)
    if min(lengths) == 0:
        with pytest.raises(ValueError, match="no valid frame"):
            plan(valid, cfg)
        return
    big = dataclasses.replace(cfg, soft_tokens=64)
    p = plan(valid, big, buckets=Gemma3nBuckets(frames=8))
    assert p.frames == frames and p.frame_bucket % 8 == 0
    assert p.lengths == (64,) * len(lengths) and p.offsets[-1] == 64 * (len(lengths) - 1)
    assert np.array_equal(p.meta.valid[: len(lengths), :frames], valid)
    assert not p.meta.valid[len(lengths) :].any()
    assert p.meta.frames.tolist() == [frames]
    assert p.meta.positions.tolist() == [big.num_tower_positions(frames)]


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        ({"frame_buckets": True}, TypeError),
        ({"frame_buckets": 64.0}, TypeError),
        ({"frame_buckets": [32, 64.5]}, TypeError),
        ({"frame_buckets": 0}, ValueError),
        ({"batch_buckets": [2, 4.0]}, TypeError),
        ({"placement": jax.devices()[-1]}, ValueError),
    ],
)
def test_entry_settings(cfg, kwargs, exc):
    model = Gemma3nAudioModel(cfg, rngs=nnx.Rngs(0))
    with pytest.raises(exc, match="frame_buckets|batch_buckets|placement"):
        Gemma3nAudioEncoder(model, **kwargs)
