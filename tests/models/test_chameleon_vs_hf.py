"""Chameleon image paths vs transformers: vocabulary tables, VQ latents, image tokens, embedded
image tokens, logit mask, embedding merge. Tiny random models, weights through the production
loader (`load_model`)."""

import numpy as np
import pytest

from jaxsync.testing import rel_err, requires_torch


pytestmark = requires_torch

torch = pytest.importorskip("torch")
import jax.numpy as jnp  # noqa: E402
from transformers.models.chameleon.modeling_chameleon import (  # noqa: E402
    ChameleonImageVocabularyMapping as HFMapping,
)

from jaxsync.harness.paths.chameleon import reference as ref  # noqa: E402
from jaxsync.models.chameleon import (  # noqa: E402
    ChameleonConfig,
    ChameleonImageEncoder,
    ImageVocabularyMapping,
    load_model,
)


BUCKETS = (4,)  # batch sizes 1..3 share one compiled encoder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf_cfg = ref.tiny_hf_config()
    model = ref.build_hf_model(hf_cfg)
    ckpt = ref.save_checkpoint(model, str(tmp_path_factory.mktemp("chameleon")))
    cfg = ChameleonConfig.from_hf_config(model.config)
    tower = load_model(ckpt, cfg)
    enc = ChameleonImageEncoder(tower, buckets=BUCKETS)
    hidden = ChameleonImageEncoder(tower, encoder_only=True, buckets=BUCKETS)
    return dict(hf_cfg=hf_cfg, model=model, ckpt=ckpt, cfg=cfg, tower=tower, enc=enc, hidden=hidden)


def _codes(enc, ids):
    """VQ codes of BPE ids (the mapping is one to one on the codebook)."""
    return np.vectorize(enc.mapping.bpe2img.__getitem__)(np.asarray(ids))


# ---------------------------------------------------------------- vocabulary tables


def _irregular_maps():
    # Multi-digit codes, plain digits kept as digits, odd last characters, scattered ids.
    names = {"IMGIMGAZ": 900, "IMGIMGBX": 17, "IMGIMG2Q": 40, "IMGIMGDA": 41, "IMGIMGEZ": 5}
    names.update({"IMGIMG5!": 6, "IMGIMGEFQ": 77})  # codes 5 and 45
    names.update({ref.image_token_name(c, suffix="Y"): 1000 + c for c in range(6, 45) if c != 19})
    names["IMGIMGBJY"] = 2000  # code 19, the largest id
    names.update({"<image>": 12, "hello": 13, "IMGIMX": 14})  # IMGIMX is not an image token
    return {
        "released_8192_permuted": ref.synth_vocab_map(8192, seed=0),
        "released_8192_monotone": ref.synth_vocab_map(8192),
        "small_prime_97": ref.synth_vocab_map(97, first_id=11, seed=3),
        "irregular": names,
    }


@pytest.mark.parametrize("name", list(_irregular_maps()))
def test_mapping_tables_equal_hf(name):
    vocab = _irregular_maps()[name]
    hf = HFMapping(vocab)
    ours = ImageVocabularyMapping(vocab)
    assert ours.image_token_ids.tolist() == hf.image_tokens
    assert ours.bpe2img == hf.bpe2img
    np.testing.assert_array_equal(ours.img2bpe, hf.img2bpe_mapping_tensor.numpy())
    assert ours.img2bpe.dtype == np.int32
    assert ours.image_token_id == hf.image_token_id
    assert ours.missing_codes.size == 0


def test_mapping_with_gaps_matches_hf_only_when_made_explicit():
    vocab = ref.synth_vocab_map(50, seed=1, skip_codes=(0, 7, 31))
    hf = HFMapping(vocab)
    with pytest.raises(ValueError, match=r"3 VQ codes have no IMGIMG name \(first: \[0, 7, 31\]\)"):
        ImageVocabularyMapping(vocab).check_code_table()
    ours = ImageVocabularyMapping(vocab, missing_code_id=0)  # upstream's silent choice, explicit
    np.testing.assert_array_equal(ours.img2bpe, hf.img2bpe_mapping_tensor.numpy())
    assert ours.missing_codes.tolist() == [0, 7, 31]
    # HF silently maps the missing codes to BPE id 0, a text token.
    assert hf.img2bpe_mapping_tensor[[0, 7, 31]].tolist() == [0, 0, 0]


def test_duplicate_codes_are_an_error_where_hf_silently_keeps_the_later():
    vocab = {"IMGIMGAZ": 5, "IMGIMGBZ": 6, "IMGIMGBY": 7}  # B-Z and B-Y both decode to code 1
    assert HFMapping(vocab).img2bpe[1] == 7
    with pytest.raises(ValueError, match="both decode to VQ code 1"):
        ImageVocabularyMapping(vocab)


# ---------------------------------------------------------------- tokenizer, fp32


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_image_tokens_fp32_equal_hf(tiny, batch):
    pixels = ref.random_pixels(batch, tiny["cfg"].vq, seed=batch)
    want = ref.hf_image_tokens(tiny["model"], pixels)
    t, n = tiny["cfg"].vq.tokens_per_image, batch * tiny["cfg"].vq.tokens_per_image
    hidden = tiny["hidden"](pixels)  # encoder-only rows: the latents before quant_conv
    err = rel_err(np.asarray(hidden.rows[:n]), ref.latent_rows(want["latents"]))
    assert err <= 1e-5, f"encoder latents rel err {err:.2e}"
    np.testing.assert_array_equal(
        _codes(tiny["enc"], hidden.extras["ids"][:n]), want["codes"].reshape(-1)
    )
    tokens = tiny["enc"].get_image_tokens(pixels)
    assert tokens.shape == (batch, t) and tokens.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(tokens), want["tokens"])
    # The rows are vLLM's `get_input_embeddings(image tokens)`: HF's embedded image features,
    # one exact gather of the loaded table.
    out = tiny["enc"](pixels)
    d = tiny["cfg"].hidden_size
    assert out.rows.dtype == jnp.float32 and out.lengths == (t,) * batch
    np.testing.assert_array_equal(np.asarray(out.rows[:n]), want["embedded"].reshape(n, d))
    for i, item in enumerate(out.split()):
        assert item.shape == (t, d)  # 2-D per item, as tpu-inference's output check requires
        np.testing.assert_array_equal(np.asarray(item), want["embedded"][i])
    np.testing.assert_array_equal(np.asarray(out.extras["ids"][:n]), want["tokens"].reshape(-1))
    # the test is only meaningful if the codes vary
    assert np.unique(want["codes"]).size > 20


def test_every_encoder_block_equals_hf_through_its_stack_slice(tiny):
    """Each checkpoint block (`encoder.down.{i}.block.{j}`, `.attn.{j}`, `.downsample`, the mid
    blocks) against its stack slice `stack.at(k)`: the loader put every layer where the forward
    runs it."""
    from jaxsync.models.chameleon._layout import encoder_layout

    hf_encoder = tiny["model"].model.vqmodel.encoder
    encoder = tiny["tower"].vqmodel.encoder
    layout = encoder_layout(tiny["cfg"].vq)
    rng = np.random.default_rng(0)
    assert set(layout.slots) >= {"down.0.block.0", "down.0.attn.0", "down.0.downsample"}
    for block, slot in layout.slots.items():
        hf_block = hf_encoder.get_submodule(block)
        _, cin, _ = layout.stacks[slot.group][slot.key]
        size = 6 if slot.group != "downsample" else 7  # odd: the (0, 1) pad matters
        x = rng.standard_normal((2, cin, size, size)).astype(np.float32)
        with torch.no_grad():
            want = hf_block(torch.from_numpy(x)).numpy()
        layer = getattr(encoder, slot.group)[slot.key].at(slot.index)
        got = np.asarray(layer(jnp.asarray(x.transpose(0, 2, 3, 1)))).transpose(0, 3, 1, 2)
        err = rel_err(got, want)
        assert err <= 1e-5, f"{block} -> {slot.path}: rel err {err:.2e}"


def test_hf_version_converts_codes_to_bpe(tiny):
    """enc.md 1.5: some HF releases embed raw VQ codes; the installed one must convert."""
    pixels = ref.random_pixels(2, tiny["cfg"].vq, seed=9)
    want = ref.hf_image_tokens(tiny["model"], pixels)
    np.testing.assert_array_equal(want["tokens"], tiny["enc"].mapping.img2bpe[want["codes"]])
    assert not np.array_equal(want["tokens"], want["codes"])


# ---------------------------------------------------------------- tokenizer, bf16


def test_image_tokens_bf16(tiny):
    """bf16 weights and activations, vs HF in bf16 and vs HF in fp32.

    Tolerance: bf16 keeps 8 significant bits (2^-9 = 2e-3 per rounding), compounded over ~10
    conv / norm layers with differently ordered fp32 accumulations in XLA and torch. Our bf16
    latents must be as close to the fp32 reference as HF's own bf16 latents are (within 2x), and
    tokens may flip only where two codebook distances are closer than that noise.
    """
    pixels = ref.random_pixels(3, tiny["cfg"].vq, seed=5)
    ref32 = ref.hf_image_tokens(tiny["model"], pixels)
    hf16 = ref.hf_image_tokens(ref.build_hf_model(tiny["hf_cfg"], dtype="bfloat16"), pixels)
    cfg = tiny["cfg"]
    tower16 = load_model(tiny["ckpt"], cfg, dtype=jnp.bfloat16)
    enc16 = ChameleonImageEncoder(tower16, buckets=BUCKETS)
    hidden = ChameleonImageEncoder(tower16, encoder_only=True, buckets=BUCKETS)(pixels)
    assert hidden.rows.dtype == jnp.bfloat16
    ours = np.asarray(hidden.rows[: 3 * cfg.vq.tokens_per_image].astype(jnp.float32))
    err_ours = rel_err(ours, ref.latent_rows(ref32["latents"]))
    err_hf = rel_err(hf16["latents"], ref32["latents"])
    err_pair = rel_err(ours, ref.latent_rows(hf16["latents"]))
    assert err_ours <= 2 * err_hf, f"ours {err_ours:.2e} vs HF-bf16's own {err_hf:.2e}"
    assert err_pair <= 5e-2, f"bf16 latents vs HF bf16: {err_pair:.2e}"
    tokens = np.asarray(enc16.get_image_tokens(pixels))
    rows = enc16(pixels).rows
    assert rows.dtype == jnp.bfloat16  # the model dtype: merges into bf16 text embeddings as is
    agree_hf16 = float((tokens == hf16["tokens"]).mean())
    agree_32 = float((tokens == ref32["tokens"]).mean())
    hf_agree_32 = float((hf16["tokens"] == ref32["tokens"]).mean())
    print(
        f"bf16 latents: ours {err_ours:.2e}, HF {err_hf:.2e}, ours-vs-HF {err_pair:.2e}; token "
        f"agreement ours-vs-HF16 {agree_hf16:.3f}, ours-vs-fp32 {agree_32:.3f}, "
        f"HF16-vs-fp32 {hf_agree_32:.3f}"
    )
    assert agree_32 >= hf_agree_32 - 0.05
    assert agree_hf16 >= 0.85


# ---------------------------------------------------------------- logits


@pytest.mark.parametrize("shape", [(7, None), (2, 5, None)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_masked_logits_equal_hf(tiny, shape, dtype):
    vocab = tiny["cfg"].vocab_size
    shape = shape[:-1] + (vocab,)
    logits = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(
        getattr(torch, dtype)
    )
    want = ref.hf_mask_logits(logits, tiny["enc"].mapping.image_token_ids.tolist())
    got = tiny["enc"].mask_image_logits(jnp.asarray(logits.float().numpy()).astype(dtype))
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want.float().numpy())


def test_compute_logits_vs_hf_forward(tiny):
    model, enc = tiny["model"], tiny["enc"]
    ids = torch.tensor([[1, 5, 9, 2, 11], [3, 3, 7, 8, 0]])
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        want = model(input_ids=ids).logits.numpy()
    w = jnp.asarray(model.lm_head.weight.detach().numpy())
    got = np.asarray(enc.compute_logits(jnp.asarray(hidden.numpy()), w))
    masked = np.zeros(got.shape[-1], bool)
    masked[enc.mapping.image_token_ids] = True
    np.testing.assert_array_equal(got[..., masked], want[..., masked])
    assert (got[..., masked] == np.finfo(np.float32).min).all()
    assert rel_err(got[..., ~masked], want[..., ~masked]) <= 1e-5


# ---------------------------------------------------------------- merge


def test_merge_equal_hf_masked_scatter(tiny):
    model, enc = tiny["model"], tiny["enc"]
    t = tiny["cfg"].vq.tokens_per_image
    img = enc.mapping.image_token_id
    row0 = [1, 5] + [img] * t + [9]
    row1 = [img] * t + [3, 4, 6]
    ids = np.array([row0, row1], dtype=np.int64)
    pixels = ref.random_pixels(2, tiny["cfg"].vq, seed=11)
    hf = ref.hf_merge(model, ids, pixels)
    want = hf["want"]
    tokens = enc.get_image_tokens(pixels)
    got = enc.merge_image_embeddings(
        jnp.asarray(hf["text_embeds"]),
        jnp.take(jnp.asarray(hf["embed_table"]), tokens, axis=0),
        input_ids=ids,
    )
    np.testing.assert_array_equal(np.asarray(got), want)
    # the encoder's own rows (bucket padded) merge to the same prompt
    out = enc(pixels)
    rows = enc.merge_image_embeddings(
        jnp.asarray(hf["text_embeds"]), out.rows, input_ids=ids, num_image_tokens=out.num_tokens
    )
    np.testing.assert_array_equal(np.asarray(rows), want)


def test_verify_on_a_saved_checkpoint(tmp_path, capsys):
    # The `--checkpoint` branch: a tiny HF model saved with save_pretrained, loaded by our loader.
    import json

    from jaxsync.harness import _cli

    ref.build_hf_model(ref.tiny_hf_config()).save_pretrained(tmp_path)
    rc = _cli.main(
        ["verify", "--paths", "chameleon.image_tokens", "--checkpoint", str(tmp_path), "--json"]
    )
    (row,) = json.loads(capsys.readouterr().out)["paths"]
    assert rc == 0 and row["ok"], row
    assert row["parity"]["status"] == "none"  # no reference claimed for a user checkpoint


def test_load_model_keeps_the_checkpoint_dtype_and_casts_on_request(tiny, tmp_path):
    import jax
    from flax import nnx

    model16 = ref.build_hf_model(tiny["hf_cfg"], dtype="bfloat16")
    ckpt16 = ref.save_checkpoint(model16, str(tmp_path))
    dtypes = lambda m: {x.dtype for x in jax.tree.leaves(nnx.state(m))}  # noqa: E731
    assert dtypes(load_model(ckpt16, tiny["cfg"])) == {jnp.dtype(jnp.bfloat16)}  # no flag
    assert dtypes(load_model(tiny["ckpt"], tiny["cfg"])) == {jnp.dtype(jnp.float32)}
    assert dtypes(load_model(ckpt16, tiny["cfg"], dtype=jnp.float32)) == {jnp.dtype(jnp.float32)}


def test_load_model_places_parameters_on_a_mesh(tiny):
    import jax
    from flax import nnx

    import jaxsync.testing

    mesh = jaxsync.testing.device_mesh("model", auto=True)
    tower = load_model(tiny["ckpt"], tiny["cfg"], mesh=mesh)
    leaves = jax.tree.leaves(nnx.state(tower))
    assert all(x.sharding.mesh == mesh for x in leaves)
    # the VQ encoder is data parallel (PARTITION_RULES): its convs stay whole on every device
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(nnx.state(tower.vqmodel)))
    sharded = ChameleonImageEncoder(tower, buckets=BUCKETS)
    pixels = ref.random_pixels(3, tiny["cfg"].vq, seed=2)
    want = ref.hf_image_tokens(tiny["model"], pixels)
    np.testing.assert_array_equal(np.asarray(sharded.get_image_tokens(pixels)), want["tokens"])
    n, d = 3 * tiny["cfg"].vq.tokens_per_image, tiny["cfg"].hidden_size
    rows = sharded(pixels).rows[:n]
    np.testing.assert_array_equal(np.asarray(rows), want["embedded"].reshape(n, d))


def test_text_embedding_split_by_vocabulary_rows_gives_the_same_rows(tiny):
    import re

    import jax

    import jaxsync
    import jaxsync.testing

    mesh = jaxsync.testing.device_mesh("model", max_devices=2, auto=True)  # 2 divides the vocab
    tower = load_model(tiny["ckpt"], tiny["cfg"], mesh=mesh)
    table = tower.embed_tokens.embedding[...]
    assert tuple(table.sharding.spec) == ("model", None)
    enc = ChameleonImageEncoder(tower, buckets=BUCKETS)
    pixels = ref.random_pixels(2, tiny["cfg"].vq, seed=6)
    want = ref.hf_image_tokens(tiny["model"], pixels)["embedded"]
    out = enc(pixels)
    n = 2 * tiny["cfg"].vq.tokens_per_image
    np.testing.assert_array_equal(np.asarray(out.rows[:n]), want.reshape(n, -1))
    # The ids are looked up where the table's rows lie: the program never all-gathers it.
    rep = jax.sharding.NamedSharding(mesh, jax.P())
    x = jax.device_put(np.concatenate([pixels, np.zeros_like(pixels)]), rep)
    hlo = enc.program.lower(x, jaxsync.upload_packed(enc.plan(2), placement=rep))
    text = hlo.compile().as_text()
    v, d = table.shape
    assert "all-gather" in text or "all-reduce" in text  # the control: a sharded program
    assert not re.search(rf"= f32\[{v},{d}\]\S* all-gather\(", text), "table all-gathered"


def test_vq_configs_of_other_models_are_refused():
    """GLM-Image's VQ config holds a subset of the Chameleon VQ fields, but its model has no
    encoder (the control: no conv_in); its model_type is refused, alone or in its full config."""
    import transformers

    from jaxsync.models.chameleon import ChameleonVQConfig

    vq = transformers.GlmImageVQVAEConfig(embed_dim=8, num_embeddings=5, latent_channels=16)
    assert not any("conv_in" in k for k in transformers.GlmImageVQVAE(vq).state_dict())
    for src in (vq, vq.to_dict(), {"model_type": "glm_image", "vq_config": vq.to_dict()}):
        with pytest.raises(ValueError, match="model_type 'glm_image"):
            ChameleonVQConfig.from_hf_config(src)
    assert ChameleonVQConfig.from_hf_config(transformers.ChameleonVQVAEConfig()) == (
        ChameleonVQConfig()
    )
