"""Registers the Chameleon benchmarks for `jaxsync bench` (vLLM pre/post-PR and HF baselines).

Every tokenizer workload timed through the entry is timed beside it through the server form:
`forward` in a server's own jit over the tower's flat state leaves, the plan's meta uploaded
once outside the timed call. Both run the same program (the tokens and their embedded rows).
"""

from __future__ import annotations

import functools as ft

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsync.harness.bench._programs import main_program_args
from jaxsync.harness.paths._server import server_runner
from jaxsync.harness.paths.chameleon import reference as ref
from jaxsync.harness.registry import BenchCase, register_bench
from jaxsync.models.chameleon import (
    ChameleonConfig,
    ChameleonImageEncoder,
    ChameleonImageTower,
    ChameleonTextPaths,
    ChameleonVQConfig,
    forward,
)


def _mask_cases(device: str, size: str) -> list[BenchCase]:
    import torch

    vocab, n_codes = (65536, 8192) if size == "released" else (4099, 97)
    vocab_map = ref.synth_vocab_map(n_codes, seed=0)
    vq = ChameleonVQConfig(num_embeddings=n_codes)
    cfg = ChameleonConfig(vocab_size=vocab, vocabulary_map=vocab_map, vq=vq)
    paths = ChameleonTextPaths(cfg)
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
        name = f"mask_logits[{size},T={tokens}]"
        args = lambda jx=jx: main_program_args(lambda: paths.mask_image_logits(jx["x"]))  # noqa: E731
        cases.append(BenchCase(name, jax_fn, torch_fns, 2 * tx.nbytes, jit_args=args))
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
    tower = ChameleonImageTower(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
    paths = ChameleonImageEncoder(tower)
    server = server_runner(tower, forward)
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
        name = f"image_tokens[{size},B={batch}]"
        cases.append(BenchCase(name, jax_fn, torch_fns))
        # the pixels padded to the plan's bucket once, outside the timed call
        p = paths.plan(batch)
        padded = jnp.pad(jpx, ((0, p.rows - batch),) + ((0, 0),) * (jpx.ndim - 1))
        cases.append(BenchCase(f"{name} · server form", server(p, lambda x=padded: x)))
    return cases


@register_bench("chameleon")
def _bench(device: str, size: str) -> list[BenchCase]:
    return _mask_cases(device, size) + _tokenizer_cases(device, size)
