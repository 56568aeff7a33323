"""The Voxtral / Whisper log-mel entry point: padding and batch invariance, the finite flag, bad
input and config, compile-time floors, buckets without recompiles, sync-freedom, TPU export,
sharded input, the pure floor inside a server's jit, and kept calls. Parity with transformers
lives in test_voxtral_mel.py."""

from __future__ import annotations

import functools as ft

import jax
import numpy as np
import pytest

import jaxsync
import jaxsync.check
import jaxsync.models.voxtral
from jaxsync._calls import CallCache
from jaxsync.harness.paths.voxtral import reference as ref
from jaxsync.models.voxtral import (
    MelConfig,
    MelSpec,
    log_mel_rows,
    log_mel_spectrogram,
    slaney_mel_filters,
)
from jaxsync.testing import requires_torch


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(floor="per_example", max_length=9000), dict(pad_to_multiple_of=6400)],
    ids=["per_audio", "per_example", "padded_to_multiple"],
)
def test_padding_and_batch_invariance(kw):
    """Valid frames depend only on the audio and its length: not on the buffer width, garbage
    after the length, the batch it shares, bucket padding, or host-vs-device input."""
    cfg = MelConfig(num_mel_bins=80)
    a, b = ref.tone_audio(7001, 5), ref.tone_audio(3333, 6)
    alone = log_mel_spectrogram(a[None], [len(a)], config=cfg, **kw)
    garbage = ref.padded_batch([b, a], width=20000, fill=np.nan)
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
    x = ref.padded_batch(
        [ref.tone_audio(4000, 1), ref.tone_audio(4000, 2), ref.tone_audio(4000, 3)]
    )
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
    x = ref.padded_batch([ref.tone_audio(4000, 1), ref.tone_audio(3000, 2)])
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
    x = jax.device_put(ref.padded_batch([ref.tone_audio(4000, 1)]))
    spec = MelSpec(cfg, 25, cfg.floor_value)
    jaxpr = str(jax.make_jaxpr(ft.partial(log_mel_rows, spec=spec))(x, ref.one_row_meta()))
    assert ("reduce_max" in jaxpr) == (g is None)
    out = log_mel_spectrogram(x, [4000], config=cfg)
    if g is not None:
        assert np.asarray(out.features).min() == pytest.approx((g - 8.0 + 4.0) / 4.0)


def test_sync_free_many_lengths_one_bucket():
    cfg = MelConfig(num_mel_bins=80)
    rng = np.random.default_rng(0)

    def case(lens, width):
        return ref.padded_batch(
            [ref.tone_audio(n, int(rng.integers(1000))) for n in lens], width
        ), list(lens)

    first = case([5000, 7000, 9001], 9001)
    more = [case([9100, 5400, 6666], 9500), case([8000, 8001, 5200], 9000)]
    jaxsync.check.assert_sync_free(log_mel_spectrogram, *first, inputs=more, config=cfg)
    dev = [(jax.device_put(x), n) for x, n in [first, *more] if x.shape[1] == first[0].shape[1]]
    jaxsync.check.assert_sync_free(
        log_mel_spectrogram, *dev[0], inputs=[(dev[0][0], [4000, 9001, 333])], config=cfg
    )


@requires_torch  # the extractor is transformers'
def test_default_mel_config_is_whispers_128_bin_extractor():
    assert MelConfig() == MelConfig.from_feature_extractor(ref.whisper_fe(128))


def test_precompiled_buckets_serve_many_lengths_without_recompiling():
    import jaxsync
    from jaxsync.check import no_recompile
    from jaxsync.harness import registry

    (spec,) = registry.paths(["voxtral.log_mel"])
    case = spec.build(None)
    jaxsync.precompile([case.target("mel")], buckets=[256, 1024, 4096], progress=False)
    rng = np.random.default_rng(0)
    with no_recompile():
        for n in (200 * 160 + 7, 1000 * 160, 3000 * 160 + 1, 4000 * 160, 700 * 160):
            x = rng.standard_normal((1, n)).astype(np.float32)
            log_mel_spectrogram(x, [n], **case.kwargs)


def test_tpu_export_has_no_float64():
    """Traced on this CPU host, the log-mel exported for TPU carries the float32 spectrum only;
    exported for CPU it carries the float64 one (the negative control)."""
    cfg = MelConfig()
    fn = jax.jit(ft.partial(log_mel_rows, spec=MelSpec(cfg, 25, None)))
    args = (jax.ShapeDtypeStruct((1, 4000), np.float32), ref.one_row_meta())
    tpu = jax.export.export(fn, platforms=["tpu"])(*args).mlir_module()
    cpu = jax.export.export(fn, platforms=["cpu"])(*args).mlir_module()
    assert "fft" in tpu and "f64" not in tpu
    assert "f64" in cpu


def test_sharded_input_follows_its_placement():
    """A batch sharded over a data axis without `placement=`: metadata follows the input, the
    result equals the single-device one; a `placement=` naming other devices is refused."""
    mesh = jax.make_mesh((8,), ("data",), (jax.sharding.AxisType.Auto,))
    cfg = MelConfig(num_mel_bins=80)
    lens = [4000 + 37 * i for i in range(8)]
    host = ref.padded_batch([ref.tone_audio(n, i) for i, n in enumerate(lens)], 4800)
    x = jax.device_put(host, jax.NamedSharding(mesh, jax.P("data")))
    got = log_mel_spectrogram(x, lens, config=cfg)
    want = log_mel_spectrogram(jax.device_put(host), lens, config=cfg)
    np.testing.assert_array_equal(np.asarray(got.features), np.asarray(want.features))
    np.testing.assert_array_equal(np.asarray(got.finite), np.asarray(want.finite))
    with pytest.raises(ValueError, match="but placement= on devices"):
        log_mel_spectrogram(x, lens, config=cfg, placement=jax.devices()[0])


@requires_torch  # vLLM's clamp is torch code
@pytest.mark.parametrize("g", [1.5, None])
def test_log_mel_floor_is_vllms_clamp_inside_a_server_jit(g):
    """`log_mel_floor` = vLLM's clamp with Python scalars, traced inside the caller's jit, per
    item of a batch; with `valid` the max spans the real frames only."""
    import torch

    cfg = MelConfig(num_mel_bins=80)
    a, b = ref.tone_audio(4000, 1), ref.tone_audio(4000, 2) * 3.0
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
    find = CallCache.find

    def spy(self, x, *metadata):
        run, key = find(self, x, *metadata)
        seen.append(run is not None)
        return run, key

    monkeypatch.setattr(CallCache, "find", spy)
    cfg = MelConfig(num_mel_bins=80)
    x = jax.device_put(ref.padded_batch([ref.tone_audio(4000, 1), ref.tone_audio(3001, 2)]))
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


def test_host_sample_too_large_for_float32_is_refused():
    """A float64 sample beyond float32's range would become inf in the uploaded batch."""
    cfg = MelConfig(num_mel_bins=80)
    x = ref.padded_batch([ref.tone_audio(4000, 1), ref.tone_audio(4000, 2)]).astype(np.float64)
    assert log_mel_spectrogram(x, [4000, 4000], config=cfg).num_frames.tolist() == [25, 25]
    x[1, 123] = 1e39
    with pytest.raises(ValueError, match=r"waveforms \[1\] contain NaN or inf"):
        log_mel_spectrogram(x, [4000, 4000], config=cfg)
