"""Every transform checks the stored shape before it runs: a tensor in another layout with the same
element count is refused (naming key, stored and expected stored shape), never loaded scrambled."""

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jaxsync import weights
from jaxsync.weights import Rule, Transform, WeightError


class _Params(nnx.Module):
    """One float32 parameter `w` of the given shape."""

    def __init__(self, shape):
        self.w = nnx.Param(np.zeros(shape, np.float32))


def _patch_flatten(d, c, t, p):
    """Conv3d [D, C, T, p, p] -> linear kernel [C*T*p*p, D], with its inverse shape map."""
    return Transform(
        lambda w: w.reshape(w.shape[0], -1).T, lambda target: (target[1], c, t, p, p), "patch"
    )


# (transform, parameter shape, stored shape, a same-size wrong layout, numpy reference)
CASES = {
    "linear": (weights.linear, (5, 7), (7, 5), (5, 7), lambda w: w.T),
    "conv1d": (weights.conv(1), (3, 5, 7), (7, 5, 3), (7, 3, 5), lambda w: w.transpose(2, 1, 0)),
    "conv1d-flattened": (weights.conv(1), (3, 5, 7), (7, 5, 3), (7, 15), None),
    "conv2d": (
        weights.conv(2),
        (3, 2, 5, 7),
        (7, 5, 3, 2),
        (7, 5, 2, 3),
        lambda w: w.transpose(2, 3, 1, 0),
    ),
    "conv3d-C-T-swapped": (
        weights.conv(3),
        (2, 3, 3, 5, 7),  # [T, p, p, C, O]
        (7, 5, 2, 3, 3),  # [O, C, T, p, p]
        (7, 2, 5, 3, 3),  # C and T swapped
        lambda w: w.transpose(2, 3, 4, 1, 0),
    ),
    "transpose": (
        weights.transpose(2, 0, 1),
        (3, 5, 7),
        (5, 7, 3),
        (3, 5, 7),
        lambda w: w.transpose(2, 0, 1),
    ),
    "reshape": (
        weights.reshape(3, 5, 7, stored=(15, 7)),
        (3, 5, 7),
        (15, 7),
        (7, 15),
        lambda w: w.reshape(3, 5, 7),
    ),
    "compose": (  # torch's [D, C*F] flattening -> [C, F, D]
        weights.compose(weights.linear, weights.reshape(3, 5, 7, stored=(15, 7))),
        (3, 5, 7),
        (7, 15),
        (15, 7),
        lambda w: w.T.reshape(3, 5, 7),
    ),
    "custom-conv3d-patch": (
        _patch_flatten(7, 5, 2, 3),
        (90, 7),
        (7, 5, 2, 3, 3),
        (7, 2, 5, 3, 3),  # C and T swapped: same element count, same flattened size
        lambda w: w.reshape(7, -1).T,
    ),
    "compose-conv3d-patch": (
        weights.compose(weights.reshape(7, 90, stored=(7, 5, 2, 3, 3)), weights.linear),
        (90, 7),
        (7, 5, 2, 3, 3),
        (7, 2, 5, 3, 3),
        lambda w: w.reshape(7, -1).T,
    ),
}


def _save(tmp_path, shape, seed=0):
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    save_file({"w": w}, tmp_path / "m.safetensors")
    return tmp_path / "m.safetensors", w


def _load(path, transform, shape):
    return weights.load_weights(lambda: _Params(shape), path, [Rule("w", "w", transform)])


@pytest.mark.parametrize("name", [k for k, v in CASES.items() if v[4] is not None])
def test_right_layout_loads(tmp_path, name):
    transform, shape, stored, _, reference = CASES[name]
    path, w = _save(tmp_path, stored)
    np.testing.assert_array_equal(np.asarray(_load(path, transform, shape).w[...]), reference(w))


@pytest.mark.parametrize("name", list(CASES))
def test_wrong_layout_is_refused_before_reading(tmp_path, name, monkeypatch):
    transform, shape, stored, wrong, _ = CASES[name]
    path, _ = _save(tmp_path, wrong)
    reads = []
    monkeypatch.setattr("jaxsync.weights._stream.read_tensor", lambda *a: reads.append(a) or 1 / 0)
    message = f"'w'.*stored shape {wrong}.*expects stored shape {stored}"
    with pytest.raises(WeightError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _load(path, transform, shape)
    assert reads == []  # refused from the header alone


def test_transform_that_does_not_fit_the_parameter(tmp_path):
    path, _ = _save(tmp_path, (5, 7, 3))
    with pytest.raises(WeightError, match="linear maps onto 2-D parameters"):
        _load(path, weights.linear, (3, 7, 5))
    with pytest.raises(WeightError, match=r"conv2d maps onto 4-D parameters, not shape \(3, 7, 5"):
        _load(path, weights.conv(2), (3, 7, 5))


def test_plain_callable_is_checked_after_transform(tmp_path):
    # Without an inverse shape map only the result is checked (abstractly, still before reading).
    path, w = _save(tmp_path, (7, 5))
    net = _load(path, lambda x: x.T * 2, (5, 7))
    np.testing.assert_array_equal(np.asarray(net.w[...]), w.T * 2)
    with pytest.raises(
        WeightError,
        match=r"shape \(7, 5\) \(after transform of stored \(7, 5\)\) but the module expects "
        r"\(5, 7\)",
    ):
        _load(path, lambda x: x, (5, 7))


def test_transform_arguments_are_validated():
    with pytest.raises(ValueError, match="not a permutation"):
        weights.transpose(0, 0, 1)
    with pytest.raises(ValueError, match="another element count"):
        weights.reshape(3, 5, stored=(4, 4))


def test_custom_inverse_map_that_disagrees_with_its_transform(tmp_path):
    path, _ = _save(tmp_path, (7, 5))
    liar = Transform(lambda w: w, lambda target: (target[1], target[0]), "liar")
    with pytest.raises(WeightError, match=r"shape \(7, 5\) \(after transform"):
        _load(path, liar, (5, 7))
