"""Chameleon in a server: the pure paths inside a server's jit, processor outputs, sharded
pixels and weights. Entry-point behaviour lives in test_chameleon.py."""

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
    ChameleonImageEncoder,
    ChameleonImageTower,
)


@pytest.fixture(scope="module")
def enc():
    return ref.tiny_encoder(buckets=(4,))


def _px(batch, enc, seed=0):
    return ref.random_pixels(batch, enc.cfg.vq, seed=seed)


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
        pos=jaxsync.async_h2d(plan.meta.positions),
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


def _server_step(tower):
    """A server's jit over the tower's flat state leaves, the module merged inside."""
    graphdef, state = nnx.split(tower)
    leaves, treedef = jax.tree.flatten(state)

    @jax.jit
    def step(leaves, pixels, meta):
        return chameleon.forward(
            nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves)), pixels, meta
        )

    return step, leaves


def _padded(px, rows):
    return jnp.asarray(np.concatenate([px, np.zeros((rows - len(px), *px.shape[1:]), px.dtype)]))


def test_server_form_equals_the_entry_bit_for_bit_and_takes_new_weights_without_recompiling(enc):
    tower = ref.tiny_tower()  # the weights of the `enc` fixture
    step, leaves = _server_step(tower)
    px = _px(3, enc, seed=3)
    plan = chameleon.plan(3, tower.cfg, buckets=enc.buckets)
    meta = jaxsync.upload_packed(plan)
    out = step(leaves, _padded(px, plan.rows), meta)
    assert isinstance(out, jaxsync.Encoded)
    want = enc(px)
    got = jaxsync.Embeddings.of(out, plan)
    assert got.lengths == want.lengths and got.offsets == want.offsets
    np.testing.assert_array_equal(np.asarray(got.rows), np.asarray(want.rows))
    for name in ("ids", "finite"):
        np.testing.assert_array_equal(np.asarray(got.extras[name]), np.asarray(want.extras[name]))
    np.testing.assert_array_equal(np.asarray(out.finite), [True, True, True, False])
    # the state's leaves are the jit arguments, plus the pixels and the one packed meta
    lowered = step.lower(leaves, _padded(px, plan.rows), meta)
    assert len(jax.tree.leaves(lowered.args_info)) == len(leaves) + 2
    halved = [w * 0.5 if jnp.issubdtype(w.dtype, jnp.floating) else w for w in leaves]
    with jaxsync.check.no_recompile():
        other = step(halved, _padded(px, plan.rows), meta)
    assert not np.array_equal(np.asarray(other.rows), np.asarray(out.rows))  # weights are args


def test_plans_of_2_and_3_images_share_one_program():
    cfg = ChameleonConfig.from_hf_config(ref.tiny_hf_config())
    two, three = chameleon.plan(2, cfg), chameleon.plan(3, cfg)
    assert two.rows == three.rows == 4 and three.lengths == (cfg.vq.tokens_per_image,) * 3
    step, leaves = _server_step(ref.tiny_tower())
    px = _px(3, ChameleonImageEncoder(ref.tiny_tower()), seed=1)
    step(leaves, _padded(px[:2], 4), jaxsync.upload_packed(two))
    with jaxsync.check.no_recompile():
        step(leaves, _padded(px, 4), jaxsync.upload_packed(three))


@pytest.mark.parametrize("blocks", [1, 3])
def test_state_leaves_are_the_jit_arguments_and_do_not_grow_with_depth(blocks):
    tower = ref.tiny_tower(num_res_blocks=blocks)
    px = _px(2, ChameleonImageEncoder(tower))
    meta = jaxsync.upload_packed(chameleon.plan(2, tower.cfg, buckets=(2,)))
    step, leaves = _server_step(tower)
    lowered = step.lower(leaves, jnp.asarray(px), meta)
    assert len(leaves) == len(jax.tree.leaves(nnx.state(tower))) == 33  # at 1 and 3 blocks
    assert len(jax.tree.leaves(lowered.args_info)) == len(leaves) + 2  # + pixels, packed meta
    # The entry: the same forward over the state packed one buffer per dtype and per stack
    # (here fp32: the flat leaves and 6 stacks), at any depth.
    enc = ChameleonImageEncoder(tower, buckets=(2,))
    lowered = enc.program.lower(jax.device_put(px), meta)
    assert enc.program.num_state_args == 1 + 6
    assert len(jax.tree.leaves(lowered.args_info)) == 1 + 6 + 2


@pytest.mark.parametrize("blocks", [1, 2, 4])
def test_released_tower_state_leaves(blocks):
    """The released tower (ch_mult (1, 1, 2, 2, 4), base 128, 512 px; built abstractly): 38
    leaves (at most 40, the server form's jit-argument budget per tower), one per weight kind
    and width, however many residual blocks a level holds: 3 same-width residual stacks (2
    kernels and their 6 norm / bias rows: 3 each), 2 widening ones (3 kernels and 2 row groups:
    5 each), the mid attention (4 kernels and 6 rows: 5), 2 downsample stacks (2), conv_in,
    norm_out, conv_out, quant_conv (2 each), the codebook and the text embedding."""
    hf = ref.released_hf_config()
    hf["vq_config"] = {"num_res_blocks": blocks}
    cfg = ChameleonConfig.from_hf_config(hf)
    tower = nnx.eval_shape(lambda: chameleon.ChameleonImageTower(cfg, rngs=nnx.Rngs(0)))
    leaves = jax.tree.leaves(nnx.state(tower))
    assert len(leaves) == 3 * 3 + 2 * 5 + 5 + 2 * 2 + 4 * 2 + 2 == 38 <= 40
    res = tower.vqmodel.encoder.res
    assert res["w128"].layer.vectors.shape == (2 * blocks, 6, 128)  # levels 0 and 1
    assert res["w128"].layer.conv1.kernel.shape == (2 * blocks, 3, 3, 128, 128)
    assert res["w256_512"].layer.vectors_in.shape == (1, 2, 256)
    assert res["w256_512"].layer.vectors.shape == (1, 5, 512)


def test_every_layer_stack_reaches_the_rows(enc):
    tower = ref.tiny_tower()
    px = _padded(_px(3, enc, seed=2), 4)
    meta = jaxsync.upload_packed(chameleon.plan(3, tower.cfg, buckets=(4,)))
    jaxsync.testing.assert_layers_run(tower, chameleon.forward, px, meta)
    jaxsync.testing.assert_layers_run(tower, chameleon.forward_encoder_only, px, meta)


def test_encoders_of_one_tower_structure_share_their_program():
    # An equal config of another object and other weights: the compiled program is reused (a
    # server may rebuild its encoder from (graphdef, state) per call).
    first = ChameleonImageEncoder(ref.tiny_tower(seed=0), buckets=(4,))
    cfg = ChameleonConfig.from_hf_config(ref.tiny_hf_config())
    assert cfg == first.cfg and cfg is not first.cfg
    second = ChameleonImageEncoder(ChameleonImageTower(cfg, rngs=nnx.Rngs(1)), buckets=(4,))
    px = jax.device_put(_px(3, first, seed=2))
    rows = np.asarray(first(px).rows)
    with jaxsync.check.no_recompile():
        other = np.asarray(second(px).rows)
    assert not np.array_equal(rows, other)  # its own weights


def test_load_state_takes_new_weights_without_recompiling():
    tower = ref.tiny_tower()
    enc = ChameleonImageEncoder(tower, buckets=(4,))
    px = jax.device_put(_px(3, enc, seed=1))
    before = np.asarray(enc(px).embeddings)
    _, state = nnx.split(tower)
    nnx.update(tower, jax.tree.map(lambda w: -w, state))
    np.testing.assert_array_equal(np.asarray(enc(px).embeddings), before)  # snapshot
    with jaxsync.check.no_recompile():
        enc.load_state(tower)
        after = np.asarray(enc(px).embeddings)
    fresh = ChameleonImageEncoder(tower, buckets=(4,))
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
        np.testing.assert_array_equal(np.asarray(got.extras["ids"][: want.size]), want.reshape(-1))
        np.testing.assert_array_equal(np.asarray(enc.get_image_tokens(**out)), want)
    bf16 = as_pt["pixel_values"].bfloat16()  # widened exactly on the host
    np.testing.assert_array_equal(
        np.asarray(enc.get_image_tokens(pixel_values=bf16)),
        np.asarray(enc.get_image_tokens(bf16.float().numpy())),
    )


# ---------------------------------------------------------------- sharding


def _replicated_encoder(cfg, mesh, buckets):
    tower = ChameleonImageTower(cfg, rngs=nnx.Rngs(0))
    _, state = nnx.split(tower)
    rep = jax.sharding.NamedSharding(mesh, jax.P())
    nnx.update(tower, jax.tree.map(lambda w: jax.device_put(w, rep), state))
    return ChameleonImageEncoder(tower, buckets=buckets)


def test_pixels_sharded_over_the_data_axis(enc):
    # A batch split over a mesh's data axis: the bucket pads to a multiple of the axis, the
    # tables and metadata follow the input's mesh, and the tokens equal the single-device ones.
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jaxsync.testing.device_mesh("data", max_devices=4, auto=True)
    k = mesh.devices.size
    dp = _replicated_encoder(enc.cfg, mesh, buckets=(2 * k,))
    enc = ChameleonImageEncoder(ChameleonImageTower(enc.cfg, rngs=nnx.Rngs(0)), buckets=(8,))
    for n in (k, 2 * k):
        px = _px(n, enc, seed=n)
        split = jax.device_put(px, NamedSharding(mesh, P("data")))
        out = dp(split)
        assert out.embeddings.sharding.device_set == split.sharding.device_set
        np.testing.assert_array_equal(
            np.asarray(out.embeddings[: n * dp.tokens_per_image]),
            np.asarray(enc(px).embeddings[: n * dp.tokens_per_image]),
        )
        assert out.embeddings.ndim == 2
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

    # 2 divides the tiny vocabulary, the one weight the rules split (the convs are replicated)
    mesh = jax.make_mesh((2,), ("model",), (jax.sharding.AxisType.Auto,))
    tower = ChameleonImageTower(enc.cfg, rngs=nnx.Rngs(0))
    sharded = 0
    for path, var in nnx.to_flat_state(nnx.state(tower, nnx.Param)):
        name = ".".join(map(str, path))
        axes = next((a for r, a in PARTITION_RULES if re.search(r, name)), None)
        shape = var.get_value().shape
        stacked = ".layer." in name  # the rules describe one layer: the layer axis unsharded
        spec = partition_spec(axes, shape[1:] if stacked else shape, mesh)
        spec = jax.P(None, *spec) if stacked else spec
        sharded += any(s is not None for s in spec)
        var.set_value(jax.device_put(var.get_value(), jax.NamedSharding(mesh, spec)))
    assert sharded  # the rules split something at this size
    tp = ChameleonImageEncoder(tower, buckets=(4,))
    px = _px(3, enc, seed=5)
    np.testing.assert_array_equal(
        np.asarray(tp.get_image_tokens(px)), np.asarray(enc.get_image_tokens(px))
    )
    np.testing.assert_array_equal(np.asarray(tp(px).rows), np.asarray(enc(px).rows))


def test_encoder_call_sync_free(enc):
    xs = [jax.device_put(_px(b, enc, seed=b)) for b in (3, 1, 2)]
    jaxsync.check.assert_sync_free(enc, xs[0], inputs=[(x,) for x in xs[1:]])
