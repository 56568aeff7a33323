"""Gemma 3n audio entry: buckets, sync-free calls, the server form (the pure forward in a
server's jit over flat state leaves), weights updates, argument count, stacked layers, processor
outputs, non-finite isolation, sharding, GPU parity."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsync
import jaxsync.check
from jaxsync.check import no_recompile
from jaxsync.harness.paths.gemma3n import reference as R
from jaxsync.models.gemma3n import (
    ChunkedLocalAttention,
    ConformerBlock,
    Gemma3nAudioConfig,
    Gemma3nAudioEncoder,
    Gemma3nAudioModel,
    Gemma3nBuckets,
    encode,
    forward,
    load_model,
    plan,
)
from jaxsync.testing import (
    assert_layers_run,
    assert_same_math,
    rel_err,
    requires_torch,
    server_step,
)


BUCKET = 64
# The conformer as one scan (the forward) vs the layers applied one by one (`stack.at(i)`): XLA
# fuses the two programs differently, so they agree to float32 rounding, not bit for bit.
LOOP_VS_SCAN_TOL = 1e-6


@pytest.fixture(scope="module")
def cfg():
    return R.tiny_config()


@pytest.fixture(scope="module")
def model(cfg):
    return Gemma3nAudioModel(cfg, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def encoder(cfg, model):
    return Gemma3nAudioEncoder(model, frame_buckets=BUCKET)


def _batch(cfg, lengths, frames, seed=0):
    return R.mel_batch(lengths, frames, cfg.input_feat_size, seed=seed)


def _device_inputs(cfg, feats, mask):
    """Host features padded to the encoder's buckets, on the device, and the plan's meta."""
    p = plan(mask, cfg, buckets=Gemma3nBuckets(frames=BUCKET))
    x = np.zeros((p.batch, p.frame_bucket, cfg.input_feat_size), np.float32)
    x[: len(feats), : feats.shape[1]] = feats
    valid = np.zeros((p.batch, p.frame_bucket), bool)
    valid[: len(mask), : mask.shape[1]] = mask
    return jnp.asarray(x), valid, jaxsync.upload_packed(p)


def test_bucket_invariance(cfg, model, encoder):
    exact = Gemma3nAudioEncoder(model, frame_buckets=1, batch_buckets=(3,))
    for lengths, frames in R.TINY_INPUTS[1:]:
        feats, mask = _batch(cfg, lengths, frames, seed=frames)
        a, b = encoder(feats, mask), exact(feats, mask)
        assert a.embeddings.shape[0] > b.embeddings.shape[0]  # padding clip rows
        assert rel_err(R.per_clip(a), R.per_clip(b)) <= 1e-6


def test_sync_free_one_bucket(cfg, encoder):
    calls = [
        _batch(cfg, ls, s, seed=s)
        for ls, s in [([37, 20, 5], 37), ([50, 50, 49], 50), ([60, 2, 33], 60), ([44, 44, 44], 44)]
    ]
    jaxsync.check.assert_sync_free(encoder, *calls[0], inputs=calls[1:])
    encoder(*calls[0])
    with no_recompile():
        for c in calls:
            encoder(*c)


def test_plan_cached_per_mask(cfg, encoder):
    feats, mask = _batch(cfg, [30, 12], 30, seed=3)
    encoder(feats, mask)
    size = len(encoder.plans)
    encoder(feats * 2, mask)  # same mask: the cached plan and its upload are reused
    assert len(encoder.plans) == size
    encoder(feats, np.roll(mask, 1, axis=0))
    assert len(encoder.plans) == size + 1


def test_server_form_in_a_server_jit(cfg, model, encoder):
    feats, mask = _batch(cfg, [41, 7, 29], 41, seed=5)
    x, _, meta = _device_inputs(cfg, feats, mask)
    step, leaves = server_step(model, forward)  # forward over the flat state leaves
    out = step(leaves, x, meta)
    assert isinstance(out, jaxsync.Encoded) and out.extras is None
    want = encoder(feats, mask)
    assert_same_math(out.rows, want.rows)  # the entry compiles this very function
    assert_same_math(out.finite, want.finite)
    assert np.asarray(out.finite).tolist() == [True] * 4  # 3 clips and a padding clip
    # every weight is a program argument, none is a baked constant: one per state leaf
    state_args, *inputs = step.lower(leaves, x, meta).args_info[0]
    assert len(jax.tree.leaves(state_args)) == len(leaves) == 31
    assert encoder.program.num_state_args == 2  # the entry packs the same leaves
    assert len(jax.tree.leaves(inputs)) == 2  # the features and the packed meta
    halved = [w * 0.5 for w in leaves]
    with no_recompile():
        new = step(halved, x, meta)
    twin = Gemma3nAudioModel(cfg, rngs=nnx.Rngs(0))
    nnx.update(twin, jax.tree.map(lambda w: w * 0.5, nnx.state(model)))
    want_new = Gemma3nAudioEncoder(twin, frame_buckets=BUCKET)(feats, mask)
    assert_same_math(new.rows, want_new.rows)
    assert not np.allclose(new.rows, out.rows)


def test_entry_returns_embeddings_of_its_plan(cfg, model, encoder):
    """The entry's result is `Embeddings.of(forward(...), plan)`: rows, lengths, finite."""
    feats, mask = _batch(cfg, [41, 7, 29], 41, seed=5)
    x, _, meta = _device_inputs(cfg, feats, mask)
    p = plan(mask, cfg, buckets=Gemma3nBuckets(frames=BUCKET))
    want = jaxsync.Embeddings.of(encoder.program(x, meta), p)
    got = encoder(feats, mask)
    assert got.lengths == want.lengths == (cfg.soft_tokens,) * 3
    assert got.offsets == want.offsets == p.offsets == (0, 5, 10)
    assert sorted(got.extras) == sorted(want.extras) == ["finite"]
    np.testing.assert_array_equal(got.rows, want.rows)
    np.testing.assert_array_equal(got.finite, want.finite)


def test_forward_refuses_features_the_plan_does_not_fit(cfg, model):
    feats, mask = _batch(cfg, [41, 7, 29], 41, seed=5)
    x, _, meta = _device_inputs(cfg, feats, mask)  # plan: [4 clips, 64 frames]
    step, leaves = server_step(model, forward)  # forward over the flat state leaves
    step(leaves, x, meta)  # the control: the planned shape runs
    for bad in (x[:, :41], x[:3], x[..., :-1]):
        with pytest.raises(ValueError, match=r"do not fit the plan.*\[4 clips, 64 frames, 13"):
            step(leaves, bad, meta)


@pytest.mark.parametrize("fn", [forward, encode])
def test_every_conformer_layer_reaches_the_output(cfg, model, fn):
    feats, mask = _batch(cfg, [41, 7, 29], 41, seed=5)
    x, _, meta = _device_inputs(cfg, feats, mask)
    assert_layers_run(model, fn, x, meta)


def test_stack_runs_the_layers_of_its_views(cfg, model):
    """The tower's one scan equals its blocks `conformer.at(i)` applied one by one."""
    feats, mask = _batch(cfg, [41, 7, 29], 41, seed=5)
    tower = model.audio_tower
    x, padding = tower.subsample(jnp.asarray(feats), jnp.asarray(~mask))
    looped = x
    for i in range(cfg.conf_num_hidden_layers):
        looped = tower.conformer.at(i)(looped, ~padding)
    scanned = tower.conformer(x, ~padding)
    assert rel_err(scanned, looped) <= LOOP_VS_SCAN_TOL
    assert rel_err(scanned, tower.conformer.at(0)(x, ~padding)) > 1e-2  # both layers count
    with pytest.raises(IndexError):
        tower.conformer.at(cfg.conf_num_hidden_layers)


@pytest.mark.parametrize("depth", [2, 5])
def test_program_argument_count(cfg, depth):
    c = dataclasses.replace(cfg, conf_num_hidden_layers=depth)
    model = Gemma3nAudioModel(c, rngs=nnx.Rngs(1))
    enc = Gemma3nAudioEncoder(model, frame_buckets=BUCKET)
    feats, mask = _batch(c, [20, 9], 20)
    x, _, meta = _device_inputs(c, feats, mask)
    n_leaves = len(jax.tree.leaves(nnx.state(model)))
    assert n_leaves == 31  # one per weight kind, at any depth
    assert enc.program.num_state_args == 2  # packed: one flat buffer, one row buffer
    n_args = len(jax.tree.leaves(enc.program.lower(x, meta).args_info))
    assert n_args == 2 + 2  # the packed state, the features, the packed meta


def test_state_leaves_at_the_released_config():
    """At the released sizes (12 conformer blocks, no weights built) the state a server passes
    has as many leaves as the 2-block tiny tower: depth adds none."""
    released = nnx.eval_shape(lambda: Gemma3nAudioModel(Gemma3nAudioConfig(), rngs=nnx.Rngs(0)))
    assert released.audio_tower.conformer.num_layers == 12
    n = len(jax.tree.leaves(nnx.state(released)))
    print(f"gemma3n released state leaves: {n}")
    assert n == 31 <= 40
    stacked = released.audio_tower.conformer.layer.ffw_layer_start.ffw_layer_1.kernel
    assert stacked.shape == (12, 1536, 4 * 1536)


def test_load_state_takes_new_weights_without_recompiling(cfg):
    model = Gemma3nAudioModel(cfg, rngs=nnx.Rngs(2))
    enc = Gemma3nAudioEncoder(model, frame_buckets=BUCKET)
    feats, mask = _batch(cfg, [33, 21], 33, seed=9)
    before = np.asarray(enc(feats, mask).embeddings)
    _, state = nnx.split(model)
    nnx.update(model, jax.tree.map(lambda w: w * 0.5, state))
    assert np.array_equal(enc(feats, mask).embeddings, before)  # a snapshot until load_state
    with no_recompile():
        enc.load_state(model)
        after = enc(feats, mask)
    fresh = Gemma3nAudioEncoder(model, frame_buckets=BUCKET)(feats, mask)
    assert np.array_equal(after.embeddings, fresh.embeddings)  # pad embedding renewed too
    other = dataclasses.replace(cfg, conf_num_hidden_layers=3)
    with pytest.raises(ValueError, match="same structure"):
        enc.load_state(Gemma3nAudioModel(other, rngs=nnx.Rngs(0)))
    assert np.array_equal(enc(feats, mask).embeddings, after.embeddings)


def test_device_features_and_finite_flags(cfg, encoder):
    feats, mask = _batch(cfg, [50, 17, 33, 8], 50, seed=13)
    x, valid = jnp.asarray(feats), mask  # device features: used at their shape (50 frames)
    clean = encoder(x, valid)
    assert rel_err(R.per_clip(clean), R.per_clip(encoder(feats, mask))) <= 1e-6  # 50 vs 64 rows
    for bad in (np.nan, np.inf):
        poisoned = x.at[1, 3, 2].set(bad)
        out = encoder(poisoned, valid)
        assert np.asarray(out.extras["finite"]).tolist() == [True, False, True, True]
        got, want = R.per_clip(out), R.per_clip(clean)
        for i in (0, 2, 3):  # every other clip bit-identical
            assert np.array_equal(got[i], want[i])


def _stacked_block(cfg, rngs):
    return Gemma3nAudioModel(cfg, rngs=rngs).audio_tower.conformer.at(1)


@pytest.mark.parametrize("module", [ChunkedLocalAttention, ConformerBlock, _stacked_block])
def test_masked_frames_do_not_leak_non_finite_values(cfg, module):
    """A NaN / inf at a masked frame never reaches a real frame (no 0 * NaN)."""
    layer = module(cfg, rngs=nnx.Rngs(4))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 23, cfg.hidden_size)).astype(np.float32)
    valid = np.arange(23)[None, :] < np.array([[15], [23]])
    x = np.where(valid[:, :, None], x, 0.0).astype(np.float32)
    clean = np.asarray(layer(jnp.asarray(x), jnp.asarray(valid)))
    for bad in (np.nan, np.inf):
        dirty = np.where(valid[:, :, None], x, bad).astype(np.float32)
        got = np.asarray(layer(jnp.asarray(dirty), jnp.asarray(valid)))
        assert np.array_equal(got[valid], clean[valid])


def test_default_buckets_fit_the_released_processor():
    """The released extractor's batches ([B, 2997, 128] for 30 s; 3000 frames at most) plan
    with the default buckets, all 188 soft tokens per clip; 2, 3 and 4 clips share a program."""
    cfg = Gemma3nAudioConfig()
    for clips, frames in ((1, 2997), (2, 3000), (3, 3008)):
        p = plan(np.ones((clips, frames), bool), cfg)
        assert (p.frame_bucket, p.truncation) == (3008, None)
        assert p.lengths == (188,) * clips
    shapes = {
        (p.batch, p.frame_bucket) for p in (plan(np.ones((n, 497), bool), cfg) for n in (2, 3, 4))
    }
    assert shapes == {(4, 512)}
    assert plan(np.ones((1, 97), bool), cfg).frame_bucket == 128
    with pytest.raises(ValueError, match="soft_tokens"):
        plan(np.ones((1, 3009), bool), cfg)  # 189 tower positions


@requires_torch  # the registered case builds its checkpoint from the transformers reference
def test_verify_registration():
    from jaxsync.harness.registry import paths

    (spec,) = paths(["gemma3n.audio_embed"])
    case = spec.build(None)
    jaxsync.check.assert_sync_free(case.fn, *case.inputs[0], inputs=case.inputs[1:])
    parity = case.parity()
    assert parity.ok, parity


# ------------------------------------------------------------------ processor outputs


@requires_torch
def test_feature_extractor_outputs_go_straight_in(tmp_path):
    from transformers.models.gemma3n.feature_extraction_gemma3n import (
        Gemma3nAudioFeatureExtractor,
    )

    ref = R.build_reference(tmp_path)
    cfg = ref.cfg
    extractor = Gemma3nAudioFeatureExtractor(
        feature_size=cfg.input_feat_size,
        sampling_rate=16_000,
        padding_value=0.0,
        return_attention_mask=True,
        frame_length_ms=32.0,
        hop_length_ms=10.0,
        min_frequency=125.0,
        max_frequency=7600.0,
        preemphasis=0.97,
        preemphasis_htk_flavor=True,
        fft_overdrive=True,
        dither=0.0,
        input_scale_factor=1.0,
        mel_floor=1e-5,
        per_bin_mean=None,
        per_bin_stddev=None,
    )
    enc = Gemma3nAudioEncoder(load_model(ref.checkpoint, ref.cfg), frame_buckets=BUCKET)
    rng = np.random.default_rng(7)
    audio = [rng.standard_normal(n).astype(np.float32) * 0.1 for n in (4_003, 9_601, 1_999)]
    got = {}
    for kind in ("np", "pt"):
        out = extractor(audio, sampling_rate=16_000, return_tensors=kind, padding="longest")
        emb = enc(
            input_features=out["input_features"], input_features_mask=out["input_features_mask"]
        )
        got[kind] = R.per_clip(emb)
        feats = np.asarray(out["input_features"], np.float32)
        mask = np.asarray(out["input_features_mask"], bool)
        assert rel_err(got[kind], R.reference_embed(ref, feats, mask)) <= 1e-5
    assert np.array_equal(got["np"], got["pt"])


# ------------------------------------------------------------------ sharding


def _mesh(axis):
    return jax.make_mesh((len(jax.devices()),), (axis,), (jax.sharding.AxisType.Auto,))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("torch")
    return R.build_reference(tmp_path_factory.mktemp("gemma3n_shard"))


def test_data_parallel_inputs_with_replicated_weights(checkpoint):
    ref, n_dev = checkpoint, len(jax.devices())
    mesh = _mesh("data")
    single = Gemma3nAudioEncoder(load_model(ref.checkpoint, ref.cfg), frame_buckets=BUCKET)
    model = load_model(ref.checkpoint, ref.cfg, mesh=mesh, partition_rules=())
    data = jax.NamedSharding(mesh, jax.P("data"))
    enc = Gemma3nAudioEncoder(model, frame_buckets=BUCKET, batch_buckets=(n_dev,), placement=data)
    lengths = [60 - 7 * i for i in range(n_dev - 1)]
    feats, mask = _batch(ref.cfg, lengths, 60, seed=21)
    want = R.per_clip(single(feats, mask))
    host = enc(feats, mask)
    assert rel_err(R.per_clip(host), want) <= 1e-6
    x = jax.device_put(np.pad(feats, ((0, n_dev - len(feats)), (0, 0), (0, 0))), data)
    valid = np.pad(mask, ((0, n_dev - len(mask)), (0, 0)))
    valid[len(lengths) :, 0] = True  # padding clips need one real frame as input
    out = enc(x, valid)
    assert rel_err(R.per_clip(out)[: len(lengths)], want) <= 1e-6
    with pytest.raises(ValueError, match="same devices"):
        enc(jax.device_put(x, jax.devices()[1]), valid)
    with pytest.raises(ValueError, match="same devices"):
        single(jax.device_put(np.asarray(x), jax.devices()[1]), valid)


def test_weights_sharded_over_a_model_axis(checkpoint):
    ref = checkpoint
    mesh = _mesh("model")
    single = Gemma3nAudioEncoder(load_model(ref.checkpoint, ref.cfg), frame_buckets=BUCKET)
    model = load_model(ref.checkpoint, ref.cfg, mesh=mesh)
    # the stacked [L, 22, 88] kernel: the layer axis whole, 4 * 22 = 88 columns over 8 devices
    kernel = model.audio_tower.conformer.layer.ffw_layer_start.ffw_layer_1.kernel[...]
    assert kernel.sharding.spec == jax.P(None, None, "model")
    assert not kernel.sharding.is_fully_replicated
    enc = Gemma3nAudioEncoder(model, frame_buckets=BUCKET)
    feats, mask = _batch(ref.cfg, [57, 40, 13], 57, seed=57)
    assert rel_err(R.per_clip(enc(feats, mask)), R.per_clip(single(feats, mask))) <= 1e-5


# ------------------------------------------------------------------ accelerator


@requires_torch
@pytest.mark.gpu
def test_released_config_fp32_parity(tmp_path):
    import torch

    if jax.default_backend() == "cpu" or not torch.cuda.is_available():
        pytest.skip("needs a GPU for torch and jax")
    torch.backends.cudnn.allow_tf32 = False  # fp32 reference: no TF32 convolutions
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = R.build_reference(tmp_path, size="released")
    emb = Gemma3nAudioEncoder(load_model(ref.checkpoint, ref.cfg))
    ref.tower.cuda(), ref.embedder.cuda()
    worst = 0.0
    for lengths, frames in (([3000], 3000), ([500, 1700], 1700)):  # 30 s; 5 s + 17 s
        feats, mask = R.mel_batch(lengths, frames, ref.cfg.input_feat_size, seed=frames)
        got = R.per_clip(emb(feats, mask))
        worst = max(worst, rel_err(got, R.reference_embed(ref, feats, mask)))
    print(f"released fp32 max rel err {worst:.2e}")
    assert worst <= 1e-5
