"""Hostile inputs to every public Chameleon entry point: each is refused on the host with a typed
error naming the problem, before any upload or compile, inputs untouched; or the result is right.
Bad configs, vocabularies and checkpoints live in test_chameleon_hostile_config.py.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxsync
import jaxsync.check
import jaxsync.testing
from jaxsync.harness.paths.chameleon import reference as ref
from jaxsync.models.chameleon import (
    ChameleonImageEncoder,
    ChameleonImageTower,
    ChameleonVQConfig,
    ChameleonVQVAE,
    forward,
    plan,
    plan_merge,
)


@pytest.fixture(scope="module")
def enc():
    return ref.tiny_encoder(buckets=(4, 8))


@contextlib.contextmanager
def _nothing_uploaded_or_compiled(monkeypatch):
    puts = jaxsync.testing.watch_uploads(monkeypatch)
    with jaxsync.check.count_compiles() as log:
        yield
    assert not puts, f"{len(puts)} upload(s) before the error"
    assert log.count == 0, f"compiled before the error: {log}"


def _refused(monkeypatch, exc, match, fn, *args, **kwargs):
    snapshot = [np.array(a, copy=True) for a in args if isinstance(a, np.ndarray)]
    with _nothing_uploaded_or_compiled(monkeypatch), pytest.raises(exc, match=match):
        fn(*args, **kwargs)
    for before, a in zip(snapshot, [a for a in args if isinstance(a, np.ndarray)], strict=True):
        assert a.tobytes() == before.tobytes()  # inputs bit-identical afterwards (NaN too)


def _px(n, seed=0):
    return ref.random_pixels(n, ref.tiny_vq_config(), seed=seed)


# ---------------------------------------------------------------- pixels


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (lambda x: x[:, :2], ValueError, "shape"),
        (lambda x: x[0], ValueError, "shape"),
        (lambda x: x[:0], ValueError, "no image"),
        (lambda x: x.astype(np.int32), TypeError, "float32"),
        (lambda x: x.astype(bool), TypeError, "float32"),
        (
            lambda x: np.where(np.arange(x.size).reshape(x.shape) == 5, np.nan, x),
            ValueError,
            "non-finite",
        ),
        (
            lambda x: np.where(np.arange(x.size).reshape(x.shape) == 7, np.inf, x),
            ValueError,
            "non-finite",
        ),
        (lambda x: x.astype(object), TypeError, "numeric"),
        (  # bfloat16 is not a numpy float: checked all the same
            lambda x: np.where(np.arange(x.size).reshape(x.shape) == 9, np.nan, x).astype(
                jnp.bfloat16
            ),
            ValueError,
            "non-finite",
        ),
    ],
)
def test_host_pixels_refused(enc, monkeypatch, mutate, exc, match):
    enc(_px(2))  # warm: the refusal below must compile nothing new either
    bad = mutate(_px(2))
    _refused(monkeypatch, exc, match, enc, bad)
    _refused(monkeypatch, exc, match, enc.get_image_tokens, bad)


def test_device_pixels_refused(enc, monkeypatch):
    dev = jax.device_put(_px(2))
    enc(dev)
    _refused(monkeypatch, TypeError, "float32", enc, dev.astype(jnp.int32))
    gone = jnp.copy(dev)
    gone.delete()
    _refused(monkeypatch, ValueError, "deleted", enc, gone)
    d0, d1 = jaxsync.testing.two_devices()
    elsewhere = jax.device_put(_px(2), d1)  # weights live on d0
    off = "pixel_values on devices .*, but the weights on devices"
    _refused(monkeypatch, ValueError, off, enc, elsewhere)


def test_pixels_split_off_the_batch_axis_refused(enc, monkeypatch):
    mesh = jaxsync.testing.device_mesh("data", max_devices=2, auto=True)  # 2 divides 22
    tower = ChameleonImageTower(enc.cfg, rngs=nnx.Rngs(0))
    rep = NamedSharding(mesh, P())
    _, state = nnx.split(tower)
    nnx.update(tower, jax.tree.map(lambda w: jax.device_put(w, rep), state))
    sharded = ChameleonImageEncoder(tower, buckets=(8,))
    px = _px(mesh.devices.size)
    wrong = jax.device_put(px, NamedSharding(mesh, P(None, None, "data")))
    with pytest.raises(ValueError, match="batch axis only"):
        sharded(wrong)


def test_nan_image_is_flagged_and_leaves_the_others_bit_identical(enc):
    clean = _px(3, seed=4)
    poisoned = clean.copy()
    poisoned[1, 0, 3, 5] = np.nan
    poisoned[1, 2, 0, 0] = np.inf
    want = enc(jax.device_put(clean))
    got = enc(jax.device_put(poisoned))
    # one flag per bucket row (4): the padding image is not a finite item either
    np.testing.assert_array_equal(np.asarray(got.extras["finite"]), [True, False, True, False])
    np.testing.assert_array_equal(np.asarray(want.extras["finite"]), [True, True, True, False])
    t = enc.tokens_per_image
    for name in ("embeddings", "ids"):
        a = np.asarray(want.embeddings if name == "embeddings" else want.extras["ids"])
        b = np.asarray(got.embeddings if name == "embeddings" else got.extras["ids"])
        np.testing.assert_array_equal(a[:t], b[:t])
        np.testing.assert_array_equal(a[2 * t : 3 * t], b[2 * t : 3 * t])


def test_stale_padding_rows_of_a_server_slab_change_nothing(enc):
    # A server's reused pixel slab: rows past the real images hold stale data, even NaN.
    px = _px(4, seed=2)
    slab = px.copy()
    slab[3] = np.nan
    meta = jaxsync.upload_packed(plan(3, enc.cfg, buckets=(4,)))
    graphdef, state = nnx.split(ChameleonImageTower(enc.cfg, rngs=nnx.Rngs(0)))
    run = jax.jit(lambda s, x, m: forward(nnx.merge(graphdef, s), x, m))
    clean = run(state, jnp.asarray(np.concatenate([px[:3], np.zeros_like(px[:1])])), meta)
    dirty = run(state, jnp.asarray(slab), meta)
    np.testing.assert_array_equal(np.asarray(dirty.rows), np.asarray(clean.rows))
    np.testing.assert_array_equal(np.asarray(dirty.extras["ids"]), np.asarray(clean.extras["ids"]))
    np.testing.assert_array_equal(np.asarray(dirty.finite), [True, True, True, False])


def test_forward_refuses_inputs_that_do_not_fit_the_plan_at_trace_time(enc):
    tower = ChameleonImageTower(enc.cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(tower)
    run = jax.jit(lambda s, x, m: forward(nnx.merge(graphdef, s), x, m))
    meta = jaxsync.upload_packed(plan(3, enc.cfg, buckets=(4,)))
    with pytest.raises(ValueError, match=r"shape \(3, 3, 22, 22\) but the plan pads to 4 images"):
        run(state, jnp.zeros((3, *enc.image_shape)), meta)
    with pytest.raises(ValueError, match=r"\(4, 3, 21, 21\) but the plan pads to 4 images of"):
        run(state, jnp.zeros((4, 3, 21, 21)), meta)
    other = ChameleonImageEncoder(ref.tiny_tower(num_embeddings=89), buckets=(4,))
    with pytest.raises(
        ValueError, match="img2bpe table has 89 entries but the tower's codebook 97"
    ):
        run(state, jnp.zeros((4, *enc.image_shape)), jaxsync.upload_packed(other.plan(3)))


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(0, 23), min_size=1, max_size=5),
    dtype=st.sampled_from([np.float32, np.float64, np.int64, np.uint8, np.bool_]),
)
def test_any_shape_or_dtype_is_tokenized_or_refused_cleanly(enc, shape, dtype):
    x = np.zeros(shape, dtype)
    ok = len(shape) == 4 and tuple(shape[1:]) == enc.image_shape and 1 <= shape[0] <= 8
    if ok and np.dtype(dtype).kind == "f":
        out = enc.get_image_tokens(x)
        assert out.shape == (shape[0], enc.tokens_per_image)
        return
    with pytest.raises((TypeError, ValueError)):
        enc.get_image_tokens(x)


# ---------------------------------------------------------------- logits, donation


def test_donated_logits_reuse_is_a_clear_error(enc, monkeypatch):
    v = enc.cfg.vocab_size
    x = jax.random.normal(jax.random.key(0), (3, v))
    out = enc.mask_image_logits(x, donate=True)
    assert x.is_deleted()
    _refused(monkeypatch, ValueError, "logits was deleted", enc.mask_image_logits, x)
    _refused(monkeypatch, ValueError, "deleted", enc.mask_image_logits, x, donate=True)
    w = jnp.zeros((v, 5))
    h = jnp.zeros((3, 5))
    enc.compute_logits(h, w)
    w.delete()
    _refused(monkeypatch, ValueError, "lm_head_weight was deleted", enc.compute_logits, h, w)
    assert out.shape == (3, v)


def test_bad_logits(enc, monkeypatch):
    v = enc.cfg.vocab_size
    _refused(monkeypatch, TypeError, "jax.Array", enc.mask_image_logits, np.zeros((2, v)))
    _refused(monkeypatch, TypeError, "floating", enc.mask_image_logits, jnp.zeros((2, v), int))
    _refused(monkeypatch, ValueError, "2-D", enc.mask_image_logits, jnp.zeros((v,)))
    _refused(monkeypatch, ValueError, "does not cover", enc.mask_image_logits, jnp.zeros((2, 9)))
    h, w = jnp.zeros((2, 5)), jnp.zeros((v, 5), jnp.bfloat16)
    _refused(monkeypatch, TypeError, "dtype mismatch", enc.compute_logits, h, w)
    _refused(monkeypatch, ValueError, r"\[V, 5\]", enc.compute_logits, h, jnp.zeros((v, 6)))


def test_bad_codes(enc, monkeypatch):
    m = enc.mapping
    _refused(monkeypatch, TypeError, "jax.Array", m.convert_img2bpe, np.zeros(3, np.int32))
    _refused(monkeypatch, TypeError, "integers", m.convert_img2bpe, jnp.zeros(3))
    codes = jnp.arange(5, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(m.convert_img2bpe(codes)), m.img2bpe[:5])


# ---------------------------------------------------------------- merge


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(positions=np.array([1.0, 2.0])), TypeError, "positions must hold integers"),
        (
            dict(positions=[1, 2], num_image_tokens=2.7),
            TypeError,
            "num_image_tokens must be an int",
        ),
        (dict(positions=[1, 2], num_image_tokens=np.float32(2)), TypeError, "num_image_tokens"),
        (dict(positions=[1, 2], num_image_tokens=True), TypeError, "num_image_tokens"),
        (dict(positions=np.array([True, False])), TypeError, "positions must hold integers"),
        (dict(positions=[1, 1]), ValueError, "repeat"),
        (dict(positions=[1, 99]), ValueError, "lie in"),
        (dict(positions=[-1, 2]), ValueError, "lie in"),
        (dict(positions=[1, 2, 3]), ValueError, "do not match"),
        (dict(positions=[1, 2], num_image_tokens=7), ValueError, "holds 4 rows"),
        (dict(), ValueError, "exactly one"),
        (dict(input_ids=np.ones((2, 10)) * 1.0), TypeError, "input_ids must hold integers"),
        (dict(input_ids=np.ones((3, 10), np.int64)), ValueError, "input_ids shape"),
    ],
)
def test_merge_refuses(enc, monkeypatch, kwargs, exc, match):
    text, image = jnp.zeros((2, 10, 8)), jnp.zeros((4, 8))
    if "num_image_tokens" not in kwargs and "positions" in kwargs:
        kwargs = {**kwargs, "num_image_tokens": 2}
    _refused(monkeypatch, exc, match, enc.merge_image_embeddings, text, image, **kwargs)
    with pytest.raises(exc, match=match):
        plan_merge((2, 10), 4, image_token_id=enc.mapping.image_token_id, **kwargs)


def test_merge_refuses_dead_or_device_inputs(enc, monkeypatch):
    text, image = jnp.zeros((2, 10, 8)), jnp.zeros((4, 8))
    pos = np.array([1, 2])
    _refused(
        monkeypatch,
        TypeError,
        "host data",
        enc.merge_image_embeddings,
        text,
        image,
        positions=jnp.asarray(pos),
        num_image_tokens=2,
    )
    enc.merge_image_embeddings(jnp.copy(text), image, positions=pos, num_image_tokens=2)
    gone = jnp.copy(text)
    enc.merge_image_embeddings(gone, image, positions=pos, num_image_tokens=2, donate=True)
    _refused(
        monkeypatch,
        ValueError,
        "text_embeds was deleted",
        enc.merge_image_embeddings,
        gone,
        image,
        positions=pos,
        num_image_tokens=2,
    )


@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    rows=st.integers(1, 3),
    seq=st.integers(1, 13),
    n=st.integers(0, 9),
)
def test_merge_matches_a_numpy_reference(enc, data, rows, seq, n):
    n = min(n, rows * seq)
    pos = data.draw(st.permutations(range(rows * seq)))[:n]
    text = jax.random.normal(jax.random.key(rows * 100 + seq), (rows, seq, 8))
    image = jax.random.normal(jax.random.key(n), (max(n, 1) + 2, 8))  # padded image rows
    got = enc.merge_image_embeddings(
        text, image, positions=np.array(pos, np.int64), num_image_tokens=n
    )
    want = np.asarray(text).reshape(-1, 8).copy()
    want[list(pos)] = np.asarray(image)[:n]
    np.testing.assert_array_equal(np.asarray(got), want.reshape(rows, seq, 8))


# ---------------------------------------------------------------- encoder construction


def test_encoder_refuses_a_model_of_another_config(enc):
    vq_only = ChameleonVQVAE(
        ChameleonVQConfig.from_hf_config(ref.tiny_vq_config(embed_dim=5)), rngs=nnx.Rngs(0)
    )
    with pytest.raises(TypeError, match="must be a ChameleonImageTower"):
        ChameleonImageEncoder(vq_only)
    with pytest.raises(ValueError, match="same structure"):
        enc.load_state(ref.tiny_tower(embed_dim=5))
    with pytest.raises(TypeError, match="must be a ChameleonImageTower"):
        ChameleonImageEncoder(enc.cfg)
