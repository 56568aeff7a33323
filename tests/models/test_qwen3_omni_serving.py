"""Qwen3-Omni audio encoder in a server: the compiled program's argument count, the pure
forward in a server jit, `load_state`, processor outputs and sharding. The planner, config and
plan caching live in test_qwen3_omni.py."""

import jax
import numpy as np
import pytest
from flax import nnx

import jaxsync
import jaxsync.testing
from jaxsync.check import no_recompile
from jaxsync.models import qwen3_omni as q3
from jaxsync.paths.qwen3_omni import reference as ref


@pytest.fixture(scope="module")
def random_encoder():
    return q3.Qwen3OmniAudioEncoder(q3.Qwen3OmniAudioTower(ref.TINY, rngs=nnx.Rngs(0)))


# ---------------------------------------------------------------- program, server, load_state


def _deep(layers):
    cfg = q3.Qwen3OmniAudioConfig(**{**ref.TINY.__dict__, "encoder_layers": layers})
    return q3.Qwen3OmniAudioTower(cfg, rngs=nnx.Rngs(0))


def _device_inputs(lens, seed=0):
    x = q3.pad_features(ref.random_features(ref.TINY, lens, seed=seed), lens)
    return jaxsync.async_h2d(x), list(lens)


@pytest.mark.parametrize("layers", [1, 7])
def test_main_program_takes_three_arguments_at_any_depth(layers):
    enc = q3.Qwen3OmniAudioEncoder(_deep(layers))
    x, lens = _device_inputs([120, 0, 31])
    meta = jaxsync.upload_packed(enc.plan(x.shape, lens).fields)
    # one packed state buffer (one weight dtype) + the features + the packed plan fields
    assert enc.program.num_state_args == 1
    assert len(jax.tree.leaves(enc.program.lower(x, meta).args_info)) == 3
    assert enc.program.num_layers == layers


def test_pure_forward_in_a_server_jit_equals_the_entry_with_no_recompiles():
    tower = q3.Qwen3OmniAudioTower(ref.TINY, rngs=nnx.Rngs(0))
    enc = q3.Qwen3OmniAudioEncoder(tower)
    graphdef, state = nnx.split(tower)

    @jax.jit
    def step(state, x, meta):  # a server's own step: weights are arguments
        return q3.forward(nnx.merge(graphdef, state), x, meta)

    from jaxsync.paths.qwen3_omni.verify import ONE_BUCKET_MIXES

    inputs = [_device_inputs(m, seed=i) for i, m in enumerate(ONE_BUCKET_MIXES)]
    metas = [jaxsync.upload_packed(q3.plan_chunks(lens, ref.TINY).fields) for _, lens in inputs]
    for (x, lens), meta in zip(inputs[:1], metas, strict=False):  # warm-up: one compile each
        step(state, x, meta), enc(x, lens)
    with no_recompile():
        for (x, lens), meta in zip(inputs, metas, strict=True):
            rows, finite = step(state, x, meta)
            out = enc(x, lens)
            np.testing.assert_allclose(rows, out.embeddings, rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(finite, out.extras["finite"])
    # new weights through nnx.update reach the server's step without a recompile
    halved = jax.tree.map(lambda w: w * 0.5, state)
    nnx.update(tower, halved)
    x, lens = inputs[0]
    with no_recompile():
        new_rows, _ = step(nnx.state(tower), x, metas[0])
    assert not np.allclose(new_rows, enc(x, lens).embeddings)  # the entry keeps its snapshot


def test_load_state_takes_new_weights_without_recompiling():
    tower = q3.Qwen3OmniAudioTower(ref.TINY, rngs=nnx.Rngs(0))
    enc = q3.Qwen3OmniAudioEncoder(tower)
    x, lens = _device_inputs([120, 30])
    before = np.asarray(enc(x, lens).embeddings)
    _, state = nnx.split(tower)
    nnx.update(tower, jax.tree.map(lambda w: w * 0.5, state))
    np.testing.assert_array_equal(enc(x, lens).embeddings, before)  # a snapshot until then
    with no_recompile():
        enc.load_state(tower)
        after = enc(x, lens)
    fresh = q3.Qwen3OmniAudioEncoder(tower)(x, lens)
    np.testing.assert_array_equal(after.embeddings, fresh.embeddings)
    assert not np.allclose(after.embeddings, before)
    with pytest.raises(ValueError, match="same parameter structure"):
        enc.load_state(_deep(3))
    np.testing.assert_array_equal(enc(x, lens).embeddings, after.embeddings)


# ---------------------------------------------------------------- processor outputs


@pytest.mark.parametrize("return_tensors", ["np", "pt"])
def test_processor_outputs_go_straight_in(random_encoder, return_tensors):
    # The Qwen3-Omni processor's audio path: WhisperFeatureExtractor with the processor's
    # audio kwargs (padding to the longest, no truncation, the frame mask), the mask renamed
    # to feature_attention_mask. Built locally from its class with explicit arguments.
    transformers = pytest.importorskip("transformers")
    if return_tensors == "pt":
        pytest.importorskip("torch")
    fe = transformers.WhisperFeatureExtractor(
        feature_size=ref.TINY.num_mel_bins,
        sampling_rate=16000,
        hop_length=160,
        chunk_length=30,
        n_fft=400,
        padding_value=0.0,
        return_attention_mask=True,
    )
    rng = np.random.default_rng(0)
    seconds = (0.37, 2.53, 0.011, 1.0)  # 37, 253, 1 and 100 mel frames
    audio = [rng.standard_normal(int(s * 16000)).astype(np.float32) * 0.1 for s in seconds]
    batch = fe(
        audio,
        sampling_rate=16000,
        padding=True,
        truncation=False,
        return_attention_mask=True,
        return_tensors=return_tensors,
    )
    feats, mask = batch["input_features"], batch.pop("attention_mask")
    out = random_encoder(input_features=feats, feature_attention_mask=mask)

    # the same batch by hand: each audio's real frames (a prefix), concatenated in time
    feats_np, mask_np = np.asarray(feats), np.asarray(mask)
    lens = [int(m.sum()) for m in mask_np]
    assert all(m[:n].all() and not m[n:].any() for m, n in zip(mask_np, lens, strict=True))
    concat = np.concatenate([f[:, :n] for f, n in zip(feats_np, lens, strict=True)], axis=1)
    want = random_encoder(concat, lens)
    assert out.lengths == want.lengths
    assert out.lengths == tuple(q3.feat_extract_output_lengths(lens).tolist())
    np.testing.assert_array_equal(np.asarray(out.embeddings), np.asarray(want.embeddings))
    features, feature_lens = q3.features_from_processor(feats, mask)
    np.testing.assert_array_equal(features, concat)
    assert feature_lens.tolist() == lens


# ---------------------------------------------------------------- sharding


def _mesh(shape, names):
    return jax.make_mesh(shape, names, (jax.sharding.AxisType.Auto,) * len(names))


def test_data_parallel_inputs_with_replicated_weights():
    lens = [333, 0, 77, 250, 1, 260, 7]  # 928 frames -> bucket 1024, divisible by 8
    x = q3.pad_features(ref.random_features(ref.TINY, lens), lens)
    tower = q3.Qwen3OmniAudioTower(ref.TINY, rngs=nnx.Rngs(0))
    want = q3.Qwen3OmniAudioEncoder(tower)(x, lens)
    mesh = _mesh((8,), ("data",))
    replicated = jax.NamedSharding(mesh, jax.P())
    _, state = nnx.split(tower)
    nnx.update(tower, jax.tree.map(lambda w: jax.device_put(w, replicated), state))
    enc = q3.Qwen3OmniAudioEncoder(tower)
    assert enc.program.num_state_args == 1  # replicated state still packs
    frames = jax.device_put(x, jax.NamedSharding(mesh, jax.P(None, "data")))
    for features in (frames, x):  # device features split over the mesh; host features
        out = enc(features, lens)
        assert out.embeddings.sharding.device_set == set(mesh.devices.flat)
        np.testing.assert_allclose(out.embeddings, want.embeddings, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(out.extras["finite"], want.extras["finite"])
    with no_recompile():  # the plan and its upload follow the features' placement: cached
        enc(frames, lens)
    off_mesh = jaxsync.async_h2d(x)  # one device: not where the weights are
    with pytest.raises(ValueError, match="same devices"):
        enc(off_mesh, lens)


def test_weights_sharded_over_a_model_axis(tmp_path):
    pytest.importorskip("torch")
    ckpt = ref.save_hf_encoder(
        ref.build_hf_encoder(ref.TINY), tmp_path / "model.safetensors", "thinker.audio_tower."
    )
    lens = [120, 0, 31, 250]
    x = q3.pad_features(ref.random_features(ref.TINY, lens), lens)
    want = q3.Qwen3OmniAudioEncoder(q3.load_model(ckpt, ref.TINY))(x, lens)
    mesh = _mesh((4, 2), ("data", "model"))
    tower = q3.load_model(ckpt, ref.TINY, mesh=mesh)
    q = tower.layers[0].self_attn.q_proj.kernel[...]
    assert q.sharding.spec == jax.P(None, "model")  # 42 columns split in 2
    assert not q.sharding.is_fully_replicated
    enc = q3.Qwen3OmniAudioEncoder(tower)
    assert enc.program.num_state_args > 1  # sharded state passes leaf by leaf
    features = jax.device_put(x, jax.NamedSharding(mesh, jax.P(None, "data")))
    for inputs in (features, x):
        out = enc(inputs, lens)
        np.testing.assert_allclose(out.embeddings, want.embeddings, rtol=1e-5, atol=1e-6)
