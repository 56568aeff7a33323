"""Gemma 3n audio path at the released audio config (random weights) on an accelerator."""

import jax
import numpy as np
import pytest

from jaxsync.models.gemma3n import AudioEmbedder, _reference as R, load_audio_model
from jaxsync.testing import rel_err, requires_torch


pytestmark = [requires_torch, pytest.mark.gpu]


def test_released_config_fp32_parity(tmp_path):
    import torch

    if jax.default_backend() == "cpu" or not torch.cuda.is_available():
        pytest.skip("needs a GPU for torch and jax")
    torch.backends.cudnn.allow_tf32 = False  # fp32 reference: no TF32 convolutions
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = R.build_reference(tmp_path, size="released")
    emb = AudioEmbedder(load_audio_model(ref.cfg, ref.checkpoint), ref.cfg)
    ref.tower.cuda(), ref.embedder.cuda()
    worst = 0.0
    for lengths, frames in (([3000], 3000), ([500, 1700], 1700)):  # 30 s; 5 s + 17 s
        feats, mask = R.mel_batch(lengths, frames, ref.cfg.input_feat_size, seed=frames)
        got = np.asarray(emb(feats, mask))[: len(lengths)]
        worst = max(worst, rel_err(got, R.reference_embed(ref, feats, mask)))
    print(f"released fp32 max rel err {worst:.2e}")
    assert worst <= 1e-5
