"""Hostile inputs to every public Voxtral entry point: a typed error naming the problem, raised
on the host before any upload or compile, inputs untouched; or a correct result."""

from __future__ import annotations

import contextlib
import json

import hypothesis
import hypothesis.strategies as st
import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import jaxsync
import jaxsync.check
import jaxsync.testing
from jaxsync.harness.paths.voxtral import reference as ref
from jaxsync.models.voxtral import (
    MelConfig,
    VoxtralAudioConfig,
    VoxtralAudioEncoder,
    VoxtralAudioTower,
    load_model,
    log_mel_floor,
    log_mel_spectrogram,
    plan,
)
from jaxsync.weights import WeightError


TINY = ref.TINY_ENCODER
CFG = VoxtralAudioConfig(**TINY)


@pytest.fixture(scope="module")
def encoder() -> VoxtralAudioEncoder:
    enc = VoxtralAudioEncoder(VoxtralAudioTower(CFG, rngs=nnx.Rngs(0)), MelConfig())
    x = _batch([_audio(5000, 0), _audio(3000, 1)])
    enc(x, [5000, 3000])  # warm: a refused call below must compile nothing new
    enc(input_features=np.zeros((2, 128, 40), np.float32))
    return enc


def _audio(n: int, seed: int) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


def _batch(audios, width=None):
    x = np.zeros((len(audios), width or max(map(len, audios))), np.float32)
    for i, a in enumerate(audios):
        x[i, : len(a)] = a
    return x


@pytest.fixture
def uploads(monkeypatch):
    """Host->device transfers of host data, pageable or staged."""
    return jaxsync.testing.watch_uploads(monkeypatch)


@contextlib.contextmanager
def refused(uploads, exc, match, *inputs):
    """The call raises `exc` matching `match`, with no upload, no trace or compile, and the
    host inputs unchanged."""
    before, copies = len(uploads), [np.array(x, copy=True) for x in inputs]
    with jaxsync.check.no_recompile(), pytest.raises(exc, match=match):
        yield
    assert len(uploads) == before, "uploaded before refusing"
    for x, c in zip(inputs, copies, strict=True):
        assert np.asarray(x).tobytes() == c.tobytes()  # bit-identical, NaN included


X = _batch([_audio(5000, 0), _audio(3000, 1)])

AUDIO_CASES = [
    (dict(lengths=[5000.0, 3000.0]), TypeError, "lengths must hold integers"),
    (dict(lengths=[True, True]), TypeError, "lengths must hold integers"),
    (dict(lengths=[5000]), ValueError, "lengths must be 2 host ints"),
    (dict(lengths=[[5000], [3000, 1]]), ValueError, "ragged"),
    (dict(lengths=[5000, -3]), ValueError, "empty audio"),
    (dict(lengths=[5000, 0]), ValueError, "empty audio"),
    (dict(lengths=[5001, 3000]), ValueError, "exceed the buffer width"),
    (dict(lengths=[5000, 3000], sampling_rate=24000), ValueError, "sampled at 24000 Hz"),
    (dict(lengths=[5000, 3000], sampling_rate=16000.0), TypeError, "sampling_rate must be an int"),
]


@pytest.mark.parametrize(("kw", "exc", "match"), AUDIO_CASES)
def test_encoder_audio_metadata(encoder, uploads, kw, exc, match):
    with refused(uploads, exc, match, X):
        encoder(X, **kw)


@pytest.mark.parametrize(
    ("audio", "exc", "match"),
    [
        (X.astype(np.int16), TypeError, "floating point"),
        (X[:, :, None], ValueError, "mono"),
        (np.zeros((0, 100), np.float32), ValueError, "empty batch"),
        ([], ValueError, "empty batch"),
        ([X[0], X], ValueError, r"audio\[1\] must have rank 1"),
        ([X[0], np.array(["a", None], dtype=object)], TypeError, "numeric"),
        (np.where(np.arange(5000) == 17, np.nan, X), ValueError, r"waveforms \[0, 1\] contain NaN"),
    ],
)
def test_encoder_bad_audio_data(encoder, uploads, audio, exc, match):
    inputs = (audio,) if isinstance(audio, np.ndarray) and audio.dtype != object else ()
    with refused(uploads, exc, match, *inputs):
        encoder(audio)


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        (dict(), ValueError, "exactly one of audio= and input_features="),
        (dict(audio=X, input_features=np.zeros((1, 128, 40))), ValueError, "exactly one"),
        (dict(input_features=np.zeros((1, 80, 40))), ValueError, r"must be \[C, 128, 40\]"),
        (dict(input_features=np.zeros((1, 128, 3000))), ValueError, r"must be \[C, 128, 40\]"),
        (dict(input_features=np.zeros((1, 128, 40), np.int32)), TypeError, "floating point"),
        (dict(input_features=np.full((1, 128, 40), np.nan)), ValueError, "non-finite"),
        (dict(input_features=np.full((1, 128, 40), np.nan, ml_dtypes.bfloat16)), ValueError,
         "non-finite"),  # bfloat16 is not a numpy float: checked all the same
        (dict(input_features=np.zeros((0, 128, 40))), ValueError, "no windows"),
        (dict(input_features=np.zeros((3, 128, 40)), num_chunks=[1.0, 2.0]), TypeError,
         "num_chunks must hold integers"),
        (dict(input_features=np.zeros((3, 128, 40)), num_chunks=[1, 1]), ValueError,
         "sums to 2 but input_features has 3"),
        (dict(input_features=np.zeros((3, 128, 40)), num_chunks=[3, 0]), ValueError, ">= 1"),
        (dict(input_features=np.zeros((1, 128, 40)), lengths=[3]), ValueError, "go with audio="),
        (dict(audio=X, num_chunks=[1]), ValueError, "go with input_features="),
    ],
)  # fmt: skip
def test_encoder_bad_features_and_keywords(encoder, uploads, kw, exc, match):
    arrays = [v for v in kw.values() if isinstance(v, np.ndarray)]
    with refused(uploads, exc, match, *arrays):
        encoder(**kw)


def test_encoder_device_inputs_stale_or_misplaced(encoder, uploads):
    x = jax.device_put(X, jax.devices()[1])
    off = r"inputs on devices \[1\], but the weights on devices \[0\]"
    with refused(uploads, ValueError, off):
        encoder(x, [5000, 3000])
    dead = jax.device_put(X)
    dead.delete()  # as after donation to another program
    with refused(uploads, ValueError, "waveforms was deleted"):
        encoder(dead, [5000, 3000])
    feats = jax.device_put(np.zeros((2, 128, 40), np.float32))
    feats.delete()
    with refused(uploads, ValueError, "input_features was deleted"):
        encoder(input_features=feats)
    with refused(uploads, ValueError, "num_chunks sums to 3 but input_features has 2"):
        encoder(input_features=jax.device_put(np.zeros((2, 128, 40), np.float32)),
                num_chunks=[3])  # fmt: skip


def test_encoder_construction():
    tower = VoxtralAudioTower(CFG, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="80 mel bins, the encoder expects 128"):
        VoxtralAudioEncoder(tower, MelConfig(num_mel_bins=80))
    with pytest.raises(ValueError, match="n_fft=401 is odd"):
        VoxtralAudioEncoder(tower, MelConfig(n_fft=401))
    with pytest.raises(TypeError, match="chunk_buckets must hold integers"):
        VoxtralAudioEncoder(tower, chunk_buckets=[2.0, 4.0])
    with pytest.raises(TypeError, match="VoxtralAudioTower"):
        VoxtralAudioEncoder(tower.multi_modal_projector)
    with pytest.raises(TypeError, match="mel_config must be a MelConfig or None, got dict"):
        VoxtralAudioEncoder(tower, {"n_fft": 400})


def test_load_state_refuses_another_model_and_keeps_serving(encoder):
    feats = np.ones((2, 128, 40), np.float32)
    before = np.asarray(encoder(input_features=feats).embeddings)
    other = VoxtralAudioTower(VoxtralAudioConfig(**{**TINY, "num_hidden_layers": 3}),
                              rngs=nnx.Rngs(1))  # fmt: skip
    with pytest.raises(ValueError, match="load_state needs a model of the same structure"):
        encoder.load_state(other)
    np.testing.assert_array_equal(encoder(input_features=feats).embeddings, before)


def test_too_many_windows_fail_before_any_upload(uploads):
    tower = VoxtralAudioTower(CFG, rngs=nnx.Rngs(0))
    enc = VoxtralAudioEncoder(tower, MelConfig(), chunk_buckets=[2, 4])
    x = _batch([_audio(6400 * 3 + 1, 0), _audio(6400, 1)])  # 4 + 1 windows > 4
    with refused(uploads, ValueError, "5 windows of 6400 samples exceed the largest chunk", x):
        enc(x, [6400 * 3 + 1, 6400])
    feats = np.zeros((5, 128, 40), np.float32)
    with refused(uploads, ValueError, "5 windows exceed the largest chunk bucket 4", feats):
        enc(input_features=feats)
    assert enc(x[:, :6400], [6400, 6400]).lengths == (5, 5)  # within the buckets: fine
    assert len(uploads) == 2  # the plan's metadata and the waveforms


def test_all_zero_mel_filters_are_refused_by_the_config():
    """400 filters over 201 FFT bins leave some all zero (transformers only warns): the config
    itself is refused, so no call can plan, upload or trace with it."""
    with pytest.raises(ValueError, match="are all zero"):
        MelConfig(num_mel_bins=400)
    with pytest.raises(ValueError, match="are all zero"):
        MelConfig(num_mel_bins=90, n_fft=128, hop_length=64)


LOG_MEL_CASES = [
    (dict(lengths=[5000, 100]), ValueError, "shorter than n_fft // 2 \\+ 1"),
    (dict(lengths=[5000.0, 3000.0]), TypeError, "lengths must hold integers"),
    (dict(lengths=[5000, 3000], pad_to_multiple_of=6400.0), TypeError, "pad_to_multiple_of"),
    (dict(lengths=[5000, 3000], pad_to_multiple_of=0), ValueError, "must be positive"),
    (dict(lengths=[5000, 3000], floor="per_example", max_length=9e3), TypeError, "max_length"),
    (dict(lengths=[5000, 3000], floor="per_example", max_length=100), ValueError, "must exceed"),
    (dict(lengths=[5000, 3000], max_length=9000), ValueError, "applies to floor='per_example'"),
    (dict(lengths=[5000, 3000], floor="loud"), ValueError, "floor must be"),
    (dict(lengths=[5000, 3000], floor="global"), ValueError, "floor='global' needs"),
    (dict(lengths=[5000, 3000], floor="per_example", pad_to_multiple_of=400), ValueError,
     "does not apply"),
]  # fmt: skip


@pytest.mark.parametrize(("kw", "exc", "match"), LOG_MEL_CASES)
def test_log_mel_metadata(uploads, kw, exc, match):
    with refused(uploads, exc, match, X):
        log_mel_spectrogram(X, config=MelConfig(num_mel_bins=80), **kw)


def test_log_mel_device_input_stale_or_misplaced(uploads):
    cfg = MelConfig(num_mel_bins=80)
    x = jax.device_put(X, jax.devices()[2])
    off = r"waveforms on devices \[2\], but placement= on devices \[0\]"
    with refused(uploads, ValueError, off):
        log_mel_spectrogram(x, [5000, 3000], config=cfg, placement=jax.devices()[0])
    x.delete()
    with refused(uploads, ValueError, "waveforms was deleted"):
        log_mel_spectrogram(x, [5000, 3000], config=cfg)


@pytest.mark.parametrize(
    ("make", "exc", "match"),
    [
        (lambda: MelConfig(n_fft=400.0), TypeError, "n_fft must be an int, got float"),
        (lambda: MelConfig(hop_length=True), TypeError, "hop_length must be an int, got bool"),
        (lambda: MelConfig(num_mel_bins=0), ValueError, "num_mel_bins must be positive"),
        (lambda: MelConfig(global_log_mel_max=2), TypeError, "Python float"),
        (lambda: VoxtralAudioConfig(**{**TINY, "hidden_size": 28.0}), TypeError, "hidden_size"),
        (lambda: VoxtralAudioConfig(**{**TINY, "num_hidden_layers": True}), TypeError,
         "num_hidden_layers must be an int, got bool"),
        (lambda: VoxtralAudioConfig(**{**TINY, "num_attention_heads": 5}), ValueError,
         "not divisible"),
        (lambda: VoxtralAudioConfig.from_hf_config({"audio_config": {"num_hidden_layers": 2.0}}),
         TypeError, "num_hidden_layers must be an int"),
        (lambda: VoxtralAudioConfig.from_hf_config({"model_type": "voxtral_encoder",
                                                    "rope_theta": 1e4}), ValueError,
         "unsupported non-default Voxtral config field"),
        (lambda: VoxtralAudioConfig.from_hf_config({"head_dim": 99}), ValueError, "head_dim=99"),
        (lambda: VoxtralAudioConfig.from_hf_config(42), TypeError, "expected an HF config"),
        (lambda: log_mel_floor(np.zeros((2, 3)), global_log_mel_max=2), TypeError, "Python float"),
        (lambda: log_mel_spectrogram(X, config={"n_fft": 400}), TypeError,
         "config must be a MelConfig, got dict"),
        (lambda: MelConfig.from_feature_extractor(None), TypeError,
         "feature extractor, got NoneType"),
    ],
)  # fmt: skip
def test_bad_configs(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_bad_checkpoints(tmp_path):
    from safetensors.numpy import save_file

    with pytest.raises(ValueError, match="cannot read a Voxtral config"):
        VoxtralAudioConfig.from_hf_config(tmp_path)  # no config.json
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read a Voxtral config"):
        VoxtralAudioConfig.from_hf_config(tmp_path)
    tower = VoxtralAudioTower(CFG, rngs=nnx.Rngs(0))
    state = {
        "audio_tower." + k.replace(".kernel", ".weight").replace(".scale", ".weight"): np.asarray(v)
        for k, v in jaxsync.weights.to_numpy_state(tower).items()
    }
    (tmp_path / "config.json").write_text(json.dumps({"audio_config": TINY | {"text_hidden_size":
                                                      None}}))  # fmt: skip
    save_file({"audio_tower.conv1.weight": state["audio_tower.conv1.weight"]},
              str(tmp_path / "model.safetensors"))  # fmt: skip
    with pytest.raises(ValueError, match="unsupported non-default Voxtral config field"):
        load_model(tmp_path)
    with pytest.raises(WeightError, match="stored shape"):  # conv kernel in the wrong layout
        load_model(tmp_path / "model.safetensors", CFG)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{trunc")
    with pytest.raises(WeightError):
        load_model(tmp_path / "model.safetensors", CFG)
    with pytest.raises(TypeError, match="cfg must be a VoxtralAudioConfig"):
        load_model(tmp_path / "model.safetensors", {"hidden_size": 28})


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(st.lists(st.integers(1, 5), min_size=1, max_size=9), st.integers(0, 4))
def test_chunk_plans_are_consistent(num_chunks, spare):
    """Any item mix: items own consecutive windows, padding windows belong to no item, the item
    table is padded to the window bucket, and each item's rows follow the previous item's."""
    counts = np.array(num_chunks)
    total = int(counts.sum())
    planned = plan(counts, CFG, buckets=(total + spare,))
    pad = total + spare
    assert (planned.chunks, planned.items) == (pad, pad)
    rows = planned.meta.row_audio
    assert rows.tolist() == np.repeat(np.arange(len(counts)), counts).tolist() + [pad] * spare
    assert planned.lengths == tuple(int(n) * CFG.tokens_per_chunk for n in counts)
    assert planned.meta.item_chunks.tolist() == num_chunks + [0] * (pad - len(counts))
    with pytest.raises(ValueError, match=f"{total} windows exceed the largest chunk bucket"):
        plan(counts, CFG, buckets=(total - 1,))


def test_two_and_three_items_share_one_plan_shape():
    """The planner picks every static size itself: 2 and 3 items of 4 windows in all give the
    same shapes (one program); the item table never adds a static size."""
    shapes = [jax.tree.map(np.shape, plan(counts, CFG).meta) for counts in ([2, 2], [1, 2, 1], [4])]
    assert shapes[0] == shapes[1] == shapes[2]
    assert jax.tree.map(np.shape, plan([1, 1, 1, 1, 1], CFG).meta) != shapes[0]  # control
