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
import jaxsync.testing
from jaxsync.models.voxtral import (
    MelConfig,
    VoxtralAudioConfig,
    VoxtralAudioEncoder,
    VoxtralAudioTower,
)
from jaxsync.paths.voxtral import reference as ref


TINY = ref.TINY_ENCODER  # odd sizes: head_dim 7, 2 layers, a window = 40 frames = 6400 samples


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


def _waveform_meta(enc: VoxtralAudioEncoder, lens, width: int, b_pad: int):
    from jaxsync.models.voxtral import plan_log_mel, plan_waveform_chunks

    mel = plan_log_mel(np.array(lens), width, b_pad, enc.mel_config, floor="per_audio",
                       pad_to_multiple_of=enc.chunk_samples)  # fmt: skip
    plan = plan_waveform_chunks(mel, b_pad, enc.mel_config, enc.config, None)
    return plan, jaxsync.upload_packed(plan.fields)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_jit_argument_count_is_small_and_depth_free(dtype):
    """The entry's program takes the packed state (one buffer per dtype), the input and the
    packed metadata, whatever the depth: the same count at 1 and 5 layers, <= 6."""
    counts = []
    for depth in (1, 5):
        cfg = VoxtralAudioConfig(**{**TINY, "num_hidden_layers": depth})
        tower = VoxtralAudioTower(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
        enc = VoxtralAudioEncoder(tower)
        x = jax.device_put(_batch([_audio(7001, 0), _audio(300, 1)], 12800))
        _, meta = _waveform_meta(enc, [7001, 300], 12800, 2)
        waves = len(jax.tree.leaves(enc.lower(x, meta).args_info))
        feats = jax.device_put(_mel(3, cfg, 0).astype(np.float32))
        from jaxsync.models.voxtral import plan_chunks

        fmeta = jaxsync.upload_packed(plan_chunks(np.array([1, 2]), 2, 3, cfg).fields)
        counts.append((waves, len(jax.tree.leaves(enc.lower(feats, fmeta).args_info))))
    assert counts[0] == counts[1] and max(counts[0]) <= 6, counts


def test_pure_forward_drops_into_a_server_jit(encoder):
    """A server runs `forward` / `forward_waveforms` inside its own jit with the weights as
    arguments: the same rows as the entry, and new weights are used without a recompile."""
    from jaxsync.models.voxtral import MelSpec, forward, forward_waveforms, plan_chunks

    tower = _tower()
    graphdef, state = nnx.split(tower)
    cfg = tower.config
    feats = jax.device_put(_mel(3, cfg, 2).astype(np.float32))
    meta = jaxsync.upload_packed(plan_chunks(np.array([2, 1]), 2, 3, cfg).fields)

    @jax.jit
    def step(state, feats, meta):
        return forward(nnx.merge(graphdef, state), feats, meta)

    emb, finite = step(state, feats, meta)
    want = encoder(input_features=feats, num_chunks=[2, 1])
    np.testing.assert_allclose(emb, want.embeddings, rtol=1e-5, atol=1e-6)
    assert np.asarray(finite).tolist() == [True, True]
    args = step.lower(state, feats, meta).args_info[0][0]
    assert len(jax.tree.leaves(args)) == len(jax.tree.leaves(state))  # weights are arguments
    halved_state = jax.tree.map(lambda w: w * 0.5, state)
    with jaxsync.check.no_recompile():
        halved, _ = step(halved_state, feats, meta)
    assert not np.allclose(halved, emb)

    lens = [7001, 300]
    x = jax.device_put(_batch([_audio(n, i) for i, n in enumerate(lens)], 12800))
    plan, wmeta = _waveform_meta(encoder, lens, 12800, 2)
    spec = MelSpec(encoder.mel_config, cfg.chunk_frames, None)
    waves = jax.jit(lambda s, x, m: forward_waveforms(nnx.merge(graphdef, s), x, m, mel=spec))
    emb, finite = waves(state, x, wmeta)
    want = encoder(x, lens)
    np.testing.assert_allclose(emb, want.embeddings, rtol=1e-5, atol=1e-6)
    assert plan.num_tokens.tolist() == list(want.lengths)


def test_load_state_takes_new_weights_without_recompiling():
    tower = _tower()
    enc = VoxtralAudioEncoder(tower)
    feats = jax.device_put(_mel(2, tower.config, 3).astype(np.float32))
    before = np.asarray(enc(input_features=feats).embeddings)
    _, state = nnx.split(tower)
    nnx.update(tower, jax.tree.map(lambda w: w * 0.5, state))
    np.testing.assert_array_equal(enc(input_features=feats).embeddings, before)  # a snapshot
    with jaxsync.check.no_recompile():
        enc.load_state(tower)
        after = enc(input_features=feats).embeddings
    want = jax.jit(lambda m: tower.audio_features(m))(feats)
    np.testing.assert_allclose(after, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="same parameter structure"):
        enc.load_state(_tower(num_hidden_layers=3))


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


@pytest.fixture(scope="module")
def whisper_sized():
    """A narrow tower with Whisper's 1500 positions (3000-frame windows) and the extractor built
    locally with the Voxtral arguments (128 bins, 16 kHz, hop 160, n_fft 400, 30 s)."""
    pytest.importorskip("transformers")
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(
        feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=30, n_fft=400
    )
    tower = _tower(max_source_positions=1500, num_hidden_layers=1)
    return fe, VoxtralAudioEncoder(tower, MelConfig.from_feature_extractor(fe)), tower


@pytest.mark.parametrize("tensors", ["np", "pt"])
def test_processor_features_go_straight_in(whisper_sized, tensors):
    """`encoder(**extractor_output)` (numpy or torch CPU) equals the tower on those features,
    and the raw audio through the on-device log-mel gives the same embeddings within the
    front end's bound."""
    from jaxsync.testing import rel_err

    fe, enc, tower = whisper_sized
    audios = [_audio(n, i) for i, n in enumerate([16000 * 3 + 77, 16000 * 12 + 1])]
    inputs = fe(audios, sampling_rate=16000, return_tensors=tensors, return_attention_mask=True)
    out = enc(**inputs)
    assert out.lengths == (375, 375) and out.offsets == (0, 375)
    feats = np.asarray(inputs["input_features"], np.float32)
    want = np.asarray(jax.jit(tower.audio_features)(feats))
    assert rel_err(np.asarray(out.embeddings)[:750], want) <= 1e-5
    raw = enc(audio=audios, sampling_rate=16000)
    assert raw.lengths == out.lengths
    # log-mel within 2e-5 of transformers' features -> embeddings within ~1e-4 relative
    assert rel_err(np.asarray(raw.embeddings)[:750], want) <= 1e-4
    # The Voxtral processor: a 31 s audio padded to two windows, one item of two windows.
    long = _audio(16000 * 31 + 5, 9)
    chunks = ref.processor_features(fe, long, 3000)  # [2, 128, 3000]
    both = enc(input_features=chunks, num_chunks=[2])
    assert both.lengths == (750,)
    want = np.asarray(jax.jit(tower.audio_features)(chunks.astype(np.float32)))
    assert rel_err(np.asarray(both.embeddings)[:750], want) <= 1e-5
    raw = enc(audio=[long])
    assert rel_err(np.asarray(raw.embeddings)[:750], want) <= 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("torch")

    _, path, _ = ref.build_tiny_voxtral(tmp_path_factory.mktemp("voxtral"))
    return path


def _mesh(shape, names):
    return jax.make_mesh(shape, names, (jax.sharding.AxisType.Auto,) * len(shape))


def test_data_parallel_inputs_over_replicated_weights(checkpoint):
    """Weights replicated over an 8-device mesh, audio sharded over its batch axis: the same
    rows as on one device; inputs on other devices than the weights are refused by name."""
    from jaxsync.models.voxtral import load_model

    mesh = _mesh((8,), ("data",))
    single = VoxtralAudioEncoder(load_model(checkpoint))
    enc = VoxtralAudioEncoder(load_model(checkpoint, mesh=mesh))
    assert enc.placement.is_fully_replicated
    lens = [7001 + 613 * i for i in range(8)]
    host = _batch([_audio(n, i) for i, n in enumerate(lens)], 12800)
    x = jax.device_put(host, jax.NamedSharding(mesh, jax.P("data")))
    got, want = enc(x, lens), single(jax.device_put(host), lens)
    np.testing.assert_allclose(got.embeddings, want.embeddings, rtol=1e-5, atol=1e-6)
    assert np.asarray(got.extras["finite"]).all()
    host_in = enc(host, lens)  # host data: uploaded next to the weights
    np.testing.assert_allclose(host_in.embeddings, want.embeddings, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="inputs live on devices"):
        single(x, lens)


def test_tower_weights_sharded_over_a_model_axis(checkpoint):
    from jaxsync.models.voxtral import PARTITION_RULES, load_model

    mesh = _mesh((2, 4), ("data", "model"))
    tower = load_model(checkpoint, mesh=mesh, partition_rules=PARTITION_RULES)
    spec = tower.layers[0].fc1.kernel[...].sharding.spec
    assert tuple(spec) == (None, "model")
    assert tuple(tower.multi_modal_projector.linear_2.kernel[...].sharding.spec) == ("model", None)
    enc, single = VoxtralAudioEncoder(tower), VoxtralAudioEncoder(load_model(checkpoint))
    lens = [7001, 12800]
    host = _batch([_audio(n, i) for i, n in enumerate(lens)], 12800)
    # Matmuls split over the model axis sum in another order: their float32 error scales with
    # the summands (the output's scale), so near-zero outputs get an absolute bound of 1e-5 of it.
    got, want = enc(host, lens), single(host, lens)
    scale = float(np.abs(want.embeddings).max())
    np.testing.assert_allclose(got.embeddings, want.embeddings, rtol=1e-5, atol=1e-5 * scale)
    feats = _mel(3, tower.config, 4).astype(np.float32)
    got, want = enc(input_features=feats), single(input_features=feats)
    scale = float(np.abs(want.embeddings).max())
    np.testing.assert_allclose(got.embeddings, want.embeddings, rtol=1e-5, atol=1e-5 * scale)


def _matmul_flops(jaxpr) -> float:
    """2 x multiply-adds of every dot_general and convolution in a jaxpr, nested ones included."""
    from jaxsync.check._static import iter_eqns

    total = 0.0
    for _, eqn in iter_eqns(jaxpr):
        out = eqn.outvars[0].aval.shape
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * np.prod(out) * np.prod([lhs[i] for i in contract])
        elif eqn.primitive.name == "conv_general_dilated":
            rhs = eqn.invars[1].aval.shape  # kernel: its input-channel and spatial dims
            out_ch = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
            total += 2 * np.prod(out) * np.prod(rhs) / out_ch
    return float(total)


@pytest.mark.parametrize("windows", [1, 3])
def test_bench_flops_count_every_matmul_of_the_forward(windows):
    # The bench's TFLOP/s divides an analytic count: it must equal the dot and conv work that
    # the forward actually traces (layers, attention, conv stem, projector).
    from jaxsync.models.voxtral import forward, plan_chunks
    from jaxsync.paths.voxtral.bench import encoder_flops

    tower = _tower()
    cfg = tower.config
    plan = plan_chunks(np.ones(windows, np.int64), windows, windows, cfg)
    features = jnp.zeros((windows, cfg.num_mel_bins, cfg.chunk_frames), jnp.float32)

    def run(features, meta):
        return forward(tower, features, meta)

    jaxpr = jax.make_jaxpr(run)(features, jaxsync.upload_packed(plan.fields))
    assert encoder_flops(cfg, windows) == _matmul_flops(jaxpr.jaxpr)
    assert encoder_flops(cfg, windows + 1) != _matmul_flops(jaxpr.jaxpr)  # control


def test_encoder_program_asks_for_cublas_matmuls(encoder):
    assert encoder._program.matmuls == "cublas"
