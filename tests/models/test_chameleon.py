"""Chameleon image paths: config strictness, bad inputs, sync-freedom, buckets, donation,
registration. Parity with transformers lives in test_chameleon_vs_hf.py."""

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsync.check
import jaxsync.models.chameleon as chameleon
import jaxsync.testing
from jaxsync.models.chameleon import (
    VQ_RULES,
    ChameleonConfig,
    ChameleonImageEncoder,
    ChameleonVQConfig,
    ChameleonVQVAE,
    ImageVocabularyMapping,
    decode_image_token_name,
)
from jaxsync.paths.chameleon import reference as ref


@pytest.fixture(scope="module")
def enc():
    cfg = ChameleonConfig.from_hf_config(ref.tiny_hf_config())
    return ChameleonImageEncoder(cfg, ChameleonVQVAE(cfg.vq, rngs=nnx.Rngs(0)), buckets=(4,))


def _px(batch, enc, seed=0):
    return ref.random_pixels(batch, enc.cfg.vq, seed=seed)


# ---------------------------------------------------------------- config


def test_config_sources_agree(tmp_path):
    d = ref.tiny_hf_config()
    (tmp_path / "config.json").write_text(json.dumps(d))
    a = ChameleonConfig.from_hf_config(d)
    assert ChameleonConfig.from_hf_config(tmp_path) == a
    assert ChameleonConfig.from_hf_config(tmp_path / "config.json") == a
    assert a.vq.tokens_per_image == 121 and a.vq.attn_resolutions == (22,)


def test_config_from_transformers_object_and_released_defaults():
    transformers = pytest.importorskip("transformers")
    hf = transformers.ChameleonConfig(vocabulary_map=ref.synth_vocab_map(8192, seed=0))
    cfg = ChameleonConfig.from_hf_config(hf)
    assert cfg.vq == ChameleonVQConfig() and cfg.vq.tokens_per_image == 1024
    assert cfg.image_token_id == hf.image_token_id


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(vq_config=dict(double_latent=True)), "double_latent"),
        (dict(vq_config=dict(attn_type="none")), "attn_type"),
        (dict(vq_config=dict(mystery=1)), "vq_config fields"),
        (dict(new_field=1), "unsupported Chameleon config fields"),
        (dict(image_token_id=3), "disagrees"),
        (dict(vq_config=dict(base_channels=48)), "divisible by 32"),
        (dict(vocab_size=10), "outside"),
    ],
)
def test_config_rejects(change, match):
    d = ref.tiny_hf_config()
    for k, v in change.items():
        d[k] = {**d[k], **v} if isinstance(v, dict) else v
    with pytest.raises(ValueError, match=match):
        ChameleonConfig.from_hf_config(d)


# ---------------------------------------------------------------- vocabulary edge cases


def test_vocabulary_bad_maps():
    assert decode_image_token_name("IMGIMGBJ1Z") == 191
    with pytest.raises(ValueError, match="no 'IMGIMG' image tokens"):
        ImageVocabularyMapping({"<image>": 1, "hello": 2})
    with pytest.raises(ValueError, match="does not decode"):
        ImageVocabularyMapping({"IMGIMGAZ": 1, "IMGIMGxyZ": 2})
    with pytest.raises(ValueError, match="outside the codebook of 2"):
        ImageVocabularyMapping({"IMGIMGAZ": 1, "IMGIMGBZ": 2, "IMGIMGCZ": 3}, num_embeddings=2)
    with pytest.raises(ValueError, match="1 VQ codes have no IMGIMG name"):
        ImageVocabularyMapping({"IMGIMGAZ": 1}, num_embeddings=2)


def test_tables_are_cached_per_placement():
    cache = jaxsync.DeviceCache()
    m = ImageVocabularyMapping(ref.synth_vocab_map(97, seed=1), cache=cache)
    d0, d1 = jaxsync.testing.two_devices()
    a = m.img2bpe_on(d0)
    assert m.img2bpe_on(d0) is a and cache.builds == 1
    b = m.img2bpe_on(d1)
    assert b.devices() == {d1} and cache.builds == 2
    np.testing.assert_array_equal(np.asarray(b), m.img2bpe)


# ---------------------------------------------------------------- bad inputs


def test_bad_pixels(enc):
    good = _px(1, enc)
    for bad, match in [
        (good[:, :2], "shape"),
        (good[:, :, :21, :21], "shape"),
        (good[0], "shape"),
        (good[:0], "no image"),
    ]:
        with pytest.raises(ValueError, match=match):
            enc.get_image_tokens(bad)
    with pytest.raises(TypeError, match="float32"):
        enc.get_image_tokens(good.astype(np.int32))


def test_bad_logits(enc):
    v = enc.mapping.max_image_id
    with pytest.raises(ValueError, match=f"does not cover the largest image token id {v}"):
        enc.mask_image_logits(jnp.zeros((2, v)))
    with pytest.raises(ValueError, match="2-D"):
        enc.mask_image_logits(jnp.zeros((enc.cfg.vocab_size,)))
    with pytest.raises(TypeError, match="jax.Array"):
        enc.mask_image_logits(np.zeros((2, enc.cfg.vocab_size), np.float32))
    with pytest.raises(ValueError, match="lm_head vocab"):
        enc.compute_logits(jnp.zeros((2, 5)), jnp.zeros((v, 5)))


def test_bad_merge(enc):
    t = enc.cfg.vq.tokens_per_image
    img = enc.mapping.image_token_id
    text, image = jnp.zeros((1, t + 3, 8)), jnp.zeros((1, t, 8))
    ids = np.array([[1] + [img] * (t - 1) + [2, 3, 4]])
    with pytest.raises(ValueError, match=f"{t - 1} placeholder position.* but {t} image token"):
        enc.merge_image_embeddings(text, image, input_ids=ids)
    with pytest.raises(TypeError, match="host data"):
        enc.merge_image_embeddings(text, image, input_ids=jnp.asarray(ids))
    with pytest.raises(ValueError, match="repeat"):
        enc.merge_image_embeddings(text, image[:, :2], positions=np.array([4, 4]))
    with pytest.raises(ValueError, match="lie in"):
        enc.merge_image_embeddings(text, image[:, :2], positions=np.array([4, t + 3]))


# ---------------------------------------------------------------- buckets and sync-freedom


def test_padded_vs_unpadded_invariance(enc):
    four = _px(4, enc, seed=7)  # the bucket size itself: no padding
    full = np.asarray(enc.get_image_tokens(four))
    for n in (1, 2, 3):
        got = np.asarray(enc.get_image_tokens(four[:n]))
        np.testing.assert_array_equal(got, full[:n])
        dev = np.asarray(enc.get_image_tokens(jax.device_put(four[:n])))
        np.testing.assert_array_equal(dev, full[:n])
    out = enc(four[:3])  # Embeddings: the bucket's rows, host lengths
    t = enc.cfg.vq.tokens_per_image
    assert out.embeddings.shape == (4 * t,) and out.lengths == (t,) * 3
    assert out.offsets == (0, t, 2 * t) and out.num_tokens == 3 * t
    np.testing.assert_array_equal(np.asarray(out.embeddings[: 3 * t]), full[:3].reshape(-1))
    np.testing.assert_array_equal(np.asarray(out.split()[2]), full[2])
    assert out.extras["finite"].shape == (3,) and bool(np.asarray(out.extras["finite"]).all())


def test_image_tokens_sync_free_device_pixels(enc):
    xs = [jax.device_put(_px(b, enc, seed=b)) for b in (3, 1, 2)]
    jaxsync.check.assert_sync_free(enc.get_image_tokens, xs[0], inputs=[(x,) for x in xs[1:]])


def test_tokenizer_program_takes_few_arguments(enc):
    # The packed state (one buffer per dtype) + pixels + packed meta + img2bpe table, where the
    # old flat-leaf program took 67 jit arguments.
    pixels = jax.device_put(_px(4, enc))
    meta = jaxsync.upload_packed(chameleon.plan_images(4, (4,)).fields)
    lowered = enc._program.lower(pixels, meta, enc.img2bpe_table())
    assert len(jax.tree.leaves(lowered.args_info)) <= 6


def test_image_tokens_sync_free_host_pixels(enc):
    # static=False: with host pixels every argument is static and the compiled-HLO scan would
    # constant-fold the whole encoder; the same program is scanned by the device-pixel test.
    xs = [_px(b, enc, seed=b) for b in (3, 1, 2)]
    jaxsync.check.assert_sync_free(
        enc.get_image_tokens, xs[0], inputs=[(x,) for x in xs[1:]], static=False
    )


@pytest.mark.parametrize("lead", [(5,), (2, 3)])
def test_mask_sync_free(enc, lead):
    keys = jax.random.split(jax.random.key(0), 3)
    xs = [jax.random.normal(k, (*lead, enc.cfg.vocab_size)) for k in keys]
    jaxsync.check.assert_sync_free(enc.mask_image_logits, xs[0], inputs=[(x,) for x in xs[1:]])


def test_mask_donated_in_place(enc):
    x = jax.random.normal(jax.random.key(1), (3, enc.cfg.vocab_size))
    want = np.asarray(enc.mask_image_logits(x))
    y = jnp.copy(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "donated buffers were not usable" would fail here
        out = enc.mask_image_logits(y, donate=True)
    assert y.is_deleted()
    np.testing.assert_array_equal(np.asarray(out), want)
    ids = enc.mapping.image_token_ids
    assert (want[:, ids] == np.finfo(np.float32).min).all()
    keep = np.setdiff1d(np.arange(want.shape[1]), ids)
    np.testing.assert_array_equal(want[:, keep], np.asarray(x)[:, keep])

    def fresh(z):  # each call donates a fresh copy, as a caller would its logits buffer
        return enc.mask_image_logits(jnp.copy(z), donate=True)

    jaxsync.check.assert_sync_free(fresh, x, inputs=[(x + 1,)])


def test_compute_logits_sync_free(enc):
    d, v = enc.cfg.hidden_size, enc.cfg.vocab_size
    w = jax.random.normal(jax.random.key(2), (v, d))
    hs = [jax.random.normal(jax.random.key(i), (2, 5, d)) for i in range(3)]
    out = enc.compute_logits(hs[0], w)
    assert (np.asarray(out)[..., enc.mapping.image_token_ids] == np.finfo(np.float32).min).all()
    jaxsync.check.assert_sync_free(enc.compute_logits, hs[0], w, inputs=[(h, w) for h in hs[1:]])


def test_merge_sync_free_and_values(enc):
    img, d, s = enc.mapping.image_token_id, 8, 19
    text = jax.random.normal(jax.random.key(3), (2, s, d))
    image = jax.random.normal(jax.random.key(4), (4, 3, d))  # bucket-padded: 3 of 4 images real

    def ids_with(starts):
        ids = np.ones((2, s), np.int64)
        for row, col in starts:
            ids[row, col : col + 3] = img
        return ids

    cases = [ids_with([(0, 1), (0, 9), (1, 4)]), ids_with([(0, 0), (1, 2), (1, 16)])]
    for ids in cases:
        got = np.asarray(enc.merge_image_embeddings(text, image, input_ids=ids, num_image_tokens=9))
        want = np.asarray(text).reshape(-1, d).copy()
        want[np.flatnonzero(ids.reshape(-1) == img)] = np.asarray(image).reshape(-1, d)[:9]
        np.testing.assert_array_equal(got, want.reshape(2, s, d))

    def merge(text, image, ids):
        return enc.merge_image_embeddings(text, image, input_ids=ids, num_image_tokens=9)

    jaxsync.check.assert_sync_free(merge, text, image, cases[0], inputs=[(text, image, cases[1])])


# ---------------------------------------------------------------- released config, registry


def test_released_checkpoint_keys_map_onto_the_module():
    """Every `model.vqmodel.*` key of the released architecture maps to a parameter of the right
    shape (meta-device torch model and `nnx.eval_shape`: nothing is allocated)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from jaxsync.models.chameleon._weights import VQ_PREFIX, VQ_SELECT

    with torch.device("meta"):
        hf = transformers.ChameleonVQVAE(transformers.ChameleonVQVAEConfig())
    ours = nnx.eval_shape(lambda: ChameleonVQVAE(ChameleonVQConfig(), rngs=nnx.Rngs(0)))
    flat = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(ours, nnx.Param))}
    seen = set()
    import re

    for key, t in hf.state_dict().items():
        full = VQ_PREFIX + key
        if not re.match(VQ_SELECT, full):
            assert key.startswith("post_quant_conv")
            continue
        rule, target = next((r, r.match(key)) for r in VQ_RULES if r.match(key))
        shape = tuple(t.shape)
        if rule.transform is not None:
            shape = shape[2:] + (shape[1], shape[0])
        assert flat[target].get_value().shape == shape, key
        seen.add(target)
    assert seen == set(flat)


def test_registered_for_verify_and_bench():
    import jaxsync.paths.chameleon  # noqa: F401
    from jaxsync import registry

    names = {s.name for s in registry._paths.values()}
    assert {
        "chameleon.image_tokens",
        "chameleon.mask_logits",
        "chameleon.merge_embeddings",
    } <= names
    assert "chameleon" in registry._benches


def test_image_token_mask_is_cached_per_vocab_size(enc):
    m, vocab = enc.mapping, enc.cfg.vocab_size
    mask = m.image_token_mask(vocab)
    assert mask.dtype == np.bool_ and mask.sum() == len(m.image_token_ids)
    assert mask[m.image_token_ids].all()
    assert m.image_token_mask_on(vocab) is m.image_token_mask_on(vocab)  # one device copy
    padded = m.image_token_mask_on(vocab + 5)  # e.g. logits of a padded lm_head
    assert padded.shape == (vocab + 5,) and not np.asarray(padded)[vocab:].any()
    with pytest.raises(ValueError, match="does not cover"):
        m.image_token_mask(m.max_image_id)


def test_mask_on_logits_sharded_over_the_vocab(enc):
    # Tensor-parallel lm_head logits: split over a (padded) vocab. The replicated column mask is
    # sliced per shard by XLA; the result keeps the logits' sharding and equals the unsharded fill.
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jaxsync.testing.device_mesh("v")
    n = mesh.devices.size
    vocab = -(-enc.cfg.vocab_size // n) * n  # padded to a multiple of the shard count
    x = jax.random.normal(jax.random.key(3), (5, vocab))
    want = np.asarray(enc.mask_image_logits(x))
    split = jax.device_put(x, NamedSharding(mesh, P(None, "v")))
    out = enc.mask_image_logits(split)
    assert out.sharding.is_equivalent_to(split.sharding, 2)
    np.testing.assert_array_equal(np.asarray(out), want)
    assert (want[:, enc.mapping.image_token_ids] == np.finfo(np.float32).min).all()


# ---------------------------------------------------------------- pure paths in a server's jit


def _server_inputs(enc):
    v, d = enc.cfg.vocab_size, 8
    k = jax.random.split(jax.random.key(7), 5)
    codes = jax.random.randint(k[3], (3, 7), 0, enc.mapping.num_codes, jnp.int32)
    text, image = jax.random.normal(k[4], (2, 11, d)), jax.random.normal(k[0], (6, d))
    positions = np.array([3, 0, 20, 14])
    plan = chameleon.plan_merge((2, 11), 6, positions=positions, num_image_tokens=4)
    return dict(
        logits=jax.random.normal(k[0], (5, v)),
        hidden=jax.random.normal(k[1], (5, d)),
        w=jax.random.normal(k[2], (v, d)),
        codes=codes,
        text=text,
        image=image,
        pos=jaxsync.async_h2d(plan.fields["positions"]),
        host_positions=positions,
    )


def _step(logits, hidden, w, codes, text, image, pos, mask, table):
    return (
        chameleon.mask_image_logits(logits, mask),
        chameleon.compute_logits(hidden, w, mask),
        chameleon.img2bpe(codes, table),
        chameleon.merge_image_tokens(text, image, pos),
    )


def test_pure_paths_inside_a_server_jit_equal_the_entry_points(enc):
    x = _server_inputs(enc)
    mask, table = enc.mask_column(enc.cfg.vocab_size), enc.img2bpe_table()
    args = (x["logits"], x["hidden"], x["w"], x["codes"], x["text"], x["image"], x["pos"])
    got = jax.jit(_step)(*args, mask, table)
    want = (
        enc.mask_image_logits(x["logits"]),
        enc.compute_logits(x["hidden"], x["w"]),
        enc.mapping.convert_img2bpe(x["codes"]),
        enc.merge_image_embeddings(
            x["text"], x["image"], positions=x["host_positions"], num_image_tokens=4
        ),
    )
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_pure_paths_add_no_jit_argument_and_no_host_callback(enc):
    x = _server_inputs(enc)
    mask, table = enc.mask_column(enc.cfg.vocab_size), enc.img2bpe_table()
    args = (x["logits"], x["hidden"], x["w"], x["codes"], x["text"], x["image"], x["pos"])
    passed = jax.jit(_step).lower(*args, mask, table)
    assert len(jax.tree.leaves(passed.args_info)) == len(args) + 2  # the server's own + tables
    closed = jax.jit(lambda *a: _step(*a, mask, table)).lower(*args)
    assert len(jax.tree.leaves(closed.args_info)) == len(args)  # tables closed over: none
    assert jaxsync.check.scan_jaxpr(_step, *args, mask, table) == []
    for lowered in (passed, closed):
        assert jaxsync.check.scan_hlo_text(lowered.as_text(), "lowered") == []
        assert jaxsync.check.scan_hlo_text(lowered.compile().as_text(), "compiled") == []

    # negative control: a host callback in the same step is found
    def leaky(*a):
        jax.debug.print("{x}", x=a[0][0, 0])
        return _step(*a)

    assert jaxsync.check.scan_jaxpr(leaky, *args, mask, table)


def test_pure_forward_drops_into_a_server_jit(enc):
    from jaxsync.models.chameleon import forward, img2bpe

    vq = ChameleonVQVAE(enc.cfg.vq, rngs=nnx.Rngs(0))  # the weights of the `enc` fixture
    graphdef, state = nnx.split(vq)
    px = _px(3, enc, seed=3)
    plan = chameleon.plan_images(3, enc.buckets)
    meta = jaxsync.upload_packed(plan.fields)
    pixels = jnp.asarray(
        np.concatenate([px, np.zeros((plan.rows - 3, *enc.image_shape), np.float32)])
    )
    table = enc.img2bpe_table()

    @jax.jit
    def step(state, pixels, meta, table):
        codes, finite = forward(nnx.merge(graphdef, state), pixels, meta)
        return img2bpe(codes, table), finite

    ids, finite = step(state, pixels, meta, table)
    want = enc(px)
    np.testing.assert_array_equal(np.asarray(ids).reshape(-1), np.asarray(want.embeddings))
    np.testing.assert_array_equal(np.asarray(finite), [True, True, True, False])
    lowered = step.lower(state, pixels, meta, table)
    assert len(jax.tree.leaves(lowered.args_info)) == len(jax.tree.leaves(state)) + 3
    halved = jax.tree.map(lambda w: w * 0.5, state)
    with jaxsync.check.no_recompile():
        other, _ = step(halved, pixels, meta, table)
    assert not np.array_equal(np.asarray(other), np.asarray(ids))  # weights are arguments


@pytest.mark.parametrize("blocks", [1, 2])
def test_entry_program_takes_the_same_few_arguments_at_any_depth(blocks):
    cfg = ChameleonConfig.from_hf_config(ref.tiny_hf_config(num_res_blocks=blocks))
    enc = ChameleonImageEncoder(cfg, ChameleonVQVAE(cfg.vq, rngs=nnx.Rngs(0)), buckets=(2,))
    pixels = jax.device_put(_px(2, enc))
    meta = jaxsync.upload_packed(chameleon.plan_images(2, (2,)).fields)
    lowered = enc._program.lower(pixels, meta, enc.img2bpe_table())
    # one packed state buffer (one dtype) + pixels + packed meta + table, whatever the depth
    assert len(jax.tree.leaves(lowered.args_info)) == 4
    assert enc._program.num_state_args == 1


def test_load_state_takes_new_weights_without_recompiling():
    cfg = ChameleonConfig.from_hf_config(ref.tiny_hf_config())
    vq = ChameleonVQVAE(cfg.vq, rngs=nnx.Rngs(0))
    enc = ChameleonImageEncoder(cfg, vq, buckets=(4,))
    px = jax.device_put(_px(3, enc, seed=1))
    before = np.asarray(enc(px).embeddings)
    _, state = nnx.split(vq)
    nnx.update(vq, jax.tree.map(lambda w: -w, state))
    np.testing.assert_array_equal(np.asarray(enc(px).embeddings), before)  # snapshot
    with jaxsync.check.no_recompile():
        enc.load_state(vq)
        after = np.asarray(enc(px).embeddings)
    fresh = ChameleonImageEncoder(cfg, vq, buckets=(4,))
    np.testing.assert_array_equal(after, np.asarray(fresh(px).embeddings))
    assert not np.array_equal(after, before)


# ---------------------------------------------------------------- processor outputs


@pytest.fixture(scope="module")
def processor():
    pytest.importorskip("PIL")
    pytest.importorskip("transformers")
    from transformers.models.chameleon.image_processing_pil_chameleon import (
        ChameleonImageProcessorPil,
    )

    return ChameleonImageProcessorPil(
        size={"shortest_edge": 22}, crop_size={"height": 22, "width": 22}
    )


def test_processor_outputs_go_straight_in(enc, processor):
    from PIL import Image

    rng = np.random.default_rng(0)
    images = [
        Image.fromarray(rng.integers(0, 255, (h, w, 3), np.uint8))
        for h, w in [(31, 40), (29, 23), (22, 22)]
    ]
    as_np = processor(images=images, return_tensors="np")
    as_pt = processor(images=images, return_tensors="pt")
    assert type(as_pt["pixel_values"]).__module__.startswith("torch")
    want = np.asarray(enc.get_image_tokens(np.asarray(as_np["pixel_values"])))
    for out in (as_np, as_pt):
        got = enc(**out)
        assert got.lengths == (enc.tokens_per_image,) * 3
        np.testing.assert_array_equal(np.asarray(got.embeddings[: want.size]), want.reshape(-1))
        np.testing.assert_array_equal(np.asarray(enc.get_image_tokens(**out)), want)
    bf16 = as_pt["pixel_values"].bfloat16()  # widened exactly on the host
    np.testing.assert_array_equal(
        np.asarray(enc.get_image_tokens(pixel_values=bf16)),
        np.asarray(enc.get_image_tokens(bf16.float().numpy())),
    )


# ---------------------------------------------------------------- sharding


def _replicated_encoder(cfg, mesh, buckets):
    vq = ChameleonVQVAE(cfg.vq, rngs=nnx.Rngs(0))
    _, state = nnx.split(vq)
    rep = jax.sharding.NamedSharding(mesh, jax.P())
    nnx.update(vq, jax.tree.map(lambda w: jax.device_put(w, rep), state))
    return ChameleonImageEncoder(cfg, vq, buckets=buckets)


def test_pixels_sharded_over_the_data_axis(enc):
    # A batch split over a mesh's data axis: the bucket pads to a multiple of the axis, the
    # tables and metadata follow the input's mesh, and the tokens equal the single-device ones.
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jaxsync.testing.device_mesh("data", max_devices=4, auto=True)
    k = mesh.devices.size
    dp = _replicated_encoder(enc.cfg, mesh, buckets=(2 * k,))
    enc = ChameleonImageEncoder(enc.cfg, ChameleonVQVAE(enc.cfg.vq, rngs=nnx.Rngs(0)), buckets=(8,))
    for n in (k, 2 * k):
        px = _px(n, enc, seed=n)
        split = jax.device_put(px, NamedSharding(mesh, P("data")))
        out = dp(split)
        assert out.embeddings.sharding.device_set == split.sharding.device_set
        np.testing.assert_array_equal(
            np.asarray(out.embeddings[: n * dp.tokens_per_image]),
            np.asarray(enc(px).embeddings[: n * dp.tokens_per_image]),
        )
        np.testing.assert_array_equal(
            np.asarray(dp.get_image_tokens(split)), np.asarray(enc.get_image_tokens(px))
        )
    with jaxsync.check.no_recompile():
        dp(jax.device_put(_px(k, enc, seed=9), NamedSharding(mesh, P("data"))))
    host = dp(_px(3, enc))  # host pixels go to the weights' mesh
    np.testing.assert_array_equal(
        np.asarray(host.embeddings[: 3 * dp.tokens_per_image]),
        np.asarray(enc(_px(3, enc)).embeddings[: 3 * dp.tokens_per_image]),
    )


def test_weights_sharded_over_a_model_axis(enc):
    import re

    from jaxsync.models.chameleon import PARTITION_RULES
    from jaxsync.weights import partition_spec

    mesh = jax.make_mesh((len(jax.devices()),), ("model",), (jax.sharding.AxisType.Auto,))
    vq = ChameleonVQVAE(enc.cfg.vq, rngs=nnx.Rngs(0))
    sharded = 0
    for path, var in nnx.to_flat_state(nnx.state(vq, nnx.Param)):
        name = ".".join(map(str, path))
        axes = next((a for r, a in PARTITION_RULES if re.search(r, name)), None)
        spec = partition_spec(axes, var.get_value().shape, mesh)
        sharded += any(s is not None for s in spec)
        var.set_value(jax.device_put(var.get_value(), jax.NamedSharding(mesh, spec)))
    assert sharded  # the rules split something at this size
    tp = ChameleonImageEncoder(enc.cfg, vq, buckets=(4,))
    px = _px(3, enc, seed=5)
    np.testing.assert_array_equal(
        np.asarray(tp.get_image_tokens(px)), np.asarray(enc.get_image_tokens(px))
    )


def test_encoder_call_sync_free(enc):
    xs = [jax.device_put(_px(b, enc, seed=b)) for b in (3, 1, 2)]
    jaxsync.check.assert_sync_free(enc, xs[0], inputs=[(x,) for x in xs[1:]])
