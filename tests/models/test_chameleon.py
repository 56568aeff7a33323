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
from jaxsync.harness.paths.chameleon import reference as ref
from jaxsync.models.chameleon import (
    ChameleonConfig,
    ChameleonImageTower,
    ChameleonTextPaths,
    ChameleonVQConfig,
    ImageVocabularyMapping,
    decode_image_token_name,
    weight_rules,
)


@pytest.fixture(scope="module")
def enc():
    return ref.tiny_encoder(buckets=(4,))


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
        # conv_in's width feeds the first GroupNorm even when every level is wider
        (dict(vq_config=dict(base_channels=48, channel_multiplier=[2, 4])), "base 48"),
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
    gap = ImageVocabularyMapping({"IMGIMGAZ": 1}, num_embeddings=2)
    with pytest.raises(ValueError, match="1 VQ codes have no IMGIMG name"):
        gap.check_code_table()
    with pytest.raises(ValueError, match="1 VQ codes have no IMGIMG name"):
        gap.convert_img2bpe(jnp.zeros((3,), jnp.int32))


def test_names_beyond_the_codebook_are_image_tokens_no_code_produces():
    """transformers' own tiny Chameleon configs name codes 10.. with a 5-code book: the names
    are image tokens (masked, merged), the code table covers the codebook as upstream's does
    for every code the VQ can produce."""
    vocab = {"<image>": 3, "IMGIMGBAZ": 9, "IMGIMGBBZ": 8, "IMGIMGAZ": 7, "IMGIMGBZ": 6}
    m = ImageVocabularyMapping(vocab, num_embeddings=2)
    assert m.image_token_ids.tolist() == [6, 7, 8, 9]
    assert m.img2bpe.tolist() == [7, 6]
    assert m.image_token_mask(10).nonzero()[0].tolist() == [6, 7, 8, 9]
    missing = ImageVocabularyMapping({"IMGIMGBAZ": 4, "IMGIMGBBZ": 5}, num_embeddings=3)
    assert missing.missing_codes.tolist() == [0, 1, 2]
    assert missing.image_token_mask(6).nonzero()[0].tolist() == [4, 5]  # the mask works
    with pytest.raises(ValueError, match="3 VQ codes have no IMGIMG name"):
        missing.check_code_table()  # the code table does not
    explicit = ImageVocabularyMapping({"IMGIMGBAZ": 4}, num_embeddings=3, missing_code_id=0)
    assert explicit.img2bpe.tolist() == [0, 0, 0]


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
    t, d = enc.cfg.vq.tokens_per_image, enc.cfg.hidden_size
    assert out.embeddings.shape == (4 * t, d) and out.lengths == (t,) * 3
    assert out.offsets == (0, t, 2 * t) and out.num_tokens == 3 * t
    ids = out.extras["ids"]
    assert ids.shape == (4 * t,) and ids.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(ids[: 3 * t]), full[:3].reshape(-1))
    embed = np.asarray(ref.tiny_tower().embed_tokens.embedding[...])  # the fixture's weights
    np.testing.assert_array_equal(np.asarray(out.split()[2]), embed[full[2]])
    np.testing.assert_array_equal(np.asarray(out.embeddings[: 3 * t]), embed[full[:3].reshape(-1)])
    # finite: one flag per bucket row, False for the padding image
    np.testing.assert_array_equal(np.asarray(out.extras["finite"]), [True, True, True, False])


def test_image_tokens_sync_free_device_pixels(enc):
    xs = [jax.device_put(_px(b, enc, seed=b)) for b in (3, 1, 2)]
    jaxsync.check.assert_sync_free(enc.get_image_tokens, xs[0], inputs=[(x,) for x in xs[1:]])


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
    from jaxsync._stack import stacks
    from jaxsync.models.chameleon._weights import PREFIX, SELECT
    from jaxsync.weights._plan import _row_slot, _stacked_slot

    cfg = ChameleonConfig.from_hf_config(ref.released_hf_config())
    with torch.device("meta"):
        hf = transformers.ChameleonVQVAE(transformers.ChameleonVQVAEConfig())
        embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    ours = nnx.eval_shape(lambda: ChameleonImageTower(cfg, rngs=nnx.Rngs(0)))
    stacked = stacks(ours)
    flat = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(ours, nnx.Param))}
    keys = {f"model.vqmodel.{k}": t for k, t in hf.state_dict().items()}
    keys["model.embed_tokens.weight"] = embed.weight
    seen = set()
    import itertools
    import re

    for key, t in keys.items():
        if not re.match(SELECT, key):
            assert key.startswith("model.vqmodel.post_quant_conv")
            continue
        short = key[len(PREFIX) :]
        rule, mapped = next((r, r.match(short)) for r in weight_rules(cfg) if r.match(short))
        target, layer = _stacked_slot(mapped, stacked)
        target, row = _row_slot(target, flat)
        index = tuple(i for i in (layer, row) if i is not None)
        shape = tuple(t.shape)
        if rule.transform is not None:
            shape = shape[2:] + (shape[1], shape[0])
        assert flat[target].get_value().shape[len(index) :] == shape, key
        assert (target, index) not in seen, key
        seen.add((target, index))

    # every parameter, every layer of a stacked one and every row of a block's vectors is
    # filled exactly once
    def lead(path: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        rows = path.rsplit(".", 1)[-1] in ("vectors", "vectors_in")
        return shape[: (".layer." in path) + rows]

    assert seen == {
        (t, i)
        for t, v in flat.items()
        for i in itertools.product(*map(range, lead(t, v.get_value().shape)))
    }
    assert len(jax.tree.leaves(nnx.state(ours))) == 38  # whatever num_res_blocks: see serving


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_block_group_norm_is_nnx_group_norm_bit_for_bit(dtype):
    """The blocks' norms read their weights from rows (`group_norm`): the very operations of
    the `nnx.GroupNorm` the encoder's `norm_out` is, so the grouping changes no number."""
    from jaxsync.models.chameleon._vq_encoder import _norm, group_norm

    rng = np.random.default_rng(0)
    norm = _norm(64, dtype, dtype, nnx.Rngs(0))
    norm.scale[...] = jnp.asarray(rng.standard_normal(64), dtype)
    norm.bias[...] = jnp.asarray(rng.standard_normal(64), dtype)
    x = jnp.asarray(rng.standard_normal((2, 5, 7, 64)) * 3 + 1, dtype)
    want = jax.jit(lambda x: norm(x))(x)
    got = jax.jit(lambda x: group_norm(x, norm.scale[...], norm.bias[...], dtype))(x)
    assert got.dtype == want.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_registered_for_verify_and_bench():
    import jaxsync.harness.paths.chameleon  # noqa: F401
    from jaxsync.harness import registry

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


def test_text_side_paths_work_with_a_gapped_code_table_the_tokenizer_refuses():
    """A vocabulary shaped like transformers' own tiny Chameleon test config (names for codes
    10.. only): the logit mask and merge work; building the tokenizer is refused on the host."""
    vocab = {"<image>": 1, "IMGIMGBAZ": 3, "IMGIMGBBZ": 4, "IMGIMGBCZ": 5}
    cfg = ChameleonConfig.from_hf_config(ref.tiny_hf_config(vocab))
    text = ChameleonTextPaths(cfg)  # the config alone: no tower
    logits = text.mask_image_logits(jnp.zeros((2, cfg.vocab_size)))
    masked = np.flatnonzero(np.asarray(logits[0]) == np.finfo(np.float32).min)
    assert masked.tolist() == [3, 4, 5]
    assert np.asarray(text.mask_column(cfg.vocab_size)).nonzero()[0].tolist() == [3, 4, 5]
    with pytest.raises(ValueError, match="VQ codes have no IMGIMG name"):
        text.img2bpe_table()
    with pytest.raises(ValueError, match="VQ codes have no IMGIMG name"):
        chameleon.plan(1, cfg)
    tower = ChameleonImageTower(cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="VQ codes have no IMGIMG name"):
        chameleon.ChameleonImageEncoder(tower)
    enc = chameleon.ChameleonImageEncoder(tower, missing_code_id=0)  # upstream's choice, explicit
    want = [0] * cfg.vq.num_embeddings
    want[10:13] = [3, 4, 5]  # the named codes; every other code takes the chosen id
    assert np.asarray(enc.plan(1).meta.img2bpe).tolist() == want
