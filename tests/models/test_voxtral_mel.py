"""Voxtral / Whisper log-mel front end against transformers, vLLM and a float64 oracle. The entry
point's behaviour (invariance, bad input, buckets, sync-freedom, serving) lives in
test_voxtral_mel_entry.py."""

from __future__ import annotations

import functools as ft

import jax
import numpy as np
import pytest

import jaxsync
import jaxsync.check
import jaxsync.models.voxtral
from jaxsync.harness.paths.voxtral import reference as ref
from jaxsync.models.voxtral import (
    MelConfig,
    MelSpec,
    log_mel_rows,
    log_mel_spectrogram,
    slaney_mel_filters,
)
from jaxsync.testing import requires_torch


pytestmark = requires_torch

SR = 16000
ATOL = 2e-5  # the bound, absolute, on (log10 + 4) / 4 features
# Where the spectral stage runs in float64 (CPU, GPU) what is left is the float32 log10 of values
# below 16 in magnitude: 1-2 ulp (<= 9.5e-7 each) / 4 <= ~4.8e-7, plus ~1e-8 from rounding the
# power to float32. Measured on CPU: 1.4e-7 (80 and 128 bins). The float32 FFT path is at 6e-6
# (80 bins) and 1.05e-5 (128 bins) on CPU, so this bound also tells the two paths apart.
ATOL_FLOAT64 = 1e-6
# Shorter than, equal to and longer than 30 s; none but 480000 a multiple of the hop.
LENGTHS = (3 * SR + 77, 30 * SR, 31 * SR + 4417)


@pytest.fixture(scope="module")
def audios() -> list[np.ndarray]:
    return [ref.tone_audio(n, i) for i, n in enumerate(LENGTHS)]


def _lens(audios):
    return [len(a) for a in audios]


def _padded(audios, width: int) -> np.ndarray:
    """Zero-pad / truncate every audio to `width` samples (what the HF batch path feeds STFT)."""
    return ref.padded_batch([a[:width] for a in audios], width)


def _check(got, hf, oracle, what: str) -> None:
    """`got` within ATOL of the float64 oracle, and within ATOL of the fp32 transformers reference
    up to that reference's own fp32 rounding (|hf - oracle|, which alone reaches ~2e-5 with 128
    bins: narrow low-frequency filters over a spectral null have ~7 decades of dynamic range)."""
    got, hf, oracle = (np.asarray(v, np.float64) for v in (got, hf, oracle))
    own = np.abs(got - oracle).max()
    assert own <= ATOL, f"{what}: |ours - float64| = {own:.2e} > {ATOL:.0e}"
    hf_own = np.abs(hf - oracle).max()
    diff = np.abs(got - hf).max()
    assert diff <= ATOL + hf_own, (
        f"{what}: |ours - transformers| = {diff:.2e} > {ATOL:.0e} + |transformers - float64| "
        f"= {hf_own:.2e}"
    )


@pytest.mark.parametrize("bins", [80, 128])
def test_filters_match_transformers(bins):
    from transformers.audio_utils import mel_filter_bank

    cfg = MelConfig(num_mel_bins=bins)
    want = mel_filter_bank(201, bins, 0.0, 8000.0, SR, norm="slaney", mel_scale="slaney")
    got = slaney_mel_filters(cfg)
    assert got.shape == (201, bins)  # (num_freq, num_mel): the mistral-common docstring is wrong
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("bins", [80, 128])
def test_whisper_call_per_example(audios, bins):
    """`WhisperFeatureExtractor.__call__`: pad / truncate to 30 s, max per example (torch path)."""
    fe = ref.whisper_fe(bins)
    want = ref.whisper_call(fe, audios)  # [3, F, 3000]
    out = log_mel_spectrogram(
        ref.padded_batch(audios), _lens(audios), config=MelConfig.from_feature_extractor(fe),
        floor="per_example",
    )  # fmt: skip
    assert out.num_frames.tolist() == [3000] * 3
    oracle = ref.float64_melspec(_padded(audios, 30 * SR), fe.mel_filters)
    _check(np.asarray(out.features)[:3], want, oracle, f"Whisper __call__ {bins} bins")


@pytest.mark.parametrize("bins", [80, 128])
def test_whisper_numpy_per_audio(audios, bins):
    """transformers' NumPy path on each waveform as given = vLLM `compute_whisper_melspec`."""
    fe = ref.whisper_fe(bins)
    out = log_mel_spectrogram(
        ref.padded_batch(audios), _lens(audios), config=MelConfig.from_feature_extractor(fe)
    )
    feats = np.asarray(out.features)
    for i, a in enumerate(audios):
        want = ref.whisper_numpy(fe, a)
        assert out.num_frames[i] == len(a) // 160 == want.shape[-1]
        np.testing.assert_allclose(feats[i, :, : out.num_frames[i]], want, rtol=0, atol=ATOL)
        assert not feats[i, :, out.num_frames[i] :].any()  # padding frames are 0


def test_whisper_torch_batch_padded_rows(audios):
    """transformers' torch path on a zero-padded 2-D batch: max per row *including* its padding
    frames = floor='per_example' with max_length = the row width."""
    fe = ref.whisper_fe(128)
    short = [audios[0], audios[0][: 2 * SR + 3]]
    width = len(audios[0]) + 1234
    want = ref.whisper_torch(fe, ref.padded_batch(short, width))  # [2, F, width // 160]
    out = log_mel_spectrogram(
        ref.padded_batch(short), _lens(short), config=MelConfig.from_feature_extractor(fe),
        floor="per_example", max_length=width,
    )  # fmt: skip
    oracle = ref.float64_melspec(ref.padded_batch(short, width), fe.mel_filters)
    _check(np.asarray(out.features)[:2], want, oracle, "Whisper torch 2-D batch")


@pytest.mark.parametrize("bins", [80, 128])
@pytest.mark.parametrize("g", [1.5, None])
def test_voxtral_realtime(audios, bins, g):
    """VoxtralRealtimeFeatureExtractor (= vLLM pre-PR): fixed floor g - 8, or the audio's max."""
    fe = ref.realtime_fe(bins, g)
    cfg = MelConfig.from_feature_extractor(fe)
    assert cfg.global_log_mel_max == g
    out = log_mel_spectrogram(ref.padded_batch(audios[:2]), _lens(audios[:2]), config=cfg)
    feats = np.asarray(out.features)
    for i, a in enumerate(audios[:2]):
        want = ref.realtime_torch(fe, a)
        oracle = ref.float64_melspec(a, fe.mel_filters, g)[0]
        _check(feats[i, :, : out.num_frames[i]], want, oracle, f"realtime {bins} bins g={g}")
    if g is not None:  # the fixed floor really bites: the quiet tail sits on it
        assert feats[0].min() == pytest.approx((g - 8.0 + 4.0) / 4.0)


def test_voxtral_processor_padding(audios):
    """VoxtralProcessor: pad each audio to a 30 s multiple, max over the whole padded audio."""
    fe = ref.whisper_fe(128)
    pick = [audios[0], audios[2]]
    out = log_mel_spectrogram(
        ref.padded_batch(pick), _lens(pick), config=MelConfig.from_feature_extractor(fe),
        pad_to_multiple_of=30 * SR,
    )  # fmt: skip
    assert out.num_frames.tolist() == [3000, 6000]
    feats = np.asarray(out.features)
    for i, a in enumerate(pick):
        want = ref.processor_features(fe, a, 3000)  # [n_chunks, F, 3000]
        padded = _padded([a], out.num_frames[i] * 160)
        oracle = ref.float64_melspec(padded, fe.mel_filters)[0]
        oracle = oracle.reshape(128, -1, 3000).transpose(1, 0, 2)
        got = feats[i, :, : out.num_frames[i]].reshape(128, -1, 3000).transpose(1, 0, 2)
        _check(got, want, oracle, "Voxtral processor")


@pytest.mark.parametrize("bins", [80, 128])
def test_float64_spectrum_precision(audios, bins):
    """Where the backend has native float64 the features sit at float32 log10 rounding of the
    float64 oracle, far inside the issue's bound, in the per-audio and the 30 s batch variant."""
    if jax.default_backend() not in ("cpu", "gpu"):
        pytest.skip(f"{jax.default_backend()} keeps the float32 spectral path")
    fe = ref.whisper_fe(bins)
    cfg = MelConfig.from_feature_extractor(fe)
    out = log_mel_spectrogram(ref.padded_batch(audios), _lens(audios), config=cfg)
    feats = np.asarray(out.features, np.float64)
    assert out.features.dtype == np.float32
    for i, a in enumerate(audios):
        oracle = ref.float64_melspec(a, fe.mel_filters)[0]
        err = np.abs(feats[i, :, : out.num_frames[i]] - oracle).max()
        assert err <= ATOL_FLOAT64, f"audio {i}: |ours - float64| = {err:.2e}"
    batch = log_mel_spectrogram(
        ref.padded_batch(audios), _lens(audios), config=cfg, floor="per_example"
    )
    oracle = ref.float64_melspec(_padded(audios, 30 * SR), fe.mel_filters)
    err = np.abs(np.asarray(batch.features, np.float64)[:3] - oracle).max()
    assert err <= ATOL_FLOAT64, f"per_example: |ours - float64| = {err:.2e}"


@pytest.mark.parametrize("precision", [None, "float64", "float32"])
def test_float64_scope_stays_inside_the_spectrum(precision):
    """The float64 spectral stage is scoped to the trace: float32 in and out, the caller's x64
    setting and default dtypes untouched, no recompiles; the float32 path has no 64-bit op."""
    cfg = MelConfig(num_mel_bins=80)
    meta = ref.one_row_meta()
    x, x2 = (jax.device_put(ref.padded_batch([ref.tone_audio(4000, seed)])) for seed in (1, 2))
    fn = jax.jit(ft.partial(log_mel_rows, spec=MelSpec(cfg, 25, None, precision)))

    def state():
        return jax.config.jax_enable_x64, jax.numpy.zeros(1).dtype, jax.numpy.arange(2).dtype

    before = state()
    hlo = fn.lower(x, meta).as_text()
    float64 = precision != "float32"  # None: this CPU host lowers the float64 branch
    assert ("complex<f64>" in hlo) == float64 and ("f64" in hlo) == float64
    feats, _ = fn(x, meta)
    assert feats.dtype == np.float32 and state() == before
    with jaxsync.check.no_recompile():
        fn(x2, meta)


@pytest.mark.parametrize("n_fft", [400, 401, 399])
@pytest.mark.parametrize("n", [160 * 37, 160 * 37 + 1, 160 * 37 + 5])
def test_frame_count_matches_torch_stft_for_odd_and_even_n_fft(n_fft, n):
    """torch.stft(center=True) gives `1 + (n - n_fft % 2) // hop` frames, less the dropped last
    one: for an odd n_fft at a hop multiple that is one frame fewer than `n // hop`. The count, the
    features, and the per-example max (which an extra frame would move) match transformers."""
    import torch
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=80, n_fft=n_fft)
    cfg = MelConfig.from_feature_extractor(fe)
    a = ref.tone_audio(n, n_fft)
    window = torch.hann_window(n_fft)
    stft = torch.stft(torch.from_numpy(a), n_fft, 160, window=window, return_complex=True)
    out = log_mel_spectrogram(a[None], [n], config=cfg)
    want = ref.whisper_numpy(fe, a)
    assert out.num_frames[0] == stft.shape[-1] - 1 == want.shape[-1]
    feats = np.asarray(out.features)
    np.testing.assert_allclose(feats[0, :, : out.num_frames[0]], want, rtol=0, atol=ATOL)
    assert not feats[0, :, out.num_frames[0] :].any()
    width = 6400  # per-example: padded to 40 hops, max over every frame of the padded example
    batch = log_mel_spectrogram(a[None], [n], config=cfg, floor="per_example", max_length=width)
    want = fe._np_extract_fbank_features(ref.padded_batch([a], width), "cpu")
    assert batch.num_frames.tolist() == [want.shape[-1]] == [(width - n_fft % 2) // 160]
    np.testing.assert_allclose(np.asarray(batch.features)[:1], want, rtol=0, atol=ATOL)


# Measured on CPU, float32 spectrum vs the float64 one, (log10 + 4) / 4 features, the three
# audios (3 s, 30 s, 31 s, quiet tails): 6e-6 at 80 bins, 1.1e-5 at 128 bins (narrow low filters
# over spectral nulls). The float32 path (TPU) is held to the bound, 2e-5.
ATOL_FLOAT32 = 2e-5


@pytest.mark.parametrize("bins", [80, 128])
def test_float32_spectrum_tolerance(audios, bins):
    cfg = MelConfig(num_mel_bins=bins)
    plan = jaxsync.models.voxtral.plan_log_mel(
        np.array(_lens(audios)), max(_lens(audios)), 3, cfg, floor="per_audio"
    )
    x = jax.device_put(ref.padded_batch(audios))
    meta = jaxsync.upload_packed(plan)
    out = {
        p: np.asarray(log_mel_rows(x, meta, spec=MelSpec(cfg, plan.frames, None, p))[0])
        for p in ("float32", "float64")
    }
    err = np.abs(out["float32"] - out["float64"]).max()
    assert 0 < err <= ATOL_FLOAT32, f"|float32 - float64| = {err:.2e}"
