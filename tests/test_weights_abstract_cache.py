"""The loader builds a factory's abstract module once: repeated loads of one class and config skip
`nnx.eval_shape`; another config, class or an unhashable closure builds again; loaded modules never
share state."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jaxsync import weights
from jaxsync.weights import Rule, _abstract


@dataclasses.dataclass(frozen=True)
class _Cfg:
    width: int = 4


class _Net(nnx.Module):
    def __init__(self, cfg, *, dtype=jnp.float32, rngs):
        self.proj = nnx.Linear(3, cfg.width, rngs=rngs, param_dtype=dtype)


RULES = [Rule(r"fc\.weight", "proj.kernel", weights.linear), Rule(r"fc\.bias", "proj.bias")]


def _save(path, width, seed=0):
    rng = np.random.default_rng(seed)
    state = {"fc.weight": rng.standard_normal((width, 3)), "fc.bias": rng.standard_normal(width)}
    save_file({k: v.astype(np.float32) for k, v in state.items()}, path)
    return state


def _load(path, cfg, dtype=jnp.float32):
    factory = lambda: _Net(cfg, dtype=dtype, rngs=nnx.Rngs(0))  # noqa: E731
    return weights.load_weights(factory, path, RULES, dtype=dtype)


@pytest.fixture
def builds(monkeypatch):
    """Counts the abstract builds (`nnx.eval_shape` calls of the loader)."""
    monkeypatch.setattr(_abstract, "_ABSTRACT", {})
    count = []
    real = nnx.eval_shape

    def eval_shape(factory):
        count.append(factory)
        return real(factory)

    monkeypatch.setattr(_abstract.nnx, "eval_shape", eval_shape)
    return count


def test_repeated_loads_build_once_and_share_nothing(tmp_path, builds):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    wa, wb = _save(a, 4, seed=0), _save(b, 4, seed=1)
    first, second = _load(a, _Cfg()), _load(b, _Cfg())
    assert len(builds) == 1
    np.testing.assert_allclose(np.asarray(first.proj.kernel[...]), wa["fc.weight"].T, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(second.proj.kernel[...]), wb["fc.weight"].T, rtol=1e-6)
    first.proj.bias[...] = jnp.zeros(4)  # a loaded module is its own
    np.testing.assert_allclose(np.asarray(second.proj.bias[...]), wb["fc.bias"], rtol=1e-6)
    third = _load(a, _Cfg())
    np.testing.assert_allclose(np.asarray(third.proj.bias[...]), wa["fc.bias"], rtol=1e-6)
    assert len(builds) == 1


def test_another_config_or_dtype_builds_again(tmp_path, builds):
    narrow, wide = tmp_path / "n.safetensors", tmp_path / "w.safetensors"
    _save(narrow, 4), _save(wide, 6)
    _load(narrow, _Cfg(4))
    assert _load(wide, _Cfg(6)).proj.kernel.shape == (3, 6)
    assert len(builds) == 2
    assert _load(narrow, _Cfg(4), dtype=jnp.bfloat16).proj.kernel.dtype == jnp.bfloat16
    assert len(builds) == 3


def test_unhashable_closure_is_never_cached(tmp_path, builds):
    path = tmp_path / "m.safetensors"
    _save(path, 4)
    sizes = {"width": 4}  # a dict: unhashable, may change between loads

    def factory():
        return _Net(_Cfg(sizes["width"]), rngs=nnx.Rngs(0))

    weights.load_weights(factory, path, RULES)
    weights.load_weights(factory, path, RULES)
    assert len(builds) == 2


class _MutableCfg:  # hashed by identity, changed in place between loads
    def __init__(self, width):
        self.width = width


def test_a_config_mutated_between_loads_is_never_cached(tmp_path, builds):
    narrow, wide = tmp_path / "n.safetensors", tmp_path / "w.safetensors"
    _save(narrow, 4), _save(wide, 6)
    cfg = _MutableCfg(4)
    assert _load(narrow, cfg).proj.kernel.shape == (3, 4)
    cfg.width = 6  # the same object: a cache keyed by it would give the 4-wide structure
    assert _load(wide, cfg).proj.kernel.shape == (3, 6)
    assert len(builds) == 2


def test_a_factory_reading_a_module_attribute_is_never_cached(tmp_path, builds):
    import types as _types

    path = tmp_path / "m.safetensors"
    _save(path, 4)
    settings = _types.ModuleType("user_settings")
    settings.cfg = _Cfg(4)

    def factory():
        return _Net(settings.cfg, rngs=nnx.Rngs(0))

    weights.load_weights(factory, path, RULES)
    weights.load_weights(factory, path, RULES)
    assert len(builds) == 2


@pytest.mark.parametrize("family", ["chameleon", "gemma3n", "glm4v", "qwen3_omni", "voxtral"])
def test_a_family_factory_is_keyed_by_value(family):
    """Control: a factory shaped as every family's (`Tower(cfg, rngs=..., dtype=...)`, closing
    over its frozen config and dtype) is cached, and another config gives another key."""
    import importlib

    module = importlib.import_module(f"jaxsync.models.{family}._config")
    config = next(
        getattr(module, n)
        for n in sorted(dir(module))
        if n.endswith("Config") and dataclasses.is_dataclass(getattr(module, n))
        and n not in ("MelConfig", "ChameleonVQConfig")
    )  # fmt: skip

    def key(cfg, dtype):
        return _abstract._factory_key(lambda: _Net(cfg, dtype=dtype, rngs=nnx.Rngs(0)))

    cfg = config()
    assert key(cfg, jnp.bfloat16) is not None
    assert key(cfg, jnp.bfloat16) == key(config(), jnp.bfloat16)
    assert key(cfg, jnp.bfloat16) != key(cfg, jnp.float32)
