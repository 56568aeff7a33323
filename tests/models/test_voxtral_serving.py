"""VoxtralAudioEncoder in a server: new weights without a recompile, the processor's features,
data-parallel and model-sharded meshes, and the bench's FLOP count."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsync
import jaxsync.check
import jaxsync.testing
from jaxsync.harness.paths.voxtral import reference as ref
from jaxsync.models.voxtral import MelConfig, VoxtralAudioEncoder


_tower, _audio, _batch, _mel = (
    ref.tiny_tower,
    ref.noisy_audio,
    ref.padded_batch,
    ref.window_features,
)


def test_load_state_takes_new_weights_without_recompiling():
    tower = _tower()
    enc = VoxtralAudioEncoder(tower)
    feats = jax.device_put(_mel(2, tower.cfg, 3).astype(np.float32))
    before = np.asarray(enc(input_features=feats).embeddings)
    _, state = nnx.split(tower)
    nnx.update(tower, jax.tree.map(lambda w: w * 0.5, state))
    np.testing.assert_array_equal(enc(input_features=feats).embeddings, before)  # a snapshot
    with jaxsync.check.no_recompile():
        enc.load_state(tower)
        after = enc(input_features=feats).embeddings
    want = jax.jit(lambda m: tower.audio_features(m))(feats)
    np.testing.assert_allclose(after, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="load_state needs a model of the same structure"):
        enc.load_state(_tower(num_hidden_layers=3))


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
    with pytest.raises(ValueError, match="inputs on devices"):
        single(x, lens)


def test_tower_weights_sharded_over_a_model_axis(checkpoint):
    from jaxsync.models.voxtral import PARTITION_RULES, load_model

    mesh = _mesh((2, 4), ("data", "model"))
    tower = load_model(checkpoint, mesh=mesh, partition_rules=PARTITION_RULES)
    spec = tower.layers.layer.fc1.kernel[...].sharding.spec  # [L, D, F]: the layer axis whole
    assert tuple(spec) == (None, None, "model")
    assert tuple(tower.layers.layer.self_attn.out_proj.kernel[...].sharding.spec) == (
        None, "model", None,
    )  # fmt: skip
    assert tuple(tower.multi_modal_projector.linear_2.kernel[...].sharding.spec) == ("model", None)
    assert tuple(tower.layers.layer.self_attn.q_proj.bias[...].sharding.spec) == (None, "model")
    enc, single = VoxtralAudioEncoder(tower), VoxtralAudioEncoder(load_model(checkpoint))
    lens = [7001, 12800]
    host = _batch([_audio(n, i) for i, n in enumerate(lens)], 12800)
    # Matmuls split over the model axis sum in another order: their float32 error scales with
    # the summands (the output's scale), so near-zero outputs get an absolute bound of 1e-5 of it.
    got, want = enc(host, lens), single(host, lens)
    scale = float(np.abs(want.embeddings).max())
    np.testing.assert_allclose(got.embeddings, want.embeddings, rtol=1e-5, atol=1e-5 * scale)
    feats = _mel(3, tower.cfg, 4).astype(np.float32)
    got, want = enc(input_features=feats), single(input_features=feats)
    scale = float(np.abs(want.embeddings).max())
    np.testing.assert_allclose(got.embeddings, want.embeddings, rtol=1e-5, atol=1e-5 * scale)


def _matmul_flops(jaxpr) -> float:
    """2 x multiply-adds of every dot_general and convolution in a jaxpr, nested ones included;
    a scan's body counts once per iteration (the stacked layers run as one scan)."""
    total = 0.0
    for eqn in jaxpr.eqns:
        out = eqn.outvars[0].aval.shape
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * np.prod(out) * np.prod([lhs[i] for i in contract])
        elif eqn.primitive.name == "conv_general_dilated":
            rhs = eqn.invars[1].aval.shape  # kernel: its input-channel and spatial dims
            out_ch = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
            total += 2 * np.prod(out) * np.prod(rhs) / out_ch
        times = eqn.params["length"] if eqn.primitive.name == "scan" else 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            total += times * _matmul_flops(sub)
    return float(total)


@pytest.mark.parametrize("windows", [1, 3])
def test_bench_flops_count_every_matmul_of_the_forward(windows):
    # The bench's TFLOP/s divides an analytic count: it must equal the dot and conv work that
    # the forward actually traces (layers, attention, conv stem, projector).
    from jaxsync.harness.paths.voxtral.bench import encoder_flops
    from jaxsync.models.voxtral import forward, plan

    tower = _tower()
    cfg = tower.cfg
    planned = plan(np.ones(windows, np.int64), cfg, buckets=(windows,))
    features = jnp.zeros((windows, cfg.num_mel_bins, cfg.chunk_frames), jnp.float32)

    def run(features, meta):
        return forward(tower, features, meta)

    jaxpr = jax.make_jaxpr(run)(features, jaxsync.upload_packed(planned))
    assert encoder_flops(cfg, windows) == _matmul_flops(jaxpr.jaxpr)
    assert encoder_flops(cfg, windows + 1) != _matmul_flops(jaxpr.jaxpr)  # control


def test_bench_server_form_row_computes_the_entrys_rows():
    """The bench's '· server form' rows time the entry's own computation (control: another
    plan's windows give other rows)."""
    from jaxsync.harness.paths._server import rows_only, server_runner
    from jaxsync.models.voxtral import forward, plan

    tower = _tower()
    feats = jax.device_put(_mel(3, tower.cfg, 6).astype(np.float32))
    runner = server_runner(tower, rows_only(forward))
    run = runner(plan([1, 1, 1], tower.cfg, buckets=(3,)), lambda: feats)
    want = VoxtralAudioEncoder(tower)(input_features=feats).rows
    jaxsync.testing.assert_same_math(run(), want)
    assert run().shape == want.shape
    doubled = runner(plan([1, 1, 1], tower.cfg, buckets=(3,)), lambda: feats * 2)
    assert not np.allclose(doubled(), want)
