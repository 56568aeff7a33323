"""The loader fills a parameter that groups tensors of one shape along its first axis (a block's
norm weights and biases as one `[k, C]` parameter): a rule target `<parameter>.<r>` is row r,
`<stack>.<i>.<rest>.<r>` row r of layer i; every row must be filled, on the whole-tensor path
and on the block path alike."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import jaxsync
from jaxsync.weights import Rule, WeightError, _loader, _stream, linear, load_weights


class _Block(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(6, 6, use_bias=False, rngs=rngs)
        self.vectors = nnx.Param(jnp.zeros((3, 6)))  # norm weight, norm bias, fc bias


class _Tiny(nnx.Module):
    def __init__(self, rngs):
        self.blocks = jaxsync.LayerStack(_Block, 2, rngs=rngs)
        self.out = nnx.Param(jnp.zeros((2, 4)))  # weight, bias of a norm outside the stack


_ROWS = {"norm.weight": 0, "norm.bias": 1, "fc.bias": 2}
RULES = (
    Rule(r"blocks\.(\d+)\.fc\.weight", r"blocks.\1.fc.kernel", linear),
    *(Rule(rf"blocks\.(\d+)\.{k}", rf"blocks.\1.vectors.{r}") for k, r in _ROWS.items()),
    Rule(r"out\.weight", "out.0"),
    Rule(r"out\.bias", "out.1"),
)


def _tensors(rng):
    out = {"out.weight": rng.standard_normal(4), "out.bias": rng.standard_normal(4)}
    for i in range(2):
        out[f"blocks.{i}.fc.weight"] = rng.standard_normal((6, 6))
        out |= {f"blocks.{i}.{k}": rng.standard_normal(6) for k in _ROWS}
    return {k: v.astype(np.float32) for k, v in out.items()}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tensors = _tensors(np.random.default_rng(0))
    path = tmp_path_factory.mktemp("rows") / "model.safetensors"
    save_file(tensors, str(path))
    return str(path), tensors


def _load(path, **kw):
    module = load_weights(lambda: _Tiny(nnx.Rngs(0)), path, RULES, **kw)
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(module))}


def _check(loaded, tensors):
    np.testing.assert_array_equal(
        loaded["out"], np.stack([tensors["out.weight"], tensors["out.bias"]])
    )
    for i in range(2):
        want = np.stack([tensors[f"blocks.{i}.{k}"] for k in _ROWS])
        np.testing.assert_array_equal(np.asarray(loaded["blocks.layer.vectors"][i]), want)
        np.testing.assert_array_equal(
            np.asarray(loaded["blocks.layer.fc.kernel"][i]), tensors[f"blocks.{i}.fc.weight"].T
        )


def test_rows_fill_grouped_parameters(checkpoint):
    path, tensors = checkpoint
    _check(_load(path), tensors)


def test_the_block_path_fills_rows_as_the_whole_path(checkpoint, monkeypatch):
    path, tensors = checkpoint
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])
    rules = ((r"blocks\.layer\.vectors", ("data", "model")), (r"^out$", (None, "model")))
    whole = _load(path, mesh=mesh, partition_rules=rules)
    monkeypatch.setattr(_stream, "splits_reading", lambda p: isinstance(p, jax.sharding.Sharding))
    blocks = _load(path, mesh=mesh, partition_rules=rules)
    assert "blocks.layer.vectors" in _loader.last_load_stats().sliced
    for k, a in whole.items():
        assert a.sharding == blocks[k].sharding, k
        np.testing.assert_array_equal(np.asarray(a), np.asarray(blocks[k]), err_msg=k)
    _check(blocks, tensors)


def test_a_missing_row_is_refused_before_reading(tmp_path):
    tensors = _tensors(np.random.default_rng(1))
    del tensors["blocks.1.norm.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        WeightError, match=r"1 slice\(s\) of parameter 'blocks.layer.vectors'.*\[\(1, 1\)\]"
    ):
        _load(str(tmp_path / "model.safetensors"))


def test_a_row_and_the_whole_parameter_are_refused(tmp_path):
    tensors = _tensors(np.random.default_rng(2))
    tensors["out.all"] = np.zeros((2, 4), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightError, match="fills"):
        load_weights(
            lambda: _Tiny(nnx.Rngs(0)),
            tmp_path / "model.safetensors",
            (*RULES, Rule(r"out\.all", "out")),
        )
