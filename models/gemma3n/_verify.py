"""Registers the Gemma 3n audio path for `jaxsync verify` and its benchmark for `jaxsync bench`."""

import functools as ft
import tempfile

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsync.models.gemma3n import _reference as R
from jaxsync.models.gemma3n._config import Gemma3nAudioConfig
from jaxsync.models.gemma3n._model import Gemma3nAudioModel
from jaxsync.models.gemma3n._runtime import AudioEmbedder
from jaxsync.models.gemma3n._weights import load_audio_model
from jaxsync.registry import BenchCase, Parity, PathCase, register_bench, register_path


_FRAMES_PER_SECOND = 100  # Gemma3nAudioFeatureExtractor: 10 ms hop
_TINY_BUCKET = 64
# (lengths, frames) of the verify inputs: one (batch, frame) bucket; tower output shorter than,
# equal to and (for 60 frames with the 20/37 mask) padded up to soft_tokens.
_TINY_INPUTS = (([23, 9, 1], 23), ([57, 40, 13], 57), ([37, 37, 20], 60))


def _tiny_cfg() -> Gemma3nAudioConfig:
    # Mirrors R.TINY_HF without importing transformers (verify runs without torch too).
    a = R.TINY_HF["audio"]
    return Gemma3nAudioConfig(
        input_feat_size=a["input_feat_size"],
        hidden_size=a["hidden_size"],
        rms_norm_eps=a["rms_norm_eps"],
        conf_attention_chunk_size=a["conf_attention_chunk_size"],
        conf_attention_context_left=a["conf_attention_context_left"],
        conf_attention_context_right=a["conf_attention_context_right"],
        conf_attention_logit_cap=a["conf_attention_logit_cap"],
        conf_num_attention_heads=a["conf_num_attention_heads"],
        conf_num_hidden_layers=a["conf_num_hidden_layers"],
        conf_conv_kernel_size=a["conf_conv_kernel_size"],
        conf_reduction_factor=a["conf_reduction_factor"],
        sscp_conv_channel_size=tuple(a["sscp_conv_channel_size"]),
        sscp_conv_kernel_size=tuple(tuple(k) for k in a["sscp_conv_kernel_size"]),
        audio_vocab_size=a["vocab_size"],
        audio_vocab_offset=a["vocab_offset"],
        text_hidden_size=R.TINY_HF["text"]["hidden_size"],
        text_vocab_size=R.TINY_HF["text"]["vocab_size"],
        soft_tokens=R.TINY_HF["top"]["audio_soft_tokens_per_image"],
        audio_token_id=R.TINY_HF["top"]["audio_token_id"],
    )


def _inputs(cfg: Gemma3nAudioConfig) -> list[tuple]:
    out = []
    for lengths, frames in _TINY_INPUTS:
        feats, mask = R.mel_batch(lengths, frames, cfg.input_feat_size, seed=frames)
        out.append((feats, mask))
    return out


def _parity() -> Parity:
    from jaxsync.testing import rel_err

    ref = R.build_reference(tempfile.mkdtemp(prefix="jaxsync-gemma3n-"))
    emb = AudioEmbedder(
        load_audio_model(ref.cfg, ref.checkpoint), ref.cfg, frame_buckets=_TINY_BUCKET
    )
    worst = 0.0
    for feats, mask in _inputs(ref.cfg):
        got = np.asarray(emb(feats, mask))[: len(mask)]
        worst = max(worst, rel_err(got, R.reference_embed(ref, feats, mask)))
    return Parity(worst, 1e-5, "rel", "HF Gemma3nAudioEncoder + embed_audio + forward padding")


@register_path(
    "gemma3n.audio_embed",
    description="mel features -> audio tower -> embedder -> pad to 188 (one program)",
)
def _build(checkpoint: str | None) -> PathCase:
    if checkpoint is None:
        cfg = _tiny_cfg()
        model = Gemma3nAudioModel(cfg, rngs=nnx.Rngs(0))
        emb = AudioEmbedder(model, cfg, frame_buckets=_TINY_BUCKET)
        return PathCase(fn=emb, inputs=_inputs(cfg), parity=_parity)
    import transformers

    cfg = Gemma3nAudioConfig.from_hf_config(transformers.AutoConfig.from_pretrained(checkpoint))
    emb = AudioEmbedder(load_audio_model(cfg, checkpoint, dtype=jnp.bfloat16), cfg)
    inputs = []
    for seconds in (5, 4, 3):  # one 512-frame bucket
        feats, mask = R.mel_batch([seconds * 100], seconds * 100, cfg.input_feat_size)
        inputs.append((feats, mask))
    return PathCase(fn=emb, inputs=inputs, parity=None)


# ---------------------------------------------------------------- benchmarks


@ft.cache
def _bench_models(size: str, device: str):
    import torch

    ref = R.build_reference(tempfile.mkdtemp(prefix="jaxsync-gemma3n-bench-"), size=size)
    model = load_audio_model(ref.cfg, ref.checkpoint, dtype=jnp.bfloat16)
    ref.tower.to(device=device, dtype=torch.bfloat16)
    ref.embedder.to(device=device, dtype=torch.bfloat16)
    return ref, AudioEmbedder(model, ref.cfg)


@register_bench("gemma3n")
def _bench(device: str, size: str) -> list[BenchCase]:
    """jaxsync vs transformers eager (bf16): 1-8 clips of 5-30 s (released) or tiny frames."""
    import torch

    ref, emb = _bench_models(size, device)
    cfg = ref.cfg
    shapes = [(1, 5), (1, 30), (8, 30)] if size == "released" else [(1, 0.2), (3, 0.5)]
    cases = []
    for clips, seconds in shapes:
        frames = int(seconds * _FRAMES_PER_SECOND)
        batches = []
        for seed in range(3):  # rotated inputs, same shapes
            lengths = [max(1, frames - 37 * i) for i in range(clips)]
            batches.append(R.mel_batch(lengths, frames, cfg.input_feat_size, seed=seed))
        t_batches = [
            (torch.from_numpy(f).to(device, torch.bfloat16), torch.from_numpy(m).to(device))
            for f, m in batches
        ]
        pad_tok = torch.tensor([[cfg.text_vocab_size - 1]], dtype=torch.long, device=device)
        state = {"i": 0}

        def jax_fn(batches=batches, state=state):
            state["i"] = (state["i"] + 1) % len(batches)
            return emb(*batches[state["i"]])

        def hf_eager(t_batches=t_batches, state=state, pad_tok=pad_tok):
            feats, mask = t_batches[state["i"]]
            with torch.no_grad():  # Gemma3nModel.forward's audio part, pad recomputed per call
                out = ref.tower(feats, ~mask, return_dict=True)
                e = ref.embedder(inputs_embeds=out.last_hidden_state)
                pad = ref.embedder(input_ids=pad_tok)
                e = torch.where(out.audio_mel_mask.unsqueeze(-1), pad, e)
                b, t, d = e.shape
                n = cfg.soft_tokens
                e = e[:, :n] if t > n else torch.cat((e, pad.expand(b, n - t, d)), dim=1)
            return e

        cases.append(
            BenchCase(
                f"gemma3n.audio_embed[{size}, {clips}x{seconds}s]",
                jax_fn,
                {"transformers_eager": hf_eager},
            )
        )
    return cases
