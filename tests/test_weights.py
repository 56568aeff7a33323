"""The strict safetensors loader: happy path, sharded checkpoints, and every error it promises."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors.numpy import save_file

from jaxsync import weights
from jaxsync.testing import device_mesh
from jaxsync.weights import Rule, WeightError


class _Block(nnx.Module):
    def __init__(self, *, rngs, param_dtype):
        self.proj = nnx.Linear(5, 7, rngs=rngs, param_dtype=param_dtype)
        self.conv = nnx.Conv(3, 11, kernel_size=(3, 2), rngs=rngs, param_dtype=param_dtype)


class _Net(nnx.Module):
    def __init__(self, rngs=None, param_dtype=jnp.float32):
        rngs = rngs or nnx.Rngs(0)
        self.blocks = nnx.List([_Block(rngs=rngs, param_dtype=param_dtype) for _ in range(2)])
        self.scale = nnx.Param(jnp.zeros((13,), param_dtype))


RULES = [
    Rule(r"layers\.(\d+)\.fc\.weight", r"blocks.\1.proj.kernel", weights.linear),
    Rule(r"layers\.(\d+)\.fc\.bias", r"blocks.\1.proj.bias"),
    Rule(r"layers\.(\d+)\.conv\.weight", r"blocks.\1.conv.kernel", weights.conv(2)),
    Rule(r"layers\.(\d+)\.conv\.bias", r"blocks.\1.conv.bias"),
    Rule(r"scale", "scale"),
]


def _torch_like_state(rng, dtype=np.float32):
    state = {"model.scale": rng.standard_normal(13)}
    for i in range(2):
        state[f"model.layers.{i}.fc.weight"] = rng.standard_normal((7, 5))  # torch [out, in]
        state[f"model.layers.{i}.fc.bias"] = rng.standard_normal(7)
        state[f"model.layers.{i}.conv.weight"] = rng.standard_normal(
            (11, 3, 3, 2)
        )  # [O, I, kh, kw]
        state[f"model.layers.{i}.conv.bias"] = rng.standard_normal(11)
    state["lm_head.weight"] = rng.standard_normal((3, 3))  # belongs to another module
    return {k: v.astype(dtype) for k, v in state.items()}


def _load(path, factory=_Net, **kw):
    kw.setdefault("select", r"model\.")
    kw.setdefault("strip", "model.")
    return weights.load_weights(factory, path, RULES, **kw)


def test_loads_and_transforms(tmp_path):
    state = _torch_like_state(np.random.default_rng(0))
    save_file(state, tmp_path / "model.safetensors")
    net = _load(tmp_path / "model.safetensors")
    np.testing.assert_array_equal(
        net.blocks[1].proj.kernel[...], state["model.layers.1.fc.weight"].T
    )
    np.testing.assert_array_equal(
        net.blocks[0].conv.kernel[...], state["model.layers.0.conv.weight"].transpose(2, 3, 1, 0)
    )
    # The loaded module computes what torch would: y = x W^T + b.
    x = np.random.default_rng(1).standard_normal((4, 5)).astype(np.float32)
    want = x @ state["model.layers.0.fc.weight"].T + state["model.layers.0.fc.bias"]
    np.testing.assert_allclose(np.asarray(net.blocks[0].proj(jnp.asarray(x))), want, rtol=1e-5)


def test_sharded_index_and_directory(tmp_path):
    state = _torch_like_state(np.random.default_rng(0))
    keys = sorted(state)
    half = len(keys) // 2
    parts = {"a.safetensors": keys[:half], "b.safetensors": keys[half:]}
    for fname, ks in parts.items():
        save_file({k: state[k] for k in ks}, tmp_path / fname)
    index = {"weight_map": {k: f for f, ks in parts.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    for source in (tmp_path / "model.safetensors.index.json", tmp_path):
        net = _load(source)
        np.testing.assert_array_equal(net.scale[...], state["model.scale"])


def test_bf16_checkpoint_and_cast(tmp_path):
    import ml_dtypes

    state = _torch_like_state(np.random.default_rng(0), ml_dtypes.bfloat16)
    save_file(state, tmp_path / "m.safetensors")
    with pytest.raises(WeightError, match="dtype bfloat16 but the module expects float32"):
        _load(tmp_path / "m.safetensors")
    net = _load(tmp_path / "m.safetensors", allow_cast=True)
    assert net.scale[...].dtype == jnp.float32


def test_dtype_policy(tmp_path):
    import ml_dtypes

    state = _torch_like_state(np.random.default_rng(0), ml_dtypes.bfloat16)
    save_file(state, tmp_path / "m.safetensors")
    # A module built at the checkpoint's dtype loads with no flag, bit for bit.
    assert weights.checkpoint_dtype(tmp_path / "m.safetensors") == jnp.bfloat16
    net = _load(tmp_path / "m.safetensors", lambda: _Net(param_dtype=jnp.bfloat16))
    assert net.scale[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(net.scale[...]), state["model.scale"])
    # An explicit dtype is the consent to cast: bf16 -> fp32 without allow_cast.
    net = _load(tmp_path / "m.safetensors", dtype=jnp.float32)
    assert net.blocks[0].proj.kernel[...].dtype == jnp.float32
    want = state["model.layers.0.fc.weight"].astype(np.float32).T
    np.testing.assert_array_equal(np.asarray(net.blocks[0].proj.kernel[...]), want)
    # ... and fp32 -> bf16 the other way.
    save_file(_torch_like_state(np.random.default_rng(0)), tmp_path / "f.safetensors")
    net = _load(tmp_path / "f.safetensors", dtype=jnp.bfloat16)
    assert {np.asarray(v).dtype for v in weights.to_numpy_state(net).values()} == {
        np.dtype(ml_dtypes.bfloat16)
    }


def test_dtype_never_casts_integers(tmp_path):
    state = _torch_like_state(np.random.default_rng(0))
    state["model.scale"] = np.zeros(13, np.int32)
    save_file(state, tmp_path / "m.safetensors")
    for kw in ({"dtype": jnp.float32}, {"allow_cast": True}):
        with pytest.raises(WeightError, match="dtype int32 but the module expects float32"):
            _load(tmp_path / "m.safetensors", **kw)


def test_checkpoint_dtype_reads_selected_floats(tmp_path):
    import ml_dtypes

    state = _torch_like_state(np.random.default_rng(0), ml_dtypes.bfloat16)
    state["lm_head.weight"] = state["lm_head.weight"].astype(np.float32)
    state["model.step"] = np.zeros((), np.int64)  # integers do not vote
    save_file(state, tmp_path / "m.safetensors")
    got = weights.checkpoint_dtype(tmp_path / "m.safetensors", select=r"model\.", strip="model.")
    assert got == jnp.bfloat16
    with pytest.raises(WeightError, match=r"one float dtype.*\['bfloat16', 'float32'\]"):
        weights.checkpoint_dtype(tmp_path / "m.safetensors")
    with pytest.raises(WeightError, match="found none"):
        weights.checkpoint_dtype(tmp_path / "m.safetensors", select=r"model\.step")


def test_sharding_per_parameter(tmp_path):
    save_file(_torch_like_state(np.random.default_rng(0)), tmp_path / "m.safetensors")
    mesh = device_mesh("x")  # 8 CPU devices in CI, every GPU (up to 8) on a multi-GPU machine

    def shard(path, shape):
        return NamedSharding(mesh, P("x")) if path == "blocks.0.conv.bias" else None

    with pytest.raises(ValueError):  # 11 (prime) splits over no mesh of 2+: JAX refuses, loudly
        _load(tmp_path / "m.safetensors", sharding=shard)

    def replicate(path, shape):
        return NamedSharding(mesh, P())

    net = _load(tmp_path / "m.safetensors", sharding=replicate)
    assert len(net.scale[...].devices()) == mesh.size


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda s: s.update({"model.layers.0.extra": s["model.scale"]}), "matches no mapping rule"),
        (
            lambda s: s.pop("model.layers.1.conv.bias"),
            r"not in the checkpoint: \['blocks.1.conv.bias'\]",
        ),
        (lambda s: s.update({"model.scale": np.zeros(12, np.float32)}), r"shape \(12,\)"),
        (lambda s: s.update({"model.scale": np.zeros(13, np.int32)}), "dtype int32"),
        (
            lambda s: s.update({"model.layers.7.fc.bias": s["model.scale"]}),
            "not a module parameter",
        ),
    ],
    ids=["unknown-key", "missing-param", "shape", "dtype", "bad-target"],
)
def test_strict_errors_name_the_key(tmp_path, mutate, message):
    state = _torch_like_state(np.random.default_rng(0))
    mutate(state)
    save_file(state, tmp_path / "m.safetensors")
    with pytest.raises(WeightError, match=message):
        _load(tmp_path / "m.safetensors")


def test_two_keys_one_target_and_missing_file(tmp_path):
    state = _torch_like_state(np.random.default_rng(0))
    state["model.alias"] = state["model.scale"]
    save_file(state, tmp_path / "m.safetensors")
    rules = [*RULES, Rule("alias", "scale")]
    with pytest.raises(WeightError, match="both map to 'scale'"):
        weights.load_weights(
            _Net, tmp_path / "m.safetensors", rules, select=r"model\.", strip="model."
        )
    with pytest.raises(WeightError, match="does not exist"):
        _load(tmp_path / "nope.safetensors")
    with pytest.raises(WeightError, match="no \\*.safetensors"):
        _load(_empty(tmp_path))


def _empty(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    return d


def test_factory_is_not_materialised(tmp_path, monkeypatch):
    # The module is built with nnx.eval_shape: constructing it must allocate nothing real.
    save_file(_torch_like_state(np.random.default_rng(0)), tmp_path / "m.safetensors")
    seen = []

    def factory():
        net = _Net()
        seen.append(type(net.scale.get_value()).__name__)
        return net

    weights.load_weights(
        factory, tmp_path / "m.safetensors", RULES, select=r"model\.", strip="model."
    )
    assert seen == ["DynamicJaxprTracer"]  # traced abstractly, never a concrete array
