"""Qwen3-Omni audio encoder in a server: the state's leaves as the jit arguments at any depth,
the server form (`forward` in a server's own jit) against the entry, the stacked layers,
`load_state`, the forward's shape checks, processor outputs and sharding. The planner, config and
plan caching live in test_qwen3_omni.py."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

import jaxsync
import jaxsync.testing
from jaxsync.check import no_recompile
from jaxsync.harness.paths.qwen3_omni import reference as ref
from jaxsync.models import qwen3_omni as q3


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


STATE_LEAVES = 29
"""The tower's state leaves at any size: conv stem 7, the stacked layers 16 (one per weight
kind), head 6."""


def _server_step(tower):
    """The server form in a server's own jit: the state as flat leaves, merged inside."""
    graphdef, state = nnx.split(tower)
    leaves, treedef = jax.tree_util.tree_flatten(state)

    @jax.jit
    def step(leaves, x, meta):  # weights are arguments
        return q3.forward(
            nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves)), x, meta
        )

    return step, leaves


@pytest.mark.parametrize("layers", [1, 7])
def test_jit_arguments_are_the_state_leaves_at_any_depth(layers):
    tower = _deep(layers)
    enc = q3.Qwen3OmniAudioEncoder(tower)
    x, lens = _device_inputs([120, 0, 31])
    meta = jaxsync.upload_packed(enc.plan(x.shape, lens))
    leaves = jax.tree.leaves(nnx.state(tower))
    assert len(leaves) == STATE_LEAVES  # one per weight kind, at 1 layer and at 7
    assert {w.shape[0] for w in jax.tree.leaves(nnx.state(tower.layers))} == {layers}
    # the entry packs the same state (one flat buffer, one row buffer for the stack); a
    # server's step takes the leaves: + the features + the packed meta in both
    assert enc.program.packed and enc.program.num_state_args == 2
    assert jaxsync.testing.main_arg_count(enc.program.lower(x, meta)) == 2 + 2
    step, flat = _server_step(tower)
    assert jaxsync.testing.main_arg_count(step.lower(flat, x, meta)) == STATE_LEAVES + 2


def test_released_tower_state_leaves():
    # the released sizes, abstractly (no weights): 32 layers stacked in one leaf per kind
    tower = nnx.eval_shape(lambda: q3.Qwen3OmniAudioTower(ref.RELEASED, rngs=nnx.Rngs(0)))
    leaves = jax.tree.leaves(nnx.state(tower))
    print(f"released qwen3_omni audio tower: {len(leaves)} state leaves")
    assert len(leaves) == STATE_LEAVES <= 40
    assert tower.layers.num_layers == ref.RELEASED.encoder_layers == 32
    assert tower.layers.layer.fc1.kernel.shape == (32, 1280, 5120)


def test_server_form_equals_the_entry_bitwise_with_no_recompiles():
    tower = q3.Qwen3OmniAudioTower(ref.TINY, rngs=nnx.Rngs(0))
    enc = q3.Qwen3OmniAudioEncoder(tower)
    step, leaves = _server_step(tower)

    from jaxsync.harness.paths.qwen3_omni.verify import ONE_BUCKET_MIXES

    inputs = [_device_inputs(m, seed=i) for i, m in enumerate(ONE_BUCKET_MIXES)]
    plans = [q3.plan(lens, ref.TINY) for _, lens in inputs]
    metas = [jaxsync.upload_packed(p) for p in plans]
    for (x, lens), meta in zip(inputs[:1], metas, strict=False):  # warm-up: one compile each
        step(leaves, x, meta), enc(x, lens)
    with no_recompile():
        for (x, lens), meta, plan in zip(inputs, metas, plans, strict=True):
            encoded = step(leaves, x, meta)
            out = enc(x, lens)
            assert isinstance(encoded, jaxsync.Encoded) and encoded.extras is None
            # the same function and jit options: the same program, the same bits on CPU
            jaxsync.testing.assert_same_math(encoded.rows, out.rows)
            np.testing.assert_array_equal(encoded.finite, out.finite)
            assert out.lengths == plan.lengths and encoded.finite.shape == (plan.item_bucket,)
            want = jaxsync.Embeddings.of(encoded, plan)
            assert (want.lengths, want.offsets) == (out.lengths, out.offsets)
    # new weights as new leaves reach the server's step without a recompile
    halved = [w * 0.5 for w in leaves]
    x, lens = inputs[0]
    with no_recompile():
        new_rows = step(halved, x, metas[0]).rows
    assert not np.allclose(new_rows, enc(x, lens).rows)  # the entry keeps its weights
    nnx.update(tower, jax.tree.map(lambda w: w * 0.5, nnx.state(tower)))
    with no_recompile():
        enc.load_state(tower)
        np.testing.assert_array_equal(enc(x, lens).rows, new_rows)


def test_layers_reach_the_output():
    tower = q3.Qwen3OmniAudioTower(ref.TINY, rngs=nnx.Rngs(0))
    lens = [120, 0, 250]
    x, _ = _device_inputs(lens)
    jaxsync.testing.assert_layers_run(
        tower, q3.forward, x, jaxsync.upload_packed(q3.plan(lens, ref.TINY))
    )


def test_each_layer_view_is_that_layer():
    tower = q3.Qwen3OmniAudioTower(ref.TINY, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (3, ref.TINY.window_tokens, ref.TINY.d_model))
    lens = jax.numpy.array([26, 9, 17], jax.numpy.int32)
    h = x
    for i in range(ref.TINY.encoder_layers):
        layer = tower.layers.at(i)
        np.testing.assert_array_equal(layer.fc1.kernel[...], tower.layers.layer.fc1.kernel[...][i])
        h = layer(h, lens)
    # the stack's scan is the layers one after the other (a scan and eager per-layer calls
    # round differently: the fp32 standard)
    jaxsync.testing.assert_close(tower.layers(x, lens), h, rtol=1e-5)


def test_forward_refuses_inputs_that_do_not_fit_the_plan():
    tower = q3.Qwen3OmniAudioTower(ref.TINY, rngs=nnx.Rngs(0))
    lens = [120, 31]
    meta = jaxsync.upload_packed(q3.plan(lens, ref.TINY))  # planned for 160 frames
    step, leaves = _server_step(tower)

    def run(x, meta):
        return step(leaves, x, meta)

    with pytest.raises(ValueError, match="features have 151 frames but the plan was made for 160"):
        run(jax.numpy.zeros((ref.TINY.num_mel_bins, 151)), meta)
    with pytest.raises(ValueError, match=r"shape \(23, 160\).*22 mel bins"):
        run(jax.numpy.zeros((23, 160)), meta)
    wide = dataclasses.replace(ref.TINY, n_window_infer=400)  # four chunks per window
    other = jaxsync.upload_packed(q3.plan(lens, wide))
    with pytest.raises(ValueError, match="a plan made for another config"):
        run(jax.numpy.zeros((ref.TINY.num_mel_bins, 160)), other)
    run(jax.numpy.zeros((ref.TINY.num_mel_bins, 160)), meta)  # the control: it fits


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
    with pytest.raises(ValueError, match="same structure"):
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
    assert enc.program.num_state_args == 2  # a replicated state: packed
    frames = jax.device_put(x, jax.NamedSharding(mesh, jax.P(None, "data")))
    for features in (frames, x):  # device features split over the mesh; host features
        out = enc(features, lens)
        assert out.embeddings.sharding.device_set == set(mesh.devices.flat)
        np.testing.assert_allclose(out.embeddings, want.embeddings, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(out.finite, want.finite)
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
    q = tower.layers.layer.self_attn.q_proj.kernel[...]
    assert q.sharding.spec == jax.P(None, None, "model")  # every layer's 42 columns split in 2
    assert not q.sharding.is_fully_replicated
    out_proj = tower.layers.layer.self_attn.out_proj.kernel[...]
    assert out_proj.sharding.spec == jax.P(None, "model", None)
    enc = q3.Qwen3OmniAudioEncoder(tower)
    assert enc.program.num_state_args == STATE_LEAVES  # sharded leaves, still one per kind
    features = jax.device_put(x, jax.NamedSharding(mesh, jax.P(None, "data")))
    for inputs in (features, x):
        out = enc(inputs, lens)
        np.testing.assert_allclose(out.embeddings, want.embeddings, rtol=1e-5, atol=1e-6)
