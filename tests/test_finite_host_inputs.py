"""Every entry that uploads host data refuses NaN and inf in it before any upload, reading the
data once: a call on a known plan checks while it copies into the staging buffer, a call that
builds a new plan checks first (the new plan's metadata is an upload)."""

import jax
import numpy as np
import pytest
from flax import nnx

import jaxsync
import jaxsync.testing
from jaxsync import _host
from jaxsync.harness.paths.chameleon import reference as chameleon_ref
from jaxsync.harness.paths.gemma3n import reference as gemma3n_ref
from jaxsync.harness.paths.glm4v import reference as glm4v_ref
from jaxsync.harness.paths.qwen3_omni import reference as q3_ref
from jaxsync.harness.paths.voxtral import reference as voxtral_ref
from jaxsync.models import glm4v, qwen3_omni as q3
from jaxsync.models.chameleon import ChameleonConfig, ChameleonImageEncoder, ChameleonImageTower
from jaxsync.models.gemma3n import Gemma3nAudioEncoder, Gemma3nAudioModel
from jaxsync.models.voxtral import VoxtralAudioConfig, VoxtralAudioEncoder, VoxtralAudioTower


def _voxtral_features():
    cfg = VoxtralAudioConfig(**voxtral_ref.TINY_ENCODER)
    enc = VoxtralAudioEncoder(VoxtralAudioTower(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(1)
    mel = rng.uniform(-1, 2, (3, 128, cfg.chunk_frames)).astype(np.float32)
    other = rng.uniform(-1, 2, (5, 128, cfg.chunk_frames)).astype(np.float32)  # another plan
    return lambda x: enc(input_features=x), mel, other, (2, 127, 3), "input_features"


def _glm4v():
    cfg = glm4v.Glm4vVisionConfig(**glm4v_ref.TINY)
    enc = glm4v.Glm4vVisionEncoder(glm4v.Glm4vVisionTower(cfg, rngs=nnx.Rngs(0)))
    grid, other = [[1, 4, 6], [1, 2, 2]], [[1, 2, 6]]
    pixels = glm4v_ref.pixels(grid, cfg, seed=2)

    def call(x):
        return enc(x, grid if len(x) == len(pixels) else other)

    return call, pixels, glm4v_ref.pixels(other, cfg, seed=3), (27, 5), "pixel_values"


def _gemma3n():
    cfg = gemma3n_ref.tiny_config()
    enc = Gemma3nAudioEncoder(Gemma3nAudioModel(cfg, rngs=nnx.Rngs(0)), frame_buckets=64)
    feats, mask = gemma3n_ref.mel_batch([41, 7, 29], 41, cfg.input_feat_size, seed=5)
    other, other_mask = gemma3n_ref.mel_batch([13, 30], 30, cfg.input_feat_size, seed=6)

    def call(x):
        return enc(x, mask if x.shape == feats.shape else other_mask)

    return call, feats, other, (2, 28, 1), "input_features"


def _qwen3_omni():
    enc = q3.Qwen3OmniAudioEncoder(q3.Qwen3OmniAudioTower(q3_ref.TINY, rngs=nnx.Rngs(0)))
    lens, other_lens = [37, 5], [11, 19, 3]
    feats = q3_ref.random_features(q3_ref.TINY, lens, seed=3)
    other = q3_ref.random_features(q3_ref.TINY, other_lens, seed=4)

    def call(x):
        return enc(x, lens if x.shape == feats.shape else other_lens)

    return call, feats, other, (3, 41), "features"


def _chameleon():
    cfg = ChameleonConfig.from_hf_config(chameleon_ref.tiny_hf_config())
    enc = ChameleonImageEncoder(ChameleonImageTower(cfg, rngs=nnx.Rngs(0)), buckets=(4, 8))
    pixels = chameleon_ref.random_pixels(3, cfg.vq, seed=4)
    other = chameleon_ref.random_pixels(6, cfg.vq, seed=5)  # the other bucket
    return enc, pixels, other, (1, 0, 2, 2), "pixel_values"


ENTRIES = {
    "voxtral features": _voxtral_features,
    "glm4v": _glm4v,
    "gemma3n": _gemma3n,
    "qwen3_omni": _qwen3_omni,
    "chameleon": _chameleon,
}


@pytest.fixture(params=list(ENTRIES))
def entry(request):
    return ENTRIES[request.param]()


def _checks(monkeypatch) -> list:
    """Counts the separate finiteness passes (`jaxsync._host.check_finite`'s)."""
    passes, real = [], _host.all_finite
    monkeypatch.setattr(_host, "all_finite", lambda a: passes.append(a.shape) or real(a))
    return passes


def _poisoned(x: np.ndarray, at: tuple, value: float) -> np.ndarray:
    bad = np.array(x, copy=True)
    bad[at] = value
    return bad


@pytest.mark.parametrize("value", [np.nan, -np.inf])
def test_known_plan_checks_while_copying(entry, monkeypatch, value):
    call, data, _, at, name = entry
    want = jax.tree.leaves(call(data))  # the plan is built and kept
    passes, uploads = _checks(monkeypatch), jaxsync.testing.watch_uploads(monkeypatch)
    got = jax.tree.leaves(call(data))
    assert passes == [] and len(uploads) == 1  # one pass, inside the copy; one upload
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    del uploads[:]
    bad = _poisoned(data, at, value)
    before = bad.tobytes()
    with pytest.raises(ValueError, match=f"{name} holds a non-finite value"):
        call(bad)
    assert uploads == [] and passes == []  # refused by the copy's check, before any upload
    assert bad.tobytes() == before
    # the staging buffer went back: the next clean call runs and gives the same result
    for g, w in zip(jax.tree.leaves(call(data)), want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_new_plan_checks_before_its_upload(entry, monkeypatch):
    call, data, other, at, name = entry
    call(data)
    passes, uploads = _checks(monkeypatch), jaxsync.testing.watch_uploads(monkeypatch)
    bad = _poisoned(other, (0,) * other.ndim, np.nan)
    with pytest.raises(ValueError, match=f"{name} holds a non-finite value"):
        call(bad)  # a new plan: its metadata would go up first
    assert uploads == [] and len(passes) == 1
    call(other)  # control: the clean input plans, checks and uploads
    assert len(passes) == 2 and len(uploads) >= 2


def test_gemma3n_clip_list_goes_straight_into_its_bucket(monkeypatch):
    """vLLM's form, a list of `[S_i, F]` clips: copied once, into the staging buffer, with the
    check in the same pass; the same rows as the zero-padded batch with its mask."""
    cfg = gemma3n_ref.tiny_config()
    enc = Gemma3nAudioEncoder(Gemma3nAudioModel(cfg, rngs=nnx.Rngs(0)), frame_buckets=64)
    lengths = [41, 7, 29]
    rng = np.random.default_rng(8)
    clips = [rng.standard_normal((n, cfg.input_feat_size)).astype(np.float32) for n in lengths]
    padded = np.zeros((3, 41, cfg.input_feat_size), np.float32)
    for i, c in enumerate(clips):
        padded[i, : len(c)] = c
    mask = np.arange(41)[None, :] < np.array(lengths)[:, None]
    want = enc(padded, mask)  # the same real-frame mask: the same plan
    passes, uploads = _checks(monkeypatch), jaxsync.testing.watch_uploads(monkeypatch)
    got = enc(clips)
    assert passes == [] and len(uploads) == 1
    np.testing.assert_array_equal(np.asarray(got.embeddings), np.asarray(want.embeddings))
    bad = [c.copy() for c in clips]
    bad[2][28, 3] = np.nan  # the last frame of the last clip
    with pytest.raises(ValueError, match=r"input_features\[2\] holds a non-finite value"):
        enc(bad)
    assert len(uploads) == 1 and passes == []  # refused in the copy, before any upload
    with pytest.raises(ValueError, match=r"input_features\[1\] holds a non-finite value"):
        enc(bad[1:])  # a new plan: checked first, clip by clip (the bad clip is now 1)
    assert len(uploads) == 1 and len(passes) == 2
