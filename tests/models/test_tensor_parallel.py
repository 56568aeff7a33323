"""Tensor parallelism of every tower on a ("data", "model") 2x4 CPU mesh.

Each tower is loaded from its tiny checkpoint with `mesh=` and its family's `PARTITION_RULES`,
and its forward is compiled inside a server's jit (state leaves as arguments, `nnx.merge`
inside, metadata uploaded and replicated on the mesh). The compiled HLO must hold no all-gather
(of activations or weights) and no more all-reduces than the Megatron pattern needs (the
table in each family's `_weights.py`; a collective inside the layer scan's while body appears
once in the text at any depth), and the rows must equal the single-device rows at fp32.

The tiny configs here are the families' test configs with the head counts and the widths the
rules split (MLP, merger) made divisible by the "model" axis' 4.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

import jaxsync
from jaxsync.harness.bench._mesh import collectives
from jaxsync.testing import assert_close


pytest.importorskip("torch")
pytest.importorskip("transformers")


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((2, 4), ("data", "model"), (jax.sharding.AxisType.Auto,) * 2)


@dataclasses.dataclass
class Case:
    """One tower: how to load it and make one batch of server inputs."""

    load: Callable[..., nnx.Module]  # load(mesh=..., partition_rules=...) -> tower (picklable)
    inputs: Callable[[nnx.Module], tuple[np.ndarray, Any]]  # tower -> (host input, plan)
    forward: Callable[..., jaxsync.Encoded]
    encoder: Callable[..., Any]  # the family's entry class
    call: Callable[[Any], jaxsync.Embeddings]  # encoder -> its output on the same batch
    all_reduces: int  # the pattern's all-reduce count in the HLO text (see `_weights.py`)


def _glm4v(tmp) -> Case:
    from jaxsync.harness.paths.glm4v import reference as ref
    from jaxsync.models import glm4v

    fields = {**ref.TINY, "out_hidden_size": 32, "intermediate_size": 40}  # heads 4, MLPs /4
    ckpt = ref.save_checkpoint(ref.build_reference(ref.hf_config(**fields)), tmp / "m.st")
    cfg = glm4v.Glm4vVisionConfig(**fields)
    grid = [[1, 6, 6], [2, 4, 4], [1, 2, 10]]
    px = ref.pixels(grid, cfg, seed=1)

    def inputs(tower):
        plan = glm4v.plan(grid, tower.cfg)
        host = np.zeros((plan.padded_patches, cfg.patch_dim), np.float32)
        host[: px.shape[0]] = px
        return host, plan

    return Case(
        load=functools.partial(glm4v.load_model, ckpt, cfg),
        inputs=inputs,
        forward=glm4v.forward,
        encoder=glm4v.Glm4vVisionEncoder,
        call=lambda enc: enc(px, grid),
        all_reduces=3,
    )


def _qwen3_omni(tmp) -> Case:
    from jaxsync.harness.paths.qwen3_omni import reference as ref
    from jaxsync.models import qwen3_omni as q3

    # heads 4 (head dim 11), d_model and ffn divisible by 4; the 29-wide head stays replicated
    cfg = dataclasses.replace(ref.TINY, encoder_attention_heads=4, d_model=44, encoder_ffn_dim=52)
    ckpt = ref.save_hf_encoder(ref.build_hf_encoder(cfg), tmp / "m.st")
    lens = [120, 31, 250]
    feats = ref.random_features(cfg, lens, seed=1)

    def inputs(tower):
        x = q3.pad_features(feats, lens)
        return x, q3.Qwen3OmniAudioEncoder(tower).plan(x.shape, lens)

    return Case(
        load=functools.partial(q3.load_model, ckpt, cfg),
        inputs=inputs,
        forward=q3.forward,
        encoder=q3.Qwen3OmniAudioEncoder,
        call=lambda enc: enc(feats, lens),
        all_reduces=2,
    )


def _voxtral(tmp) -> Case:
    from jaxsync.harness.paths.voxtral import reference as ref
    from jaxsync.models import voxtral

    # the tiny config divides as it is: 4 heads, width 28, ffn 112, projector 112 -> 36
    _, ckpt, cfg = ref.build_tiny_voxtral(tmp)
    counts = [1, 2, 1]
    feats = ref.window_features(sum(counts), cfg, seed=1).astype(np.float32)

    def inputs(tower):
        plan = voxtral.plan(counts, tower.cfg)
        host = np.zeros((plan.meta.row_audio.shape[0], *feats.shape[1:]), np.float32)
        host[: feats.shape[0]] = feats
        return host, plan

    return Case(
        load=functools.partial(voxtral.load_model, ckpt, cfg),
        inputs=inputs,
        forward=voxtral.forward,
        encoder=voxtral.VoxtralAudioEncoder,
        call=lambda enc: enc(input_features=feats, num_chunks=counts),
        all_reduces=3,
    )


def _gemma3n(tmp) -> Case:
    from jaxsync.harness.paths.gemma3n import reference as ref
    from jaxsync.models import gemma3n

    # 4 heads of 6, conformer width 24, text width 20 (the tiny one: 2 heads, 22, 17)
    variant = {"audio": {"hidden_size": 24, "conf_num_attention_heads": 4}}
    built = ref.build_reference(tmp, variant={**variant, "text": {"hidden_size": 20}})
    lengths, frames = [57, 40, 13], 57
    feats, mask = ref.mel_batch(lengths, frames, built.cfg.input_feat_size, seed=1)

    def inputs(tower):
        p = gemma3n.plan(mask, tower.cfg)
        host = np.zeros((p.batch, p.frame_bucket, feats.shape[-1]), np.float32)
        host[: feats.shape[0], :frames] = feats
        return host, p

    return Case(
        load=functools.partial(gemma3n.load_model, built.checkpoint, built.cfg),
        inputs=inputs,
        forward=gemma3n.forward,
        encoder=gemma3n.Gemma3nAudioEncoder,
        call=lambda enc: enc(feats, mask),
        all_reduces=5,
    )


def _chameleon(tmp) -> Case:
    from jaxsync.harness.paths.chameleon import reference as ref
    from jaxsync.models import chameleon

    # the tiny config with a vocabulary of 116 rows (4 divides it): the embedding is split
    model = ref.build_hf_model({**ref.tiny_hf_config(), "vocab_size": 116})
    ckpt = ref.save_checkpoint(model, str(tmp))
    cfg = chameleon.ChameleonConfig.from_hf_config(model.config)
    px = ref.random_pixels(3, cfg.vq, seed=1)

    def inputs(tower):
        p = chameleon.plan(px.shape[0], tower.cfg, buckets=(4,))
        host = np.zeros((p.rows, *px.shape[1:]), np.float32)
        host[: px.shape[0]] = px
        return host, p

    return Case(
        load=functools.partial(chameleon.load_model, ckpt, cfg),
        inputs=inputs,
        forward=chameleon.forward,
        encoder=functools.partial(chameleon.ChameleonImageEncoder, buckets=(4,)),
        call=lambda enc: enc(px),
        all_reduces=1,
    )


FAMILIES = {
    "glm4v": _glm4v,
    "qwen3_omni": _qwen3_omni,
    "voxtral": _voxtral,
    "gemma3n": _gemma3n,
    "chameleon": _chameleon,
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def case(request, tmp_path_factory) -> Case:
    return FAMILIES[request.param](tmp_path_factory.mktemp(request.param))


def _server(tower: nnx.Module, forward: Callable, **options):
    """A server's jit: the state as flat leaves, the module merged inside the trace."""
    graphdef, state = nnx.split(tower)
    leaves, treedef = jax.tree_util.tree_flatten(state)

    def step(leaves, x, meta):
        return forward(nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves)), x, meta)

    return jax.jit(step, **options), leaves


def _compile(case: Case, tower: nnx.Module, mesh=None, forward=None, x_spec=None):
    """(compiled HLO text, rows) of the tower's forward in a server jit on `mesh` (or on one
    device), inputs and metadata placed on the mesh (features by `x_spec`)."""
    x, plan = case.inputs(tower)
    meta = jaxsync.upload_packed(plan)
    if mesh is not None:
        meta = jax.device_put(meta, NamedSharding(mesh, P()))
        x = jax.device_put(x, NamedSharding(mesh, x_spec or P()))
    step, leaves = _server(tower, forward or case.forward)
    hlo = step.lower(leaves, x, meta).compile().as_text()
    return hlo, step(leaves, x, meta)


@pytest.fixture(scope="module")
def single(case):
    """The single-device rows of each case."""
    return np.asarray(_compile(case, case.load())[1].rows)


@pytest.fixture(scope="module")
def sharded(case):
    return case.load(mesh=_mesh())


def test_megatron_pattern_has_no_gather_and_one_reduce_per_block_half(case, single, sharded):
    hlo, out = _compile(case, sharded, _mesh())
    found = collectives(hlo)
    assert found["all-gather"] == 0, found
    assert found["all-reduce"] <= case.all_reduces, found
    assert found["reduce-scatter"] == found["all-to-all"] == found["collective-permute"] == 0
    # the pattern is really sharded: every reduction it needs is there
    assert found["all-reduce"] == case.all_reduces, found
    assert_close(np.asarray(out.rows), single, rtol=1e-5, atol=1e-6)


def test_rows_are_replicated_by_default_and_placed_as_asked(case, single, sharded):
    mesh = _mesh()
    _, out = _compile(case, sharded, mesh)
    assert out.rows.sharding.is_equivalent_to(NamedSharding(mesh, P()), out.rows.ndim)
    rows = out.rows.shape[0]
    if rows % 2:  # pragma: no cover - the tiny batches have even row counts
        pytest.skip("rows do not split over data")
    asked = _compile(case, sharded, mesh, forward=_bound(case.forward, P("data")))[1]
    assert asked.rows.sharding.spec == P("data")
    assert_close(np.asarray(asked.rows), single, rtol=1e-5, atol=1e-6)


def _bound(forward: Callable, out_sharding) -> Callable:
    def bound(model, x, meta):
        return forward(model, x, meta, out_sharding=out_sharding)

    return bound


def test_unsharded_weights_leave_rows_unconstrained(case, single):
    tower = case.load()
    hlo, out = _compile(case, tower)
    assert sum(collectives(hlo).values()) == 0
    np.testing.assert_array_equal(np.asarray(out.rows), single)
    with pytest.raises(ValueError, match="no mesh"):
        _compile(case, tower, forward=_bound(case.forward, P("data")))


def test_entry_uploads_beside_the_weights_and_places_rows(case, single, sharded):
    mesh = _mesh()
    enc = case.encoder(sharded)  # no placement=: uploads go to the weights' mesh, replicated
    out = case.call(enc)
    assert out.embeddings.sharding.is_equivalent_to(NamedSharding(mesh, P()), 2)
    n = out.embeddings.shape[0]
    assert_close(np.asarray(out.embeddings), single[:n], rtol=1e-5, atol=1e-6)
    asked = case.call(case.encoder(sharded, out_sharding=P("data")))
    assert asked.embeddings.sharding.spec == P("data")


def test_entry_refuses_a_placement_away_from_the_weights(case, sharded):
    with pytest.raises(ValueError, match=r"(?s)placement.*\[.*0.*\].*weights.*\[.*0.*1.*7"):
        case.encoder(sharded, placement=jax.devices()[0])
    # a placement on the weights' devices is taken
    case.encoder(sharded, placement=NamedSharding(_mesh(), P()))


def test_entry_refuses_a_placement_of_another_type(case, sharded):
    with pytest.raises(TypeError, match="placement must be a jax.Device, a Sharding or None"):
        case.encoder(sharded, placement="cpu:0")


def test_entry_refuses_a_bad_out_sharding_at_construction(case, sharded):
    with pytest.raises(TypeError, match="out_sharding must be a Sharding, a PartitionSpec"):
        case.encoder(sharded, out_sharding="data")
    with pytest.raises(ValueError, match=r"names axes \['rows'\] that the weights' mesh lacks"):
        case.encoder(sharded, out_sharding=P("rows"))
    with pytest.raises(ValueError, match=r"out_sharding \(.*\) on devices \[0\]"):
        case.encoder(sharded, out_sharding=SingleDeviceSharding(jax.devices()[0]))
    with pytest.raises(ValueError, match="no mesh"):
        case.encoder(case.load(), out_sharding=P("data"))  # one-device weights
    case.encoder(sharded, out_sharding=P("data"))  # control: the mesh's own axis is taken


def test_from_pretrained_loads_through_the_family_loader(case, sharded):
    """`<Entry>.from_pretrained(checkpoint, cfg, mesh=, **options)` is the family's `load_model`
    then the entry: the same rows, split as asked; a model of another type is refused."""
    ckpt, cfg = case.load.args
    entry = getattr(case.encoder, "func", case.encoder)  # the class, options apart
    options = {**getattr(case.encoder, "keywords", {}), "out_sharding": P("data")}
    got = case.call(entry.from_pretrained(ckpt, cfg, mesh=_mesh(), **options))
    want = case.call(case.encoder(sharded, out_sharding=P("data")))
    assert got.embeddings.sharding.spec == P("data")
    np.testing.assert_array_equal(np.asarray(got.embeddings), np.asarray(want.embeddings))
    with pytest.raises(TypeError, match=f"model must be a {type(sharded).__name__}"):
        case.encoder(object())


def test_glm4v_column_split_of_the_stored_qkv_gathers(tmp_path, monkeypatch):
    """Negative control: transformers' fused qkv order ([3, N, H] columns) split by column puts
    q heads on some devices and v heads on others, so attention must gather them."""
    from jaxsync.models.glm4v import _attention, _weights

    case = _glm4v(tmp_path)

    head_major_rules = _weights.rules

    def stored_order(cfg):
        keep = [r for r in head_major_rules(cfg) if "qkv" not in r.pattern]
        return (
            _weights.Rule(
                r"blocks\.(\d+)\.attn\.qkv\.weight", r"blocks.\1.attn.qkv.kernel", _weights.linear
            ),
            _weights.Rule(r"blocks\.(\d+)\.attn\.qkv\.bias", r"blocks.\1.attn.qkv.bias"),
            *keep,
        )

    def call(self, x, cos, sin, segments):  # the attention over the stored [P, 3, N, H] order
        p = x.shape[0]
        qkv = self.qkv(x).reshape(p, 3, self.num_heads, self.head_dim)
        q, k = (_attention._rotate(qkv[:, i], cos, sin) for i in (0, 1))
        out = _attention.masked_attention(q, k, qkv[:, 2], segments, self.impl)
        return self.proj(out.reshape(p, -1))

    single = np.asarray(_compile(case, case.load())[1].rows)
    monkeypatch.setattr(_weights, "rules", stored_order)
    monkeypatch.setattr(_attention.Attention, "__call__", call)
    hlo, out = _compile(case, case.load(mesh=_mesh()), _mesh())
    assert collectives(hlo)["all-gather"] >= 1
    # the stored order is still the right math, only placed badly
    assert_close(np.asarray(out.rows), single, rtol=1e-5, atol=1e-6)


def test_chameleon_images_split_over_data_need_no_gather(tmp_path):
    """The VQ encoder is data parallel: images split over "data", rows asked split the same way,
    and the only collective left is the vocabulary-parallel embedding's all-reduce."""
    case = _chameleon(tmp_path)
    single = np.asarray(_compile(case, case.load())[1].rows)
    forward = _bound(case.forward, P("data"))
    hlo, out = _compile(case, case.load(mesh=_mesh()), _mesh(), forward=forward, x_spec=P("data"))
    found = collectives(hlo)
    assert found["all-gather"] == 0 and found["all-reduce"] <= 1, found
    # the replicated per-image metadata is sliced to each data shard (a few words moved); no
    # activation or weight moves between devices
    moved = re.findall(r"= [a-z0-9]+\[([\d,]*)\][^=\n]* collective-permute(?:-start)?\(", hlo)
    assert all(int(np.prod([int(n) for n in m.split(",") if n])) <= 4 for m in moved), moved
    assert out.rows.sharding.spec == P("data")
    assert_close(np.asarray(out.rows), single, rtol=1e-5, atol=1e-6)
