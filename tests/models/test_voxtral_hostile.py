"""Hostile inputs to every public Voxtral entry point: a typed error naming the problem, raised
on the host before any upload or compile, inputs untouched; or a correct result."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxsync.models.voxtral import (
    MelConfig,
    VoxtralAudioConfig,
    VoxtralAudioEncoder,
    VoxtralAudioTower,
)


TINY = dict(
    num_mel_bins=128, hidden_size=28, intermediate_size=112, num_hidden_layers=2,
    num_attention_heads=4, max_source_positions=20, text_hidden_size=36,
)  # fmt: skip


@pytest.fixture(scope="module")
def encoder() -> VoxtralAudioEncoder:
    return VoxtralAudioEncoder(
        VoxtralAudioTower(VoxtralAudioConfig(**TINY), rngs=nnx.Rngs(0)), MelConfig()
    )


def _audio(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(n)).astype(np.float32)


def _batch(audios):
    x = np.zeros((len(audios), max(map(len, audios))), np.float32)
    for i, a in enumerate(audios):
        x[i, : len(a)] = a
    return x


def test_encoder_bad_audio(encoder):
    x = _batch([_audio(5000, 0), _audio(3000, 1)])
    x[1, 10] = np.inf
    with pytest.raises(ValueError, match=r"waveforms \[1\] contain NaN or inf"):
        encoder(x, [5000, 3000])
    flags = encoder(jax.device_put(x), [5000, 3000]).extras["finite"]
    assert np.asarray(flags)[:2].tolist() == [True, False]
    with pytest.raises(ValueError, match="empty audio"):
        encoder(x, [5000, 0])
    with pytest.raises(ValueError, match="sampled at 24000 Hz"):
        encoder(x, [5000, 3000], sampling_rate=24000)
    with pytest.raises(ValueError, match="80 mel bins, the encoder expects 128"):
        VoxtralAudioEncoder(
            VoxtralAudioTower(VoxtralAudioConfig(**TINY), rngs=nnx.Rngs(0)),
            MelConfig(num_mel_bins=80),
        )


@pytest.fixture
def uploads(monkeypatch):
    """Counts host->device transfers (every upload goes through `jaxsync._transfer._put`)."""
    import jaxsync._transfer as transfer

    count = [0]
    real = transfer._put

    def put(host, placement):
        count[0] += 1
        return real(host, placement)

    monkeypatch.setattr(transfer, "_put", put)
    return count


def test_too_many_windows_fail_before_any_upload(uploads):
    tower = VoxtralAudioTower(VoxtralAudioConfig(**TINY), rngs=nnx.Rngs(0))
    enc = VoxtralAudioEncoder(tower, MelConfig(), chunk_buckets=[2, 4])
    x = _batch([_audio(6400 * 3 + 1, 0), _audio(6400, 1)])  # 4 + 1 windows > 4
    before = x.copy()
    with pytest.raises(ValueError, match="5 windows of 6400 samples exceed the largest chunk"):
        enc(x, [6400 * 3 + 1, 6400])
    feats = np.zeros((5, 128, 40), np.float32)
    with pytest.raises(ValueError, match="5 windows exceed the largest chunk bucket 4"):
        enc(input_features=feats)
    assert uploads[0] == 0
    np.testing.assert_array_equal(x, before)
    assert enc(x[:, :6400], [6400, 6400]).lengths == (5, 5)  # within the buckets: fine
    assert uploads[0] == 2  # the plan's metadata and the waveforms
