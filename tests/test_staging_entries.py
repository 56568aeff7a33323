"""Every entry that pads host data gives bit-identical results through pinned staging buffers
and through the pageable path (the ring forced on for tiny inputs, then off)."""

import time

import jax
import numpy as np
import pytest
from flax import nnx

import jaxsync
from jaxsync.harness.paths.chameleon import reference as chameleon_ref
from jaxsync.harness.paths.gemma3n import reference as gemma3n_ref
from jaxsync.harness.paths.glm4v import reference as glm4v_ref
from jaxsync.harness.paths.qwen3_omni import reference as q3_ref
from jaxsync.harness.paths.voxtral import reference as voxtral_ref
from jaxsync.models import glm4v, qwen3_omni as q3
from jaxsync.models.chameleon import ChameleonConfig, ChameleonImageEncoder, ChameleonImageTower
from jaxsync.models.gemma3n import Gemma3nAudioEncoder, Gemma3nAudioModel
from jaxsync.models.voxtral import (
    MelConfig,
    VoxtralAudioConfig,
    VoxtralAudioEncoder,
    VoxtralAudioTower,
)


VOXTRAL = VoxtralAudioConfig(**voxtral_ref.TINY_ENCODER)


def _voxtral_audio():
    enc = VoxtralAudioEncoder(VoxtralAudioTower(VOXTRAL, rngs=nnx.Rngs(0)), MelConfig())
    rng = np.random.default_rng(0)
    audio = [rng.standard_normal(n).astype(np.float32) for n in (7001, 301, 12800)]
    return lambda: enc(audio)


def _voxtral_features():
    enc = VoxtralAudioEncoder(VoxtralAudioTower(VOXTRAL, rngs=nnx.Rngs(0)), MelConfig())
    mel = np.random.default_rng(1).uniform(-1, 2, (3, 128, VOXTRAL.chunk_frames))
    return lambda: enc(input_features=mel.astype(np.float32))


def _glm4v():
    cfg = glm4v.Glm4vVisionConfig(**glm4v_ref.TINY)
    enc = glm4v.Glm4vVisionEncoder(glm4v.Glm4vVisionTower(cfg, rngs=nnx.Rngs(0)))
    grid = [[1, 4, 6], [1, 2, 2]]
    return lambda: enc(glm4v_ref.pixels(grid, cfg, seed=2), grid)


def _gemma3n():
    cfg = gemma3n_ref.tiny_config()
    enc = Gemma3nAudioEncoder(Gemma3nAudioModel(cfg, rngs=nnx.Rngs(0)), frame_buckets=64)
    feats, mask = gemma3n_ref.mel_batch([41, 7, 29], 41, cfg.input_feat_size, seed=5)
    return lambda: enc(feats, mask)


def _qwen3_omni():
    enc = q3.Qwen3OmniAudioEncoder(q3.Qwen3OmniAudioTower(q3_ref.TINY, rngs=nnx.Rngs(0)))
    lens = [37, 5]
    return lambda: enc(q3_ref.random_features(q3_ref.TINY, lens, seed=3), lens)


def _chameleon():
    cfg = ChameleonConfig.from_hf_config(chameleon_ref.tiny_hf_config())
    enc = ChameleonImageEncoder(ChameleonImageTower(cfg, rngs=nnx.Rngs(0)), buckets=(4,))
    return lambda: enc(chameleon_ref.random_pixels(3, cfg.vq, seed=4))


ENTRIES = {
    "voxtral audio": _voxtral_audio,
    "voxtral features": _voxtral_features,
    "glm4v": _glm4v,
    "gemma3n": _gemma3n,
    "qwen3_omni": _qwen3_omni,
    "chameleon": _chameleon,
}


def _host(out) -> list[np.ndarray]:
    arrays = [out] if isinstance(out, jax.Array) else jax.tree.leaves(out)
    return [np.asarray(a) for a in arrays if isinstance(a, jax.Array)]


@pytest.mark.parametrize("name", list(ENTRIES))
def test_pinned_and_pageable_give_identical_results(name, monkeypatch):
    call = ENTRIES[name]()
    ring = jaxsync.default_staging
    monkeypatch.setattr(ring, "min_bytes", 1 << 62)  # pageable only
    want = _host(call())
    monkeypatch.setattr(ring, "min_bytes", 0)  # every upload staged
    before = ring.stats["pinned"]
    for _ in range(50):  # the first call of a shape allocates; its buffer serves once set up
        got = _host(call())
        if ring.stats["pinned"] > before:
            break
        time.sleep(0.01)  # the buffer is allocated on the ring's own thread
    assert ring.stats["pinned"] > before, "the pinned path never ran"
    assert want and len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))
