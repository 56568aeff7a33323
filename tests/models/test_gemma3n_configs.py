"""Gemma 3n audio path vs transformers at configs the other tests leave out, through our loader.

Each variant changes the tiny config where a generic code path could go wrong: time strides
other than 2 (the mask gather and the bucketed frame count), one-frame chunks without context,
no reduction, no conformer layer, head dim 1, one mel bin, a one-row audio vocabulary, active
activation clipping and logit caps, large norm eps, wide left and right contexts.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsync.harness.paths.gemma3n import reference as R
from jaxsync.models.gemma3n import Gemma3nAudioEncoder, Gemma3nBuckets, forward, load_model, plan
from jaxsync.testing import rel_err, requires_torch


pytestmark = requires_torch

FP32_TOL = 1e-5
BUCKET = 32  # frames: every clip below fits one bucket
SOFT_TOKENS = 12  # above every variant's tower length for <= 32 frames

VARIANTS = {
    "time_strides_3_1": dict(
        audio=dict(
            sscp_conv_stride_size=[[3, 1], [1, 3]],
            sscp_conv_kernel_size=[[2, 4], [4, 2]],
            conf_reduction_factor=1,
            conf_attention_chunk_size=1,
            conf_attention_context_left=0,
            conf_attention_context_right=0,
        )
    ),
    "no_layers_head_dim_1": dict(
        audio=dict(
            hidden_size=4,
            conf_num_attention_heads=4,
            conf_num_hidden_layers=0,
            input_feat_size=1,
            sscp_conv_channel_size=[1, 1],
            vocab_size=1,
            vocab_offset=46,
        )
    ),
    "clipped_wide_context": dict(
        audio=dict(
            gradient_clipping=2.0,  # clamps some activations; 0.5 makes fp32 itself unstable
            conf_attention_logit_cap=0.5,
            rms_norm_eps=0.3,
            sscp_conv_group_norm_eps=0.5,
            conf_residual_weight=1.7,
            conf_conv_kernel_size=1,
            conf_attention_chunk_size=7,
            conf_attention_context_left=13,
            conf_attention_context_right=7,
            conf_num_hidden_layers=3,
            conf_reduction_factor=5,
        ),
        text=dict(hidden_size=64),
    ),
}


def _frames_for(cfg, t_sub: int) -> int:
    """The fewest input frames whose subsampled length is `t_sub`."""
    return next(f for f in range(1, 4 * BUCKET) if cfg.num_subsampled(f) >= t_sub)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def setup(request, tmp_path_factory):
    variant = {**VARIANTS[request.param], "top": dict(audio_soft_tokens_per_image=SOFT_TOKENS)}
    ref = R.build_reference(tmp_path_factory.mktemp(request.param), variant=variant)
    return ref, load_model(ref.checkpoint, ref.cfg)


def _mixed(cfg):
    """Clips ending exactly at a chunk boundary, one frame past it, a 1-frame clip, and the
    longest, whose padding (non-zero, as upstream passes it) ends every other clip."""
    at = _frames_for(cfg, cfg.conf_attention_chunk_size)
    lengths = [at, at + 1, 1, BUCKET - 3]
    feats, mask = R.mel_batch(lengths, max(lengths), cfg.input_feat_size, seed=at)
    noise = np.random.default_rng(at).standard_normal(feats.shape).astype(np.float32)
    return np.where(mask[:, :, None], feats, noise), mask


def test_host_and_device_features(setup):
    ref, model = setup
    cfg = ref.cfg
    enc = Gemma3nAudioEncoder(model, frame_buckets=BUCKET)
    feats, mask = _mixed(cfg)
    want = R.reference_embed(ref, feats, mask)
    assert rel_err(R.per_clip(enc(feats, mask)), want) <= FP32_TOL
    assert rel_err(R.per_clip(enc(jnp.asarray(feats), mask)), want) <= FP32_TOL
    one, one_mask = R.mel_batch([1], 1, cfg.input_feat_size, seed=1)
    assert rel_err(R.per_clip(enc(one, one_mask)), R.reference_embed(ref, one, one_mask)) <= (
        FP32_TOL
    )


def test_pure_forward(setup):
    ref, model = setup
    cfg = ref.cfg
    feats, mask = _mixed(cfg)
    p = plan(mask, cfg, buckets=Gemma3nBuckets(frames=BUCKET))
    x = np.zeros((p.batch, p.frame_bucket, cfg.input_feat_size), np.float32)
    x[: feats.shape[0], : feats.shape[1]] = feats
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, x, meta):
        return forward(nnx.merge(graphdef, state), x, meta)

    rows = step(state, jnp.asarray(x), jax.tree.map(jnp.asarray, p.meta)).rows
    got = np.asarray(rows)[: len(mask) * SOFT_TOKENS].reshape(len(mask), SOFT_TOKENS, -1)
    assert rel_err(got, R.reference_embed(ref, feats, mask)) <= FP32_TOL
