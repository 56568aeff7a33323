"""The docstring examples of the public core modules run as doctests."""

import doctest
import importlib

import pytest


PUBLIC_MODULES = [
    "jaxsync._device_cache",
    "jaxsync._transfer",
    "jaxsync._jit",
    "jaxsync.check._static",
    "jaxsync.check._guard",
    "jaxsync.check._recompile",
    "jaxsync.check._probe",
    "jaxsync.check._report",
    "jaxsync.testing",
    "jaxsync.hfconfig",
    "jaxsync._placement",
    "jaxsync._packing",
    "jaxsync.kv._slot_plan",
    "jaxsync.kv._storage",
]


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE | doctest.IGNORE_EXCEPTION_DETAIL
    result = doctest.testmod(module, optionflags=flags)
    assert result.failed == 0
