"""The cache-key rule: every key covers every check a repeated call skips.

For each family: a first call passes (and keeps its call), then a repeated call that breaks one
check is still refused with the documented error: another dtype, another shape, metadata that
fails its checks, a deleted (donated) input, an input on other devices, and, for host data, a
NaN on a plan-cache hit. The negative control builds an entry whose key omits a field its checks
read (a lying `reads` declaration) and shows the bad repeat then gets through.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsync
from jaxsync._calls import CallCache, reads


def _glm4v():
    from jaxsync.harness.paths.glm4v import reference as ref
    from jaxsync.models import glm4v

    cfg = glm4v.Glm4vVisionConfig(**{**ref.TINY, "depth": 1})
    enc = glm4v.Glm4vVisionEncoder(glm4v.Glm4vVisionTower(cfg, rngs=nnx.Rngs(0)))
    grid = [[1, 4, 6], [1, 6, 6]]
    x = jnp.zeros((enc.plan(grid).padded_patches, cfg.patch_dim), jnp.float32)
    host = np.zeros((60, cfg.patch_dim), np.float32)
    return enc, enc, x, grid, [[1, 4, 6], [1, 6, 5]], host  # h not a multiple of the merge


def _qwen3_omni():
    from jaxsync.harness.paths.qwen3_omni import reference as ref
    from jaxsync.models import qwen3_omni as q3

    cfg = q3.Qwen3OmniAudioConfig(**{**ref.TINY.__dict__, "encoder_layers": 1})
    enc = q3.Qwen3OmniAudioEncoder(q3.Qwen3OmniAudioTower(cfg, rngs=nnx.Rngs(0)))
    lens = [120, 0, 31]
    host = np.asarray(q3.pad_features(ref.random_features(cfg, lens), lens), np.float32)
    return enc, enc, jaxsync.async_h2d(host), lens, [120, 0, -1], host


def _gemma3n():
    from jaxsync.harness.paths.gemma3n import reference as ref
    from jaxsync.models.gemma3n import Gemma3nAudioEncoder, Gemma3nAudioModel

    cfg = dataclasses.replace(ref.tiny_config(), conf_num_hidden_layers=2)
    enc = Gemma3nAudioEncoder(Gemma3nAudioModel(cfg, rngs=nnx.Rngs(0)))
    mask = np.arange(57)[None, :] < np.array([57, 40, 13])[:, None]
    empty = mask.copy()
    empty[2] = False  # a clip without a real frame
    host = np.zeros((3, 57, cfg.input_feat_size), np.float32)
    return enc, enc, jnp.asarray(host), mask, empty, host


def _voxtral():
    from jaxsync.harness.paths.voxtral import reference as ref
    from jaxsync.models import voxtral

    cfg = voxtral.VoxtralAudioConfig(**{**ref.TINY_ENCODER, "num_hidden_layers": 1})
    enc = voxtral.VoxtralAudioEncoder(voxtral.VoxtralAudioTower(cfg, rngs=nnx.Rngs(0)))
    host = np.zeros((4, cfg.num_mel_bins, cfg.chunk_frames), np.float32)

    def call(x, chunks):
        return enc(input_features=x, num_chunks=chunks)

    return enc, call, jnp.asarray(host), [1, 3], [3, 2], host  # 5 windows for 4 rows


def _chameleon():
    from jaxsync.harness.paths.chameleon import reference as ref
    from jaxsync.models import chameleon

    cfg = chameleon.ChameleonConfig.from_hf_config(ref.tiny_hf_config(num_res_blocks=1))
    tower = chameleon.ChameleonImageTower(cfg, rngs=nnx.Rngs(0))
    enc = chameleon.ChameleonImageEncoder(tower, buckets=(4,))
    host = np.zeros((4, *enc.image_shape), np.float32)

    def call(x, _):
        return enc(x)

    return enc, call, jnp.asarray(host), None, None, host


FAMILIES = {
    "glm4v": _glm4v,
    "qwen3_omni": _qwen3_omni,
    "gemma3n": _gemma3n,
    "voxtral": _voxtral,
    "chameleon": _chameleon,
}


def _wider(x: jax.Array) -> jax.Array:
    """The same input with one more value on its last axis (a shape its checks refuse)."""
    return jnp.concatenate([x, x[..., :1]], axis=-1)


FLOAT = "floating|dtype|float32"  # each family's words for a non-float input
BREAKS = {
    "dtype": (lambda x, meta, bad: (x.astype(jnp.int32), meta), TypeError, FLOAT),
    "shape": (lambda x, meta, bad: (_wider(x), meta), ValueError, None),
    "metadata": (lambda x, meta, bad: (x, bad), ValueError, None),
    "placement": (
        lambda x, meta, bad: (jax.device_put(x, jax.devices()[1]), meta),
        ValueError,
        "devices",
    ),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return request.param, FAMILIES[request.param]()


@pytest.mark.parametrize("broken", sorted(BREAKS))
def test_a_kept_call_does_not_skip_a_check_its_key_misses(family, broken):
    name, (_, call, x, meta, bad, _) = family
    if broken == "metadata" and meta is None:
        pytest.skip(f"{name}'s entry takes no host metadata")
    jax.block_until_ready(call(x, meta))
    jax.block_until_ready(call(x, meta))  # the kept call
    change, error, match = BREAKS[broken]
    with pytest.raises(error, match=match):
        call(*change(x, meta, bad))


def test_a_kept_call_refuses_a_deleted_input(family):
    name, (_, call, x, meta, _, _) = family
    x = x + 0  # an array of this test's own
    jax.block_until_ready(call(x, meta))
    x.delete()
    with pytest.raises(ValueError, match="deleted"):
        call(x, meta)


def test_a_known_host_plan_still_refuses_nan(family):
    name, (_, call, _, meta, _, host) = family
    jax.block_until_ready(call(host, meta))
    poisoned = host.copy()
    poisoned[(0,) * poisoned.ndim] = np.nan
    with pytest.raises(ValueError, match="NaN|finite|inf"):
        call(poisoned, meta)


def test_negative_control_a_key_that_omits_a_checked_field_lets_the_bad_repeat_through():
    # glm4v's checks read the pixels' dtype; an entry whose declarations leave it out keys
    # without it, so a repeat in another dtype hits the call kept for float32.
    enc, call, x, grid, _, _ = _glm4v()
    lying = reads("shape", "sharding", "live")(lambda x: None)
    enc._entry.calls = enc._calls = CallCache(checks=[lying])
    jax.block_until_ready(call(x, grid))
    ints = x.astype(jnp.int32)
    out = call(ints, grid)  # not refused: the call kept for float32 pixels ran
    assert out.embeddings.shape[0] > 0
    # the honest entry refuses the same repeat
    _, honest, *_ = _glm4v()
    jax.block_until_ready(honest(x, grid))
    with pytest.raises(TypeError, match="floating"):
        honest(ints, grid)


def test_a_check_without_a_declaration_is_refused():
    with pytest.raises(TypeError, match="reads"):
        CallCache(checks=[lambda x: None])
    with pytest.raises(ValueError, match="no key covers"):
        reads("values")
