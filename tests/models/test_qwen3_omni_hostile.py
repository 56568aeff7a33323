"""Hostile inputs to every public entry point of jaxsync.models.qwen3_omni.

Each bad input must raise a clear typed error naming the problem before any upload or compile
(uploads are watched by `jaxsync.testing.watch_uploads`, compiles by `no_recompile`), leaving
the inputs bit-identical; non-finite data must stay inside its own audio.
Bad encoder arguments, configs and checkpoints live in test_qwen3_omni_hostile_config.py.
"""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, example, given, settings, strategies as st

import jaxsync
import jaxsync.testing
from jaxsync.check import no_recompile
from jaxsync.harness.paths.qwen3_omni import reference as ref
from jaxsync.models import qwen3_omni as q3


CFG = ref.TINY
F = CFG.num_mel_bins


@pytest.fixture(scope="module")
def enc():
    encoder = q3.Qwen3OmniAudioEncoder(q3.Qwen3OmniAudioTower(CFG, rngs=nnx.Rngs(0)))
    lens = [120, 30]
    encoder(ref.random_features(CFG, lens), lens)  # warm: later calls of this mix compile nothing
    return encoder


@pytest.fixture
def no_upload(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("uploaded before validating")

    jaxsync.testing.watch_uploads(monkeypatch, refuse)


def _refused(fn, exc, match, *inputs):
    """`fn()` raises `exc` matching `match`, compiles nothing, and leaves `inputs` unchanged."""
    before = copy.deepcopy([np.asarray(x) if isinstance(x, jax.Array) else x for x in inputs])
    with no_recompile(), pytest.raises(exc, match=match):
        fn()
    after = [np.asarray(x) if isinstance(x, jax.Array) else x for x in inputs]
    for b, a in zip(before, after, strict=True):
        if isinstance(b, list):  # possibly ragged: compare as Python values
            assert a == b
        else:
            np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- lengths


BAD_LENS = {
    "floats": ([120.0, 30.0], TypeError, "integers"),
    "numpy floats": (np.array([120.0, 30.0]), TypeError, "integers"),
    "numpy float scalars": ([np.float64(120), 30], TypeError, "integers"),
    "bools": ([True, False], TypeError, "integers"),
    "bool mixed in": ([True, 149], TypeError, "integers"),
    "numpy bools": (np.array([True, True]), TypeError, "integers"),
    "negative": ([151, -1], ValueError, ">= 0"),
    "2-D": ([[120, 30]], ValueError, "rank 1"),
    "ragged": ([[120], [30, 1]], ValueError, "ragged"),
    "strings": (["120", "30"], TypeError, "integers"),
    "objects": ([object(), 1], TypeError, "integers|numeric"),
    "device array": (jnp.array([120, 30]), TypeError, "host data"),
    "sum too large": ([120, 31], ValueError, "sum to 151"),
    "sum too small": ([120, 29], ValueError, "sum to 149"),
}


@pytest.mark.parametrize("case", list(BAD_LENS))
def test_bad_lengths(enc, no_upload, case):
    lens, exc, match = BAD_LENS[case]
    f = ref.random_features(CFG, [120, 30])
    _refused(lambda: enc(f, lens), exc, match, f)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(lens=st.lists(st.integers(0, 500), max_size=6), extra=st.integers(1, 40))
def test_lengths_that_do_not_fit_the_frames(enc, no_upload, lens, extra):
    total = sum(lens)
    f = np.zeros((F, total + extra), np.float32)
    if total + extra == q3.frame_bucket(total):  # a legal padded batch: not this test's case
        return
    _refused(lambda: enc(f, lens), ValueError, "feature_lens sum to", f)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@example(lens=[150, 189, 206, 260])  # an element near 0 rounds 1.3e-6 apart (scale ~2)
@given(lens=st.lists(st.integers(0, 260), min_size=1, max_size=5))
def test_any_length_mix_matches_each_audio_alone(enc, lens):
    # windows never mix audios: each audio's rows equal its own batch's, whatever surrounds it
    # (short-chunk batch dependence aside: keep every batch's longest chunk a full one). The
    # two batches are different programs, so they agree to fp32 rounding against the rows'
    # scale (max-norm relative, the parity convention), not element by element near zero.
    lens = [*lens, 100]
    f = ref.random_features(CFG, lens, seed=len(lens))
    out = enc(f, lens).split()
    starts = np.cumsum([0, *lens])
    for a, n in enumerate(lens[:-1]):
        alone = np.concatenate([f[:, starts[a] : starts[a] + n], f[:, -100:]], axis=1)
        want = enc(alone, [n, 100]).split()[0]
        jaxsync.testing.assert_close(out[a], want, rtol=1e-5, err_msg=f"audio {a} of {lens}")
        if n:  # negative control: rows 1e-4 of their scale off are refused
            off = np.asarray(want) + 1e-4 * np.abs(np.asarray(want)).max()
            with pytest.raises(AssertionError):
                jaxsync.testing.assert_close(off, want, rtol=1e-5)


# ---------------------------------------------------------------- features


BAD_FEATURES = {
    "1-D": (np.zeros(150, np.float32), ValueError, "num_mel_bins, frames"),
    "3-D": (np.zeros((1, F, 150), np.float32), ValueError, "num_mel_bins, frames"),
    "mel bins": (np.zeros((F + 1, 150), np.float32), ValueError, "mel bins"),
    "int dtype": (np.zeros((F, 150), np.int32), TypeError, "floating point"),
    "bool dtype": (np.zeros((F, 150), bool), TypeError, "floating point"),
    "ragged list": ([[0.0] * 150] * (F - 1) + [[0.0]], ValueError, "ragged"),
    "NaN": ("nan", ValueError, "non-finite"),
    "inf": ("inf", ValueError, "non-finite"),
    "device ints": ("device int", TypeError, "floating point"),
}


@pytest.mark.parametrize("case", list(BAD_FEATURES))
def test_bad_features(enc, no_upload, case):
    f, exc, match = BAD_FEATURES[case]
    if isinstance(f, str) and f in ("nan", "inf"):
        f = ref.random_features(CFG, [120, 30])
        f[5, 140] = float(f"-{case}" if case == "inf" else "nan")
    elif isinstance(f, str):
        f = jnp.zeros((F, 150), jnp.int32)
    _refused(lambda: enc(f, [120, 30]), exc, match, f)


def test_non_finite_torch_features_refused(enc, no_upload):
    torch = pytest.importorskip("torch")
    f = torch.from_numpy(ref.random_features(CFG, [120, 30]))
    f[0, 0] = float("nan")
    _refused(lambda: enc(f, [120, 30]), ValueError, "non-finite", f.numpy())


def test_argument_forms(enc, no_upload):
    f = ref.random_features(CFG, [120, 30])
    mask = np.ones((2, 120), np.int64)
    _refused(lambda: enc(f), TypeError, "required", f)
    _refused(lambda: enc(f, [120, 30], input_features=f[None]), TypeError, "not both", f)
    _refused(lambda: enc(input_features=f[None]), TypeError, "go together", f)
    _refused(lambda: enc(feature_attention_mask=mask), TypeError, "go together", mask)


def test_deleted_features(enc):
    x = jaxsync.async_h2d(ref.random_features(CFG, [120, 30]))
    x.delete()
    with no_recompile(), pytest.raises(ValueError, match="deleted"):
        enc(x, [120, 30])


def test_features_on_other_devices_than_the_weights(enc, no_upload):
    other = jax.devices()[1]
    x = jax.device_put(ref.random_features(CFG, [120, 30]), other)
    _refused(lambda: enc(x, [120, 30]), ValueError, "same devices", x)
    mesh = jax.make_mesh((len(jax.devices()),), ("data",), (jax.sharding.AxisType.Auto,))
    spread = jax.device_put(x, jax.NamedSharding(mesh, jax.P()))
    _refused(lambda: enc(spread, [120, 30]), ValueError, "same devices", spread)


def test_upload_placement_away_from_the_weights_is_refused_when_built():
    """Features must sit beside the weights, so a placement elsewhere could never serve: it is
    refused before any upload, naming both placements."""
    tower = q3.Qwen3OmniAudioTower(CFG, rngs=nnx.Rngs(0))
    with pytest.raises(
        ValueError, match=r"placement \(cpu:1\) on devices \[1\], but the weights on devices \[0\]"
    ):
        q3.Qwen3OmniAudioEncoder(tower, placement=jax.devices()[1])


# ---------------------------------------------------------------- non-finite device data


@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("victim", [0, 2, 4])
def test_one_poisoned_audio_leaves_every_other_audio_bit_identical(enc, poison, victim):
    lens = [120, 0, 333, 1, 250]  # multi-window, empty, one-frame and short-tail audios
    f = q3.pad_features(ref.random_features(CFG, lens, seed=4), lens)
    clean = enc(jaxsync.async_h2d(f), lens)
    bad = f.copy()
    start = sum(lens[:victim])
    bad[3, start + lens[victim] - 1] = poison  # the victim's last frame
    out = enc(jaxsync.async_h2d(bad), lens)
    flags = np.asarray(out.finite)  # one per audio, padded to the item bucket
    assert flags.shape == (16,)
    rows = np.asarray(out.embeddings)
    for a, (o, n) in enumerate(zip(out.offsets, out.lengths, strict=True)):
        if a == victim:
            assert not flags[a]
            continue
        assert flags[a]
        np.testing.assert_array_equal(rows[o : o + n], np.asarray(clean.embeddings)[o : o + n])
    np.testing.assert_array_equal(rows[out.num_tokens :], 0)  # padding rows stay zero
    assert flags[len(lens) :].all()
    assert np.asarray(clean.finite).all()


def test_non_finite_padding_frames_change_nothing(enc):
    lens = [120, 30]
    f = q3.pad_features(ref.random_features(CFG, lens), lens)
    clean = enc(jaxsync.async_h2d(f), lens)
    f[:, sum(lens) :] = np.nan  # past the last audio: never read
    out = enc(jaxsync.async_h2d(f), lens)
    np.testing.assert_array_equal(np.asarray(out.embeddings), np.asarray(clean.embeddings))
    assert np.asarray(out.finite).all()


# ---------------------------------------------------------------- processor outputs


def test_bad_processor_outputs(enc, no_upload):
    feats = np.zeros((2, F, 130), np.float32)
    mask = np.zeros((2, 130), np.int64)
    mask[0, :120], mask[1, :30] = 1, 1
    cases = [
        (feats[0], mask, ValueError, "rank 3"),
        (feats, mask[0], ValueError, "rank 2"),
        (feats, mask[:, :129], ValueError, "expected \\(batch, frames\\)"),
        (feats.astype(np.int32), mask, TypeError, "floating point"),
        (feats, mask.astype(np.float32), TypeError, "integer or bool"),
        (feats, mask * 2, ValueError, "only 0 and 1"),
        (jnp.asarray(feats), mask, TypeError, "host data"),
    ]
    for x, m, exc, match in cases:
        _refused(lambda x=x, m=m: enc(input_features=x, feature_attention_mask=m), exc, match, x, m)
    poisoned = feats.copy()
    poisoned[1, 0, 10] = np.nan  # a real frame
    _refused(
        lambda: enc(input_features=poisoned, feature_attention_mask=mask),
        ValueError,
        "non-finite",
        poisoned,
    )


def test_non_finite_processor_padding_is_dropped(enc):
    feats = ref.random_features(CFG, [130, 130]).reshape(F, 2, 130).transpose(1, 0, 2)
    mask = np.zeros((2, 130), np.int64)
    mask[0, :120], mask[1, :30] = 1, 1
    clean = enc(input_features=feats, feature_attention_mask=mask)
    feats = feats.copy()
    feats[1, 0, 100] = np.nan  # a padding frame of audio 1: never part of the batch
    out = enc(input_features=feats, feature_attention_mask=mask)
    assert out.lengths == tuple(q3.feat_extract_output_lengths([120, 30]).tolist())
    np.testing.assert_array_equal(np.asarray(out.embeddings), np.asarray(clean.embeddings))
