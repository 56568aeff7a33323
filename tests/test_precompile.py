"""`jaxsync.precompile` of a server's own encoders: every bucket compiled ahead of serving, so
calls in those buckets compile nothing; bad buckets and non-encoders refused before any compile."""

import numpy as np
import pytest
from flax import nnx

import jaxsync
from jaxsync.check import count_compiles, no_recompile


def _glm4v():
    from jaxsync.harness.paths.glm4v import reference as ref
    from jaxsync.models.glm4v import Glm4vVisionConfig, Glm4vVisionEncoder, Glm4vVisionTower

    return Glm4vVisionEncoder(Glm4vVisionTower(Glm4vVisionConfig(**ref.TINY), rngs=nnx.Rngs(0)))


def test_precompiled_encoder_serves_its_buckets_without_compiling():
    from jaxsync.harness.paths.glm4v import reference as ref

    enc = _glm4v()
    done = jaxsync.precompile([enc], buckets=[24, 32, 48], progress=False)
    name = "Glm4vVisionEncoder"
    assert [(c.path, c.bucket) for c in done] == [(name, 24), (name, 32), (name, 48)]
    grids = [[[1, 6, 14]], [[1, 8, 12]], [[1, 10, 14]], [[1, 4, 20]], [[2, 6, 8]], [[1, 8, 24]]]
    inputs = [(ref.pixels(g, enc.cfg, seed=i), g) for i, g in enumerate(grids)]  # 21..48 tokens
    with no_recompile():
        for px, g in inputs:
            enc(px, g)


def test_one_encoder_alone_and_its_progress_bar(capsys):
    enc = _glm4v()
    done = jaxsync.precompile(enc, buckets=[8, 12])
    assert [c.bucket for c in done] == [8, 12]
    assert "precompile 2/2 [###" in capsys.readouterr().err


def _qwen3_omni():
    from jaxsync.harness.paths.qwen3_omni import reference as ref
    from jaxsync.models.qwen3_omni import Qwen3OmniAudioEncoder, Qwen3OmniAudioTower

    enc = Qwen3OmniAudioEncoder(Qwen3OmniAudioTower(ref.TINY, rngs=nnx.Rngs(0)))
    b = enc.buckets.frames[0]
    return enc, b, lambda: enc(np.ones((enc.cfg.num_mel_bins, b), np.float32), [b])


def _gemma3n():
    from jaxsync.harness.paths.gemma3n import reference as ref
    from jaxsync.models.gemma3n import Gemma3nAudioEncoder, Gemma3nAudioModel

    cfg = ref.tiny_config()
    enc = Gemma3nAudioEncoder(Gemma3nAudioModel(cfg, rngs=nnx.Rngs(0)), frame_buckets=64)
    feats = np.ones((1, 57, cfg.input_feat_size), np.float32)
    return enc, 64, lambda: enc(feats, np.ones((1, 57), bool))


def _voxtral():
    from jaxsync.harness.paths.voxtral.verify import _tiny_random  # random weights, no torch

    enc = _tiny_random()
    feats = np.ones((2, enc.cfg.num_mel_bins, enc.cfg.chunk_frames), np.float32)
    return enc, 2, lambda: enc(input_features=feats)


def _chameleon():
    from jaxsync.harness.paths.chameleon import reference as ref
    from jaxsync.models.chameleon import ChameleonImageEncoder

    enc = ChameleonImageEncoder(ref.tiny_tower(), buckets=(4,))
    return enc, 4, lambda: enc(np.zeros((3, *enc.image_shape), np.float32))


@pytest.mark.parametrize("build", [_qwen3_omni, _gemma3n, _voxtral, _chameleon])
def test_every_family_encoder_precompiles(build):
    enc, bucket, call = build()
    (done,) = jaxsync.precompile([enc], buckets=[bucket], progress=False)
    assert done.path == type(enc).__name__ and done.bucket == bucket
    with no_recompile():
        call()


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (dict(buckets=[25]), ValueError, "not one of Glm4vVisionEncoder's token buckets"),
        (dict(buckets=[24, 0]), ValueError, "positive"),
        (dict(buckets=[]), ValueError, "positive"),
        (dict(buckets=[24, 2.0]), TypeError, "integers"),
        (dict(buckets=[True]), TypeError, "integers"),
        (dict(buckets=24), TypeError, "sequence"),
    ],
)
def test_bad_buckets_are_refused_before_any_compile(args, error, match):
    enc = _glm4v()
    with count_compiles() as log, pytest.raises(error, match=match):
        jaxsync.precompile([enc], progress=False, **args)
    assert log.count == 0, log


@pytest.mark.parametrize(
    ("second", "match"),
    [
        (object(), "got object"),
        ("glm4v.vision_tower", "jaxsync precompile --paths"),
        (lambda x: x, "got function"),
    ],
)
def test_a_non_encoder_is_refused_before_any_compile(second, match):
    enc = _glm4v()  # valid, and first: still nothing of it compiles
    with count_compiles() as log, pytest.raises(TypeError, match=match):
        jaxsync.precompile([enc, second], buckets=[24], progress=False)
    assert log.count == 0, log
    with pytest.raises(ValueError, match="at least one"):
        jaxsync.precompile([], progress=False)


def test_an_encoder_without_default_buckets_needs_them():
    enc, _, _ = _gemma3n()  # frame_buckets=64: a granularity, no list of buckets
    with count_compiles() as log, pytest.raises(ValueError, match="no default buckets"):
        jaxsync.precompile([enc], progress=False)
    with pytest.raises(ValueError, match="multiple of"):
        jaxsync.precompile([enc], buckets=[100], progress=False)
    assert log.count == 0, log
