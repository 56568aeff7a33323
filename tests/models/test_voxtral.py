"""VoxtralAudioEncoder entry: sync-free, buckets, no recompile, drop-in pure forward, processor
inputs, sharding, argument count, per-item finite flags."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsync
import jaxsync.check
from jaxsync.models.voxtral import (
    MelConfig,
    VoxtralAudioConfig,
    VoxtralAudioEncoder,
    VoxtralAudioTower,
)


# Tiny but odd sizes: head_dim 7, 2 layers, 20 positions (a window = 40 frames = 6400 samples).
TINY = dict(
    num_mel_bins=128, hidden_size=28, intermediate_size=112, num_hidden_layers=2,
    num_attention_heads=4, max_source_positions=20, text_hidden_size=36,
)  # fmt: skip


def _tower(seed: int = 0, **kw) -> VoxtralAudioTower:
    return VoxtralAudioTower(VoxtralAudioConfig(**{**TINY, **kw}), rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def encoder() -> VoxtralAudioEncoder:
    return VoxtralAudioEncoder(_tower(), MelConfig())


def _audio(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(n) + 0.2 * np.sin(np.arange(n) * 0.3)).astype(np.float32)


def _batch(audios, width=None):
    x = np.zeros((len(audios), width or max(map(len, audios))), np.float32)
    for i, a in enumerate(audios):
        x[i, : len(a)] = a
    return x


def _mel(c: int, cfg: VoxtralAudioConfig, seed: int) -> np.ndarray:
    # (log10 + 4) / 4 features live roughly in [-1, 2].
    return np.random.default_rng(seed).uniform(-1.0, 2.0, (c, 128, cfg.chunk_frames))


def test_sync_free_and_no_recompile(encoder):
    rng = np.random.default_rng(3)

    def case(lens):  # all: batch bucket 4, width bucket 128 hops, 8 windows (<= 8)
        return _batch([_audio(n, int(rng.integers(99))) for n in lens], 20000), list(lens)

    first = case([7001, 3000, 12800, 301])
    more = [case([19000, 5000, 6400]), case([12801, 12000, 400, 6399])]
    jaxsync.check.assert_sync_free(encoder, *first, inputs=more)
    mel = jnp.asarray(_mel(2, encoder.config, 0), jnp.float32)

    def features(m):
        return encoder(input_features=m)

    jaxsync.check.assert_sync_free(features, mel, inputs=[(mel * 0.5,)])


def _rows(out, i):
    return np.asarray(out.embeddings)[out.offsets[i] : out.offsets[i] + out.lengths[i]]


def test_poisoned_audio_leaves_the_others_bit_identical(encoder):
    """Device waveforms are not read back: a NaN in one audio flips its finite flag only, and
    every other audio's rows are bit-identical to the clean run (no leak through the per-audio
    max, the windows or padding)."""
    lens = [7001, 12800, 301, 9000]
    host = _batch([_audio(n, i) for i, n in enumerate(lens)], 12800)
    clean = encoder(jax.device_put(host), lens)
    for bad, where in ((1, 100), (3, 8999)):
        poisoned = host.copy()
        poisoned[bad, where] = np.nan
        out = encoder(jax.device_put(poisoned), lens)
        flags = np.asarray(out.extras["finite"])[: len(lens)]
        assert flags.tolist() == [i != bad for i in range(len(lens))]
        assert np.isnan(_rows(out, bad)).any()
        for i in range(len(lens)):
            if i != bad:
                np.testing.assert_array_equal(_rows(out, i), _rows(clean, i))
    assert np.asarray(clean.extras["finite"])[: len(lens)].all()


def test_poisoned_features_leave_the_others_bit_identical(encoder):
    cfg = encoder.config
    feats = _mel(4, cfg, 1).astype(np.float32)
    clean = encoder(input_features=jax.device_put(feats), num_chunks=[1, 2, 1])
    poisoned = feats.copy()  # a CPU device_put may alias the host buffer
    poisoned[2, 5, 7] = np.inf  # the second window of item 1
    out = encoder(input_features=jax.device_put(poisoned), num_chunks=[1, 2, 1])
    assert np.asarray(out.extras["finite"])[:3].tolist() == [True, False, True]
    for i in (0, 2):
        np.testing.assert_array_equal(_rows(out, i), _rows(clean, i))
    assert np.asarray(clean.extras["finite"])[:3].all()
