"""VoxtralAudioEncoder entry: sync-free, buckets, no recompile, poisoned items, drop-in pure
forward, argument count, plan caching, lists of audio, cuBLAS matmuls."""

from __future__ import annotations

import jax
import jax.numpy as jnp
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
)


TINY = ref.TINY_ENCODER  # odd sizes: head_dim 7, 2 layers, a window = 40 frames = 6400 samples
_tower, _audio, _batch, _mel = (
    ref.tiny_tower,
    ref.noisy_audio,
    ref.padded_batch,
    ref.window_features,
)


@pytest.fixture(scope="module")
def encoder() -> VoxtralAudioEncoder:
    return VoxtralAudioEncoder(_tower(), MelConfig())


def test_sync_free_and_no_recompile(encoder):
    rng = np.random.default_rng(3)

    def case(lens):  # all: batch bucket 4, width bucket 128 hops, 8 windows (<= 8)
        return _batch([_audio(n, int(rng.integers(99))) for n in lens], 20000), list(lens)

    first = case([7001, 3000, 12800, 301])
    more = [case([19000, 5000, 6400]), case([12801, 12000, 400, 6399])]
    jaxsync.check.assert_sync_free(encoder, *first, inputs=more)
    mel = jnp.asarray(_mel(2, encoder.cfg, 0), jnp.float32)

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
    cfg = encoder.cfg
    feats = _mel(4, cfg, 1).astype(np.float32)
    clean = encoder(input_features=jax.device_put(feats), num_chunks=[1, 2, 1])
    poisoned = feats.copy()  # a CPU device_put may alias the host buffer
    poisoned[2, 5, 7] = np.inf  # the second window of item 1
    out = encoder(input_features=jax.device_put(poisoned), num_chunks=[1, 2, 1])
    assert np.asarray(out.extras["finite"])[:3].tolist() == [True, False, True]
    for i in (0, 2):
        np.testing.assert_array_equal(_rows(out, i), _rows(clean, i))
    assert np.asarray(clean.extras["finite"])[:3].all()


def _waveform_meta(enc: VoxtralAudioEncoder, lens, width: int, b_pad: int):
    from jaxsync.models.voxtral import WaveformBuckets, plan_waveforms

    buckets = WaveformBuckets(items=(b_pad,), samples=(width,))
    planned = plan_waveforms(lens, enc.cfg, enc.mel_config, buckets=buckets)
    return planned, jaxsync.upload_packed(planned)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_jit_argument_count_is_small_and_depth_free(dtype):
    """The entry's program takes the state's leaves (one per weight kind: the layers are
    stacked), the input and the packed metadata: the same count at 1 and 5 layers."""
    from jaxsync.models.voxtral import plan

    counts = []
    for depth in (1, 5):
        cfg = VoxtralAudioConfig(**{**TINY, "num_hidden_layers": depth})
        tower = VoxtralAudioTower(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
        enc = VoxtralAudioEncoder(tower)
        x = jax.device_put(_batch([_audio(7001, 0), _audio(300, 1)], 12800))
        _, meta = _waveform_meta(enc, [7001, 300], 12800, 2)
        waves = len(jax.tree.leaves(enc.lower(x, meta).args_info))
        feats = jax.device_put(_mel(3, cfg, 0).astype(np.float32))
        fmeta = jaxsync.upload_packed(plan([1, 2], cfg, buckets=(3,)))
        counts.append((waves, len(jax.tree.leaves(enc.lower(feats, fmeta).args_info))))
        assert len(jax.tree.leaves(nnx.state(tower))) == 24  # one leaf per weight kind
        # packed: one flat buffer per dtype (the float32 position table beside bf16 weights),
        # one row buffer for the stack
        packed = 2 if dtype == jnp.float32 else 3
        assert enc.program.num_state_args == packed
    assert counts[0] == counts[1] and max(counts[0]) == packed + 2, counts


def test_pure_forward_drops_into_a_server_jit(encoder):
    """A server runs `forward` / `forward_waveforms` inside its own jit with the weights as
    arguments: the same rows as the entry, and new weights are used without a recompile."""
    from jaxsync.models.voxtral import forward, forward_waveforms, plan

    tower = _tower()
    graphdef, state = nnx.split(tower)
    cfg = tower.cfg
    feats = jax.device_put(_mel(3, cfg, 2).astype(np.float32))
    meta = jaxsync.upload_packed(plan([2, 1], cfg, buckets=(3,)))

    @jax.jit
    def step(state, feats, meta):
        return forward(nnx.merge(graphdef, state), feats, meta)

    emb, finite, extras = step(state, feats, meta)
    want = encoder(input_features=feats, num_chunks=[2, 1])
    np.testing.assert_allclose(emb, want.embeddings, rtol=1e-5, atol=1e-6)
    assert np.asarray(finite).tolist() == [True, True, False] and extras is None  # 3rd: padding
    args = step.lower(state, feats, meta).args_info[0][0]
    assert len(jax.tree.leaves(args)) == len(jax.tree.leaves(state))  # weights are arguments
    halved_state = jax.tree.map(lambda w: w * 0.5, state)
    with jaxsync.check.no_recompile():
        halved = step(halved_state, feats, meta).rows
    assert not np.allclose(halved, emb)

    lens = [7001, 300]
    x = jax.device_put(_batch([_audio(n, i) for i, n in enumerate(lens)], 12800))
    planned, wmeta = _waveform_meta(encoder, lens, 12800, 2)
    waves = jax.jit(
        lambda s, x, m: forward_waveforms(nnx.merge(graphdef, s), x, m, mel=planned.mel)
    )
    emb, finite, _ = waves(state, x, wmeta)
    want = encoder(x, lens)
    np.testing.assert_allclose(emb, want.embeddings, rtol=1e-5, atol=1e-6)
    assert planned.lengths == want.lengths
    assert np.asarray(finite).tolist() == [True, True]


def test_plans_are_cached_per_shape_mix(monkeypatch):
    """A repeated shape mix costs one upload (the audio): its plan and metadata are cached."""
    enc = VoxtralAudioEncoder(_tower())
    lens = [7001, 300]
    x = _batch([_audio(n, i) for i, n in enumerate(lens)])
    enc(x, lens)
    uploads = jaxsync.testing.watch_uploads(monkeypatch)
    with jaxsync.check.no_recompile():
        enc(x * 0.5, lens)
    assert len(uploads) == 1


def test_audio_list_equals_its_padded_batch(monkeypatch):
    """vLLM's form, a list of 1-D waveforms of mixed float dtypes, gives what the same audio as
    a padded `[B, W]` batch with lengths gives; its rows go straight into their bucket."""
    enc = VoxtralAudioEncoder(_tower())
    rows = [_audio(7001, 0), _audio(300, 1).astype(np.float64), _audio(12800, 2)]
    lens = [len(r) for r in rows]
    want = enc(_batch(rows), lens)
    uploads = jaxsync.testing.watch_uploads(monkeypatch)
    got = enc(rows)
    assert len(uploads) == 1  # the bucketed batch: no padded copy made and uploaded on the side
    assert got.lengths == want.lengths and got.offsets == want.offsets
    np.testing.assert_array_equal(np.asarray(got.embeddings), np.asarray(want.embeddings))
    bad = [rows[0], rows[1].copy(), rows[2]]
    bad[1][299] = np.inf  # the last real sample of a row
    with pytest.raises(ValueError, match=r"waveforms \[1\] contain NaN or inf"):
        enc(bad)
    with pytest.raises(TypeError, match=r"floating point, got int16 in audio\[2\]"):
        enc([rows[0], rows[1], (rows[2] * 1000).astype(np.int16)])
    with pytest.raises(ValueError, match=r"empty audio: waveforms \[1\]"):
        enc([rows[0], rows[0][:0]])
    assert len(uploads) == 1  # refused before any upload
