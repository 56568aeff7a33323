"""Layout transforms are written once, through numpy views, into the parameter's buffer: every
transform of the library and the families is recognised as a chain of reshapes and transposes,
and the written tensor equals the transform's own result bit for bit, cast included. A transform
that is not such a chain runs as written."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jaxsync import weights
from jaxsync.models.gemma3n._weights import GLU_PAIRS
from jaxsync.models.glm4v._config import Glm4vVisionConfig
from jaxsync.models.glm4v._weights import _flat_block, _flat_patch, _head_major_qkv
from jaxsync.weights import Rule, compose, conv, linear, reshape, transpose
from jaxsync.weights._views import copy_tiled, view_chain, write


_GLM = Glm4vVisionConfig(num_heads=4, hidden_size=192)  # head_dim 48

CASES = {  # name -> (transform, stored shape): large ones are copied in tiles
    "linear": (linear, (1536, 1000)),
    "linear_small": (linear, (7, 5)),
    "conv1d": (conv(1), (96, 1, 5)),
    "conv2d": (conv(2), (640, 128, 3, 3)),
    "transpose": (transpose(2, 0, 1), (33, 130, 70)),
    "compose": (compose(linear, reshape(500, 2, 768, stored=(1000, 768))), (768, 1000)),
    "head_major": (_head_major_qkv(_GLM, bias=False), (3 * 192, 1100)),
    "head_major_bias": (_head_major_qkv(_GLM, bias=True), (3 * 192,)),
    "glu_pairs": (GLU_PAIRS, (1536, 768)),
    "flat_block": (_flat_block(_GLM), (1000, 192, 2, 2)),
    "flat_patch": (_flat_patch(_GLM), (192, 3, 2, 14, 14)),
    "plain_callable": (lambda w: w.T, (300, 900)),
}


def _raw(shape, dtype):
    rng = np.random.default_rng(0)
    bits = 8 * np.dtype(dtype).itemsize
    return rng.integers(0, 2**bits - 1, shape, dtype=f"u{bits // 8}").view(dtype)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize(
    "stored, param",
    [
        (ml_dtypes.bfloat16, ml_dtypes.bfloat16),
        (np.float32, np.float32),
        (np.float32, ml_dtypes.bfloat16),
        (ml_dtypes.bfloat16, np.float32),
    ],
)
def test_written_equals_the_transform_bit_for_bit(name, stored, param):
    transform, shape = CASES[name]
    raw = _raw(shape, stored)
    ops = view_chain(transform, shape, raw.dtype)
    assert ops is not None, name
    dst = np.full(np.shape(transform(raw)), 7, param)
    with np.errstate(invalid="ignore"):  # random bits: NaN payloads cast as astype casts them
        expected = np.asarray(transform(raw)).astype(param)
        write(dst, raw, ops)
    unsigned = f"u{np.dtype(param).itemsize}"
    np.testing.assert_array_equal(dst.view(unsigned), expected.view(unsigned))


@pytest.mark.parametrize("transform", [lambda w: w * 2, lambda w: w[::-1], lambda w: w.astype(int)])
def test_a_transform_that_is_not_a_chain_is_not_taken_for_one(transform):
    assert view_chain(transform, (4, 6), np.float32) is None


def test_a_strided_destination_gets_the_same_values():
    transform, shape = CASES["head_major"]
    raw = _raw(shape, np.float32)
    expected = np.asarray(transform(raw))
    dst = np.zeros((expected.shape[0], 2 * expected.shape[1]), np.float32)[:, ::2]
    write(dst, raw, view_chain(transform, shape, raw.dtype))
    np.testing.assert_array_equal(dst.view(np.uint32), expected.view(np.uint32))


def test_tiles_cover_odd_sizes():
    src = _raw((1031, 517, 3), np.float32).transpose(1, 0, 2)
    dst = np.zeros(src.shape, np.float32)
    copy_tiled(dst, src)
    np.testing.assert_array_equal(dst, src)


class _Net(nnx.Module):
    def __init__(self, *, layers=3, dtype=jnp.float32):
        self.scale = nnx.Param(jnp.zeros((8, 6), dtype))
        self.double = nnx.Param(jnp.zeros((6, 8), jnp.float32))
        self.stack = nnx.Param(jnp.zeros((layers, 6, 8), jnp.float32))


def test_other_transforms_and_double_casts_load_as_written(tmp_path):
    """A transform that changes values runs as written; a tensor cast to `dtype` and stored
    into a parameter declared in another dtype goes through both casts, whole or per row."""
    rng = np.random.default_rng(1)
    tensors = {
        "scale": rng.standard_normal((6, 8)).astype(np.float32),
        "double": rng.standard_normal((8, 6)).astype(np.float32),
        **{f"stack.{i}": rng.standard_normal((8, 6)).astype(np.float32) for i in range(3)},
    }
    path = tmp_path / "w.safetensors"
    save_file(tensors, path)
    doubled = weights.Transform(lambda w: w.T * 2, lambda s: (s[1], s[0]), "doubled")
    rules = [
        Rule(r"scale", "scale", doubled),
        Rule(r"double", "double", linear),
        Rule(r"stack\.(\d)", r"stack.\1", linear),
    ]
    model = weights.load_weights(lambda: _Net(dtype=jnp.bfloat16), path, rules, dtype=jnp.bfloat16)
    bf16 = ml_dtypes.bfloat16
    np.testing.assert_array_equal(
        np.asarray(model.scale[...]), (tensors["scale"].T * 2).astype(bf16)
    )
    assert model.double[...].dtype == jnp.bfloat16  # whole: stored at the cast dtype
    np.testing.assert_array_equal(np.asarray(model.double[...]), tensors["double"].T.astype(bf16))
    rows = np.stack([tensors[f"stack.{i}"].T for i in range(3)])
    assert model.stack[...].dtype == jnp.float32  # per row: cast, then the parameter's dtype
    twice = rows.astype(bf16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(model.stack[...]), twice)
