"""Registers the Chameleon paths for `jaxsync verify` and their benchmarks for `jaxsync bench`."""

from __future__ import annotations

import functools as ft
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsync.models.chameleon import _reference as ref
from jaxsync.models.chameleon._config import ChameleonConfig, ChameleonVQConfig
from jaxsync.models.chameleon._model import ChameleonImagePaths
from jaxsync.models.chameleon._vqvae import ChameleonVQVAE
from jaxsync.models.chameleon._weights import load_vqvae
from jaxsync.registry import BenchCase, Parity, PathCase, register_bench, register_path


_TINY_BUCKETS = (4,)


@ft.cache
def _tiny_paths(checkpoint: str | None) -> ChameleonImagePaths:
    if checkpoint is not None:  # verify's batches 3, 1, 2 share one bucket here too
        return ChameleonImagePaths.from_pretrained(checkpoint, buckets=_TINY_BUCKETS)
    cfg = ChameleonConfig.from_hf_config(ref.tiny_hf_config())
    vq = ChameleonVQVAE(cfg.vq, rngs=nnx.Rngs(0))
    return ChameleonImagePaths(cfg, vq, buckets=_TINY_BUCKETS)


@ft.cache
def _tiny_reference() -> tuple[Any, ChameleonImagePaths]:
    """The HF tiny model and our paths loaded from its saved checkpoint."""
    hf_cfg = ref.tiny_hf_config()
    model = ref.build_hf_model(hf_cfg)
    ckpt = ref.save_checkpoint(model, tempfile.mkdtemp(prefix="jaxsync-chameleon-"))
    cfg = ChameleonConfig.from_hf_config(model.config)
    return model, ChameleonImagePaths(cfg, load_vqvae(cfg.vq, ckpt), buckets=_TINY_BUCKETS)


def _image_tokens_parity() -> Parity:
    import jaxsync.testing as jt

    model, paths = _tiny_reference()
    vq_cfg = ref.tiny_vq_config()
    worst, mismatches = 0.0, 0
    for batch in (1, 2, 3):
        pixels = ref.random_pixels(batch, vq_cfg, seed=batch)
        want = ref.hf_image_tokens(model, pixels)
        latents, _ = paths.tokenizer.encode(jnp.asarray(pixels))
        worst = max(worst, jt.rel_err(np.asarray(latents).transpose(0, 3, 1, 2), want["latents"]))
        mismatches += int((np.asarray(paths.get_image_tokens(pixels)) != want["tokens"]).sum())
    detail = f"HF get_image_tokens, B=1,2,3; latents rel {worst:.1e}"
    if worst > 1e-5:
        return Parity(worst, 1e-5, "rel", detail)
    return Parity(float(mismatches), 0.0, "mismatches", detail)


@register_path("chameleon.image_tokens", description="pixels -> VQ codes -> BPE ids (one program)")
def _build_image_tokens(checkpoint: str | None) -> PathCase:
    paths = _tiny_paths(checkpoint)
    # Device pixels: with host pixels every argument is static, and the harness's compiled-HLO
    # scan would constant-fold the whole encoder (slow, and not what runs).
    inputs = [(jax.device_put(ref.random_pixels(b, paths.cfg.vq, seed=b)),) for b in (3, 1, 2)]
    return PathCase(
        fn=paths.get_image_tokens,
        inputs=inputs,
        parity=_image_tokens_parity if checkpoint is None else None,
    )


def _mask_parity() -> Parity:
    import torch

    _, paths = _tiny_reference()
    ids = paths.mapping.image_token_ids.tolist()
    bad = 0
    for shape in ((7, paths.cfg.vocab_size), (2, 5, paths.cfg.vocab_size)):
        logits = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        want = ref.hf_mask_logits(logits, ids).numpy()
        got = np.asarray(paths.mask_image_logits(jnp.asarray(logits.numpy())))
        bad += int((got != want).sum())
    return Parity(float(bad), 0.0, "mismatches", "HF logits[:, :, image_tokens] = finfo.min")


@register_path("chameleon.mask_logits", description="image-token logit mask (cached column mask)")
def _build_mask(checkpoint: str | None) -> PathCase:
    paths = _tiny_paths(checkpoint)
    keys = jax.random.split(jax.random.key(0), 3)
    inputs = [(jax.random.normal(k, (5, paths.cfg.vocab_size)),) for k in keys]
    return PathCase(
        fn=paths.mask_image_logits,
        inputs=inputs,
        parity=_mask_parity if checkpoint is None else None,
    )


def _merge_parity() -> Parity:
    model, paths = _tiny_reference()
    t = paths.cfg.vq.tokens_per_image
    ids = np.array([[1] + [paths.mapping.image_token_id] * t + [2]], dtype=np.int64)
    pixels = ref.random_pixels(1, ref.tiny_vq_config(), seed=4)
    hf = ref.hf_merge(model, ids, pixels)
    image = jnp.take(jnp.asarray(hf["embed_table"]), paths.get_image_tokens(pixels), axis=0)
    got = paths.merge_image_embeddings(jnp.asarray(hf["text_embeds"]), image, input_ids=ids)
    mismatches = float((np.asarray(got) != hf["want"]).sum())
    return Parity(mismatches, 0.0, "mismatches", "HF masked_scatter")


@register_path("chameleon.merge_embeddings", description="image embeddings -> <image> positions")
def _build_merge(checkpoint: str | None) -> PathCase:
    paths = _tiny_paths(checkpoint)
    d, seq = paths.cfg.hidden_size, 41
    text = jax.random.normal(jax.random.key(1), (2, seq, d))
    image = jax.random.normal(jax.random.key(2), (13, d))

    def merge(text, image, positions):
        return paths.merge_image_embeddings(text, image, positions=positions, num_image_tokens=9)

    starts = (0, 30, 50)  # 9 placeholders at different places, one position bucket
    inputs = [(text, image, np.arange(s, s + 9, dtype=np.int32)) for s in starts]
    return PathCase(fn=merge, inputs=inputs, parity=_merge_parity if checkpoint is None else None)


# ---------------------------------------------------------------- benchmarks


def _mask_cases(device: str, size: str) -> list[BenchCase]:
    import torch

    vocab, n_codes = (65536, 8192) if size == "released" else (4099, 97)
    vocab_map = ref.synth_vocab_map(n_codes, seed=0)
    vq = ChameleonVQConfig(num_embeddings=n_codes)
    cfg = ChameleonConfig(vocab_size=vocab, vocabulary_map=vocab_map, vq=vq)
    paths = ChameleonImagePaths(cfg)
    id_list = paths.mapping.image_token_ids.tolist()
    idx = torch.tensor(id_list, dtype=torch.long, device=device)  # post-PR: cached per device
    fill = torch.finfo(torch.bfloat16).min
    cases = []
    for tokens in (1, 16, 64, 256):
        # Committed, like logits coming out of a jitted lm_head: an uncommitted first input
        # would make the donated chain's second call compile once more.
        x = jax.random.normal(jax.random.key(tokens), (tokens, vocab), jnp.bfloat16)
        jx = {"x": jax.device_put(x, jax.devices()[0])}
        tx = torch.randn(tokens, vocab, device=device, dtype=torch.bfloat16)

        def jax_fn(jx=jx):  # in place: the output replaces the donated input
            jx["x"] = paths.mask_image_logits(jx["x"], donate=True)
            return jx["x"]

        def pre_pr(tx=tx):
            tx[:, id_list] = fill
            return tx

        def post_pr(tx=tx):
            return tx.index_fill_(1, idx, fill)

        def hf_eager(tx=tx):
            t3 = tx.view(1, *tx.shape)
            t3[:, :, id_list] = fill
            return t3

        torch_fns = {"vllm_pre_pr": pre_pr, "vllm_post_pr": post_pr, "transformers_eager": hf_eager}
        cases.append(BenchCase(f"mask_logits[{size},T={tokens}]", jax_fn, torch_fns, 2 * tx.nbytes))
    return cases


def _tokenizer_cases(device: str, size: str) -> list[BenchCase]:
    import torch
    from transformers.models.chameleon.modeling_chameleon import (
        ChameleonImageVocabularyMapping as HFMapping,
    )

    vq_dict = {} if size == "released" else ref.tiny_vq_config()
    hf_cfg = dict(vocabulary_map=ref.synth_vocab_map(vq_dict.get("num_embeddings", 8192), seed=0))
    hf_cfg["vq_config"] = vq_dict
    cfg = ChameleonConfig.from_hf_config(hf_cfg)
    dtype = jnp.bfloat16 if size == "released" else jnp.float32
    vq = ChameleonVQVAE(cfg.vq, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
    paths = ChameleonImagePaths(cfg, vq)
    tdtype = "bfloat16" if size == "released" else "float32"
    hf_vq = ref.build_hf_vqvae(ref.tiny_vq_config() if vq_dict else {}, dtype=tdtype).to(device)
    hf_map = HFMapping(cfg.vocabulary_map)
    table_cpu = hf_map.img2bpe_mapping_tensor
    table_dev = table_cpu.to(device)
    shape = (cfg.vq.in_channels, cfg.vq.resolution, cfg.vq.resolution)
    cases = []
    for batch in (1, 2, 4, 8) if size == "released" else (1, 3):
        pixels = np.random.default_rng(batch).uniform(-1, 1, (batch, *shape)).astype(np.float32)
        jpx = jax.device_put(pixels.astype(dtype), jax.devices()[0])
        tpx = torch.from_numpy(pixels).to(device=device, dtype=getattr(torch, tdtype))

        def pre_pr(tpx=tpx, b=batch):
            codes = hf_vq.encode(tpx).image_tokens
            return table_cpu[codes.to("cpu")].to(codes.device).view(b, -1)

        def post_pr(tpx=tpx, b=batch):
            return table_dev[hf_vq.encode(tpx).image_tokens].view(b, -1)

        def hf_eager(tpx=tpx, b=batch):  # ChameleonModel.get_image_tokens
            return hf_map.convert_img2bpe(hf_vq.encode(tpx).image_tokens).view(b, -1)

        torch_fns = {"vllm_pre_pr": pre_pr, "vllm_post_pr": post_pr, "transformers_eager": hf_eager}
        jax_fn = ft.partial(paths.get_image_tokens, jpx)
        cases.append(BenchCase(f"image_tokens[{size},B={batch}]", jax_fn, torch_fns))
    return cases


@register_bench("chameleon")
def _bench(device: str, size: str) -> list[BenchCase]:
    return _mask_cases(device, size) + _tokenizer_cases(device, size)
