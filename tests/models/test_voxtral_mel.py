"""Voxtral / Whisper log-mel front end vs transformers, invariance, bad input, sync-freedom."""

from __future__ import annotations

import functools as ft

import jax
import numpy as np
import pytest

import jaxsync
import jaxsync.check
import jaxsync.models.voxtral
from jaxsync.models.voxtral import (
    MelConfig,
    MelSpec,
    log_mel_rows,
    log_mel_spectrogram,
    slaney_mel_filters,
)
from jaxsync.paths.voxtral import reference as ref
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


def _audio(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(n) / SR
    # Noise plus a tone plus a quiet tail, so the dynamic-range floor actually clips something.
    x = 0.05 * rng.standard_normal(n) + 0.3 * np.sin(2 * np.pi * 440.0 * t)
    x[-n // 5 :] *= 1e-5
    return x.astype(np.float32)


@pytest.fixture(scope="module")
def audios() -> list[np.ndarray]:
    return [_audio(n, i) for i, n in enumerate(LENGTHS)]


def _batch(audios: list[np.ndarray], width: int | None = None, fill: float = 0.0) -> np.ndarray:
    width = width or max(len(a) for a in audios)
    x = np.full((len(audios), width), fill, np.float32)
    for i, a in enumerate(audios):
        x[i, : len(a)] = a
    return x


def _lens(audios):
    return [len(a) for a in audios]


def _padded(audios, width: int) -> np.ndarray:
    """Zero-pad / truncate every audio to `width` samples (what the HF batch path feeds STFT)."""
    return _batch([a[:width] for a in audios], width)


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
        _batch(audios), _lens(audios), config=MelConfig.from_feature_extractor(fe),
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
        _batch(audios), _lens(audios), config=MelConfig.from_feature_extractor(fe)
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
    want = ref.whisper_torch(fe, _batch(short, width))  # [2, F, width // 160]
    out = log_mel_spectrogram(
        _batch(short), _lens(short), config=MelConfig.from_feature_extractor(fe),
        floor="per_example", max_length=width,
    )  # fmt: skip
    oracle = ref.float64_melspec(_batch(short, width), fe.mel_filters)
    _check(np.asarray(out.features)[:2], want, oracle, "Whisper torch 2-D batch")


@pytest.mark.parametrize("bins", [80, 128])
@pytest.mark.parametrize("g", [1.5, None])
def test_voxtral_realtime(audios, bins, g):
    """VoxtralRealtimeFeatureExtractor (= vLLM pre-PR): fixed floor g - 8, or the audio's max."""
    fe = ref.realtime_fe(bins, g)
    cfg = MelConfig.from_feature_extractor(fe)
    assert cfg.global_log_mel_max == g
    out = log_mel_spectrogram(_batch(audios[:2]), _lens(audios[:2]), config=cfg)
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
        _batch(pick), _lens(pick), config=MelConfig.from_feature_extractor(fe),
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
    out = log_mel_spectrogram(_batch(audios), _lens(audios), config=cfg)
    feats = np.asarray(out.features, np.float64)
    assert out.features.dtype == np.float32
    for i, a in enumerate(audios):
        oracle = ref.float64_melspec(a, fe.mel_filters)[0]
        err = np.abs(feats[i, :, : out.num_frames[i]] - oracle).max()
        assert err <= ATOL_FLOAT64, f"audio {i}: |ours - float64| = {err:.2e}"
    batch = log_mel_spectrogram(_batch(audios), _lens(audios), config=cfg, floor="per_example")
    oracle = ref.float64_melspec(_padded(audios, 30 * SR), fe.mel_filters)
    err = np.abs(np.asarray(batch.features, np.float64)[:3] - oracle).max()
    assert err <= ATOL_FLOAT64, f"per_example: |ours - float64| = {err:.2e}"


def _one_row_meta(n: int = 4000, frames: int = 25):
    return jaxsync.upload_packed(
        {k: np.array(v, np.int32) for k, v in dict(
            length=[n], signal=[n], row_audio=[0], row_frame0=[0], row_frames=[frames]).items()}
    )  # fmt: skip


@pytest.mark.parametrize("precision", [None, "float64", "float32"])
def test_float64_scope_stays_inside_the_spectrum(precision):
    """The float64 spectral stage is scoped to the trace: float32 in and out, the caller's x64
    setting and default dtypes untouched, no recompiles; the float32 path has no 64-bit op."""
    cfg = MelConfig(num_mel_bins=80)
    meta = _one_row_meta()
    x, x2 = (jax.device_put(_batch([_audio(4000, seed)])) for seed in (1, 2))
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


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(floor="per_example", max_length=9000), dict(pad_to_multiple_of=6400)],
    ids=["per_audio", "per_example", "padded_to_multiple"],
)
def test_padding_and_batch_invariance(kw):
    """Valid frames depend only on the audio and its length: not on the buffer width, garbage
    after the length, the batch it shares, bucket padding, or host-vs-device input."""
    cfg = MelConfig(num_mel_bins=80)
    a, b = _audio(7001, 5), _audio(3333, 6)
    alone = log_mel_spectrogram(a[None], [len(a)], config=cfg, **kw)
    garbage = _batch([b, a], width=20000, fill=np.nan)
    garbage[0, len(b) :] = 1e6  # huge, finite: would dominate the max if it were read
    mixed = log_mel_spectrogram(jax.device_put(garbage), [len(b), len(a)], config=cfg, **kw)
    assert mixed.num_frames[1] == alone.num_frames[0]
    n = alone.num_frames[0]
    got = np.asarray(mixed.features)[1, :, :n]
    np.testing.assert_allclose(got, np.asarray(alone.features)[0, :, :n], rtol=0, atol=1e-6)
    # NaN after a waveform's length is padding, not a bad sample.
    assert np.asarray(mixed.finite).tolist() == [True, True]


def test_device_input_nan_flag():
    """Device waveforms are not read back for validation: the finite flag reports NaN/inf."""
    cfg = MelConfig(num_mel_bins=80)
    x = _batch([_audio(4000, 1), _audio(4000, 2), _audio(4000, 3)])
    x[1, 17] = np.nan
    x[2, 3999] = np.inf
    out = log_mel_spectrogram(jax.device_put(x), [4000, 4000, 4000], config=cfg)
    assert np.asarray(out.finite).tolist() == [True, False, False]
    with pytest.raises(ValueError, match=r"waveforms \[1, 2\] contain NaN or inf"):
        log_mel_spectrogram(x, [4000, 4000, 4000], config=cfg)  # host input: checked on host
    # inf exactly at the length boundary is padding.
    assert log_mel_spectrogram(x[2:], [3999], config=cfg).num_frames.tolist() == [3999 // 160]


def test_bad_input():
    cfg = MelConfig(num_mel_bins=80)
    x = _batch([_audio(4000, 1), _audio(3000, 2)])
    with pytest.raises(ValueError, match="empty audio"):
        log_mel_spectrogram(x, [4000, 0], config=cfg)
    with pytest.raises(ValueError, match="shorter than n_fft // 2 \\+ 1"):
        log_mel_spectrogram(x, [4000, 200], config=cfg)
    # The HF batch path pads to 30 s, so a very short audio is fine there.
    short = log_mel_spectrogram(x, [4000, 200], config=cfg, floor="per_example", max_length=4800)
    assert short.num_frames.tolist() == [30, 30]
    with pytest.raises(ValueError, match="exceed the buffer width"):
        log_mel_spectrogram(x, [4000, 4001], config=cfg)
    with pytest.raises(ValueError, match="sampled at 44100 Hz"):
        log_mel_spectrogram(x, [4000, 3000], config=cfg, sampling_rate=44100)
    with pytest.raises(ValueError, match="mono"):
        log_mel_spectrogram(x[:, :, None], config=cfg)
    with pytest.raises(TypeError, match="floating point"):
        log_mel_spectrogram(x.astype(np.int16), config=cfg)
    with pytest.raises(ValueError, match="floor='global' needs"):
        log_mel_spectrogram(x, [4000, 3000], config=cfg, floor="global")


def test_bad_config():
    with pytest.raises(ValueError, match="Nyquist"):
        MelConfig(sampling_rate=8000)  # 0..8 kHz filters at 8 kHz: top half all zero
    with pytest.raises(ValueError, match="all zero"):
        slaney_mel_filters(MelConfig(num_mel_bins=400))
    with pytest.raises(TypeError, match="must be a Python float, got int"):
        MelConfig(global_log_mel_max=2)
    with pytest.raises(TypeError, match="got str"):
        MelConfig(global_log_mel_max="1.5")
    with pytest.raises(ValueError, match="finite"):
        MelConfig(global_log_mel_max=float("nan"))
    # 0.0 is "unset" (vLLM truthiness): the default floor is then the dynamic max.
    assert MelConfig(global_log_mel_max=0.0).floor_value is None


@pytest.mark.parametrize("g", [1.5, None])
def test_global_floor_is_a_compile_time_constant(g):
    """With a configured max the floor is a Python float folded into the program: the jaxpr has
    no max-reduction at all; without one it reduces on device (never on the host)."""
    cfg = MelConfig(num_mel_bins=80, global_log_mel_max=g)
    x = jax.device_put(_batch([_audio(4000, 1)]))
    spec = MelSpec(cfg, 25, cfg.floor_value)
    jaxpr = str(jax.make_jaxpr(ft.partial(log_mel_rows, spec=spec))(x, _one_row_meta()))
    assert ("reduce_max" in jaxpr) == (g is None)
    out = log_mel_spectrogram(x, [4000], config=cfg)
    if g is not None:
        assert np.asarray(out.features).min() == pytest.approx((g - 8.0 + 4.0) / 4.0)


def test_sync_free_many_lengths_one_bucket():
    cfg = MelConfig(num_mel_bins=80)
    rng = np.random.default_rng(0)

    def case(lens, width):
        return _batch([_audio(n, int(rng.integers(1000))) for n in lens], width), list(lens)

    first = case([5000, 7000, 9001], 9001)
    more = [case([9100, 5400, 6666], 9500), case([8000, 8001, 5200], 9000)]
    jaxsync.check.assert_sync_free(log_mel_spectrogram, *first, inputs=more, config=cfg)
    dev = [(jax.device_put(x), n) for x, n in [first, *more] if x.shape[1] == first[0].shape[1]]
    jaxsync.check.assert_sync_free(
        log_mel_spectrogram, *dev[0], inputs=[(dev[0][0], [4000, 9001, 333])], config=cfg
    )


def test_default_mel_config_is_whispers_128_bin_extractor():
    assert MelConfig() == MelConfig.from_feature_extractor(ref.whisper_fe(128))


def test_precompiled_buckets_serve_many_lengths_without_recompiling():
    import jaxsync
    from jaxsync import registry
    from jaxsync.check import no_recompile

    (spec,) = registry.paths(["voxtral.log_mel"])
    case = spec.build(None)
    jaxsync.precompile([jaxsync.Target("mel", case)], buckets=[256, 1024, 4096], progress=False)
    rng = np.random.default_rng(0)
    with no_recompile():
        for n in (200 * 160 + 7, 1000 * 160, 3000 * 160 + 1, 4000 * 160, 700 * 160):
            x = rng.standard_normal((1, n)).astype(np.float32)
            log_mel_spectrogram(x, [n], **case.kwargs)


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
    a = _audio(n, n_fft)
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
    want = fe._np_extract_fbank_features(_batch([a], width), "cpu")
    assert batch.num_frames.tolist() == [want.shape[-1]] == [(width - n_fft % 2) // 160]
    np.testing.assert_allclose(np.asarray(batch.features)[:1], want, rtol=0, atol=ATOL)


def test_tpu_export_has_no_float64():
    """Traced on this CPU host, the log-mel exported for TPU carries the float32 spectrum only;
    exported for CPU it carries the float64 one (the negative control)."""
    cfg = MelConfig()
    fn = jax.jit(ft.partial(log_mel_rows, spec=MelSpec(cfg, 25, None)))
    args = (jax.ShapeDtypeStruct((1, 4000), np.float32), _one_row_meta())
    tpu = jax.export.export(fn, platforms=["tpu"])(*args).mlir_module()
    cpu = jax.export.export(fn, platforms=["cpu"])(*args).mlir_module()
    assert "fft" in tpu and "f64" not in tpu
    assert "f64" in cpu


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
    x = jax.device_put(_batch(audios))
    meta = jaxsync.upload_packed(plan.fields)
    out = {
        p: np.asarray(log_mel_rows(x, meta, spec=MelSpec(cfg, plan.frames, None, p))[0])
        for p in ("float32", "float64")
    }
    err = np.abs(out["float32"] - out["float64"]).max()
    assert 0 < err <= ATOL_FLOAT32, f"|float32 - float64| = {err:.2e}"


def test_sharded_input_follows_its_placement():
    """A batch sharded over a data axis without `placement=`: metadata follows the input, the
    result equals the single-device one; a `placement=` naming other devices is refused."""
    mesh = jax.make_mesh((8,), ("data",), (jax.sharding.AxisType.Auto,))
    cfg = MelConfig(num_mel_bins=80)
    lens = [4000 + 37 * i for i in range(8)]
    host = _batch([_audio(n, i) for i, n in enumerate(lens)], 4800)
    x = jax.device_put(host, jax.NamedSharding(mesh, jax.P("data")))
    got = log_mel_spectrogram(x, lens, config=cfg)
    want = log_mel_spectrogram(jax.device_put(host), lens, config=cfg)
    np.testing.assert_array_equal(np.asarray(got.features), np.asarray(want.features))
    np.testing.assert_array_equal(np.asarray(got.finite), np.asarray(want.finite))
    with pytest.raises(ValueError, match="placement= names devices"):
        log_mel_spectrogram(x, lens, config=cfg, placement=jax.devices()[0])


@pytest.mark.parametrize("g", [1.5, None])
def test_log_mel_floor_is_vllms_clamp_inside_a_server_jit(g):
    """`log_mel_floor` = vLLM's clamp with Python scalars, traced inside the caller's jit, per
    item of a batch; with `valid` the max spans the real frames only."""
    import torch

    cfg = MelConfig(num_mel_bins=80)
    a, b = _audio(4000, 1), _audio(4000, 2) * 3.0
    filters = torch.from_numpy(slaney_mel_filters(cfg).copy())
    logs = []
    window = torch.hann_window(400, dtype=torch.float64)
    for w in (a, b):
        stft = torch.stft(
            torch.from_numpy(w).double(), 400, 160, window=window, return_complex=True
        )
        logs.append((filters.T @ stft[..., :-1].abs() ** 2).clamp(min=1e-10).log10())
    log = torch.stack(logs).float()
    want = log.clamp(min=g - 8.0) if g else torch.maximum(log, log.amax((1, 2), True) - 8.0)
    want = ((want + 4.0) / 4.0).numpy()
    server = jax.jit(lambda x: jaxsync.models.voxtral.log_mel_floor(x, global_log_mel_max=g))
    np.testing.assert_allclose(np.asarray(server(log.numpy())), want, rtol=0, atol=1e-6)
    valid = np.arange(log.shape[-1]) < 10  # the max over 10 frames only
    part = jaxsync.models.voxtral.log_mel_floor(log.numpy(), global_log_mel_max=g, valid=valid)
    sub = log[..., :10]
    ref_part = sub.clamp(min=g - 8.0) if g else torch.maximum(sub, sub.amax((1, 2), True) - 8.0)
    np.testing.assert_allclose(np.asarray(part)[..., :10], ((ref_part + 4) / 4).numpy(), atol=1e-6)
    assert not np.asarray(part)[..., 10:].any()
    with pytest.raises(TypeError, match="Python float"):
        jaxsync.models.voxtral.log_mel_floor(log.numpy(), global_log_mel_max=2)


def test_repeated_device_call_is_kept_and_still_checked(monkeypatch):
    seen = []
    find = jaxsync.CallCache.find

    def spy(self, x, *metadata):
        run, key = find(self, x, *metadata)
        seen.append(run is not None)
        return run, key

    monkeypatch.setattr(jaxsync.CallCache, "find", spy)
    cfg = MelConfig(num_mel_bins=80)
    x = jax.device_put(_batch([_audio(4000, 1), _audio(3001, 2)]))
    lens = [4000, 3001]
    first = log_mel_spectrogram(x, lens, config=cfg)
    first.num_frames[:] = -1  # the caller's own copy: the next call's counts are unchanged
    second = log_mel_spectrogram(x, lens, config=cfg)
    assert seen[-1] is True and second.num_frames.tolist() == [4000 // 160, 3001 // 160]
    np.testing.assert_array_equal(np.asarray(first.features), np.asarray(second.features))
    before = len(seen)
    other = log_mel_spectrogram(x, lens, config=cfg, floor="per_example")  # other settings
    assert True not in seen[before:] and not np.array_equal(
        np.asarray(other.features), np.asarray(second.features)
    )
    lens[1] = 5000  # mutated in place: checked again, refused
    with pytest.raises(ValueError, match="exceed"):
        log_mel_spectrogram(x, lens, config=cfg)
    x.delete()
    with pytest.raises(ValueError, match="waveforms was deleted"):
        log_mel_spectrogram(x, [4000, 3001], config=cfg)
