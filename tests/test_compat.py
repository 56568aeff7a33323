"""Each private JAX symbol jaxsync uses (all in jaxsync._compat) still exists on the installed jax.

A jax upgrade that moves one fails here with the symbol's name, while the library itself keeps
working through `jax.device_put` (checked below with the private transfer switched off).
"""

import importlib
import pathlib
import re

import jax
import numpy as np
import pytest

import jaxsync
from jaxsync import _compat


@pytest.mark.parametrize("symbol", _compat.PRIVATE, ids=lambda s: f"{s.module}.{s.attr}")
def test_private_symbol_still_exists(symbol):
    try:
        value = importlib.import_module(symbol.module)
    except ImportError as e:
        pytest.fail(
            f"jax {jax.__version__} moved module {symbol.module} ({e}); used for: {symbol.why}"
        )
    for name in symbol.attr.split("."):
        assert hasattr(value, name), (
            f"jax {jax.__version__} removed {symbol.module}.{symbol.attr} (no {name!r}); used for: "
            f"{symbol.why}. Uploads take jax.device_put until jaxsync/_compat.py is updated."
        )
        value = getattr(value, name)


def test_guard_state_has_the_explicit_transfer_flag():
    state = _compat._guard_state()
    assert isinstance(getattr(state, "explicit_device_put", None), bool), (
        f"jax {jax.__version__}: guard_lib.thread_local_state() has no explicit_device_put flag"
    )


def test_direct_transfer_is_taken_on_this_jax():
    assert _compat.DIRECT_PUT, (
        f"private symbols missing on jax {jax.__version__}: {_compat.missing()}"
    )


def test_public_fallback_when_the_private_transfer_is_gone(monkeypatch):
    # Another jax: every upload goes through jax.device_put and gives the same arrays.
    monkeypatch.setattr(_compat, "DIRECT_PUT", False)
    monkeypatch.setattr(_compat, "_batched_device_put", None)
    monkeypatch.setattr(jaxsync._transfer, "_TARGETS", {})
    calls = []
    real = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = jaxsync.async_h2d(np.arange(5, dtype=np.int32))
    packed = jaxsync.upload_packed({"ids": np.array([7, 9], np.int32)})
    assert x.tolist() == [0, 1, 2, 3, 4] and packed["ids"].tolist() == [7, 9]
    assert len(calls) == 2


def test_missing_names_a_removed_symbol(monkeypatch):
    # Negative control for the checks above: a symbol that is gone is reported by name.
    fake = _compat.Private("jax._src.core", "no_such_symbol", "test")
    monkeypatch.setattr(_compat, "PRIVATE", (*_compat.PRIVATE[:2], fake, *_compat.PRIVATE[3:]))
    assert _compat.missing() == ["jax._src.core.no_such_symbol"]


def test_ragged_attention_is_available_on_this_jax():
    assert _compat.ragged_attention_available(), _compat.missing()


def test_ragged_attention_unavailable_when_its_symbol_is_gone(monkeypatch):
    fake = _compat.Private("jax._src.cudnn.fused_attention_stablehlo", "no_such_symbol", "test")
    monkeypatch.setattr(_compat, "PRIVATE", (*_compat.PRIVATE[:4], fake, _compat.PRIVATE[5]))
    assert not _compat.ragged_attention_available()


def test_array_type_is_the_class_of_jax_arrays():
    t = _compat.array_type()
    assert issubclass(t, jax.Array) and type(jax.numpy.ones(3)) is t


def test_private_jax_is_only_reached_from_compat():
    root = pathlib.Path(jaxsync.__file__).parent
    pattern = re.compile(r"jax\._src|jaxlib\.|_device_assignment|os\.environ\._data")
    offenders = [
        str(p.relative_to(root))
        for p in sorted(root.rglob("*.py"))
        if p.name != "_compat.py" and pattern.search(p.read_text())
    ]
    assert offenders == [], f"private JAX outside jaxsync/_compat.py: {offenders}"
