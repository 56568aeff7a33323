"""`jaxsync` exports what users call, and no two packages export one name for different things.

The public names are `jaxsync.__all__`: the uploads, the pieces of a model path, `precompile`
and the sub-packages. Every other core name lives in a private module (`jaxsync._host`,
`jaxsync._calls`, ...), where the families, the harness and the tests import it from. The
packages a server imports (`jaxsync`, `jaxsync.models`, `jaxsync.kv`, `jaxsync.check`,
`jaxsync.weights`, `jaxsync.testing`) never bind one exported name to two different objects:
a name means one thing wherever it is imported from. (The families share their contract's names,
`plan`, `forward`, `load_model`, by design: each is reached through its family's module.)
"""

from __future__ import annotations

import importlib
import re
import types
from collections.abc import Mapping
from pathlib import Path

import pytest

import jaxsync


ROOT = Path(__file__).resolve().parents[1]

PUBLIC = [
    "DeviceCache",
    "Embeddings",
    "Encoded",
    "LayerStack",
    "Packed",
    "PlanCache",
    "StagingRing",
    "Target",
    "TowerEncoder",
    "TowerProgram",
    "async_h2d",
    "bucket",
    "check",
    "default_cache",
    "default_staging",
    "flat_state",
    "harness",
    "hfconfig",
    "kv",
    "models",
    "precompile",
    "replicated_near",
    "testing",
    "upload_packed",
    "weights",
]

# Core names that are not public, and the private module each one lives in.
INTERNAL = {
    "CallCache": "jaxsync._calls",
    "call_key": "jaxsync._calls",
    "prepared_call": "jaxsync._calls",
    "CacheEntry": "jaxsync._device_cache",
    "all_finite": "jaxsync._fill",
    "fill_rows": "jaxsync._fill",
    "check_finite": "jaxsync._host",
    "host_array": "jaxsync._host",
    "host_int": "jaxsync._host",
    "host_ints": "jaxsync._host",
    "is_torch_tensor": "jaxsync._host",
    "JitMethod": "jaxsync._jit",
    "jit_method": "jaxsync._jit",
    "metadata_key": "jaxsync._plans",
    "Compiled": "jaxsync._precompile",
    "TowerEntry": "jaxsync._entry",
}

FAMILIES = sorted(p.parent.name for p in (ROOT / "models").glob("*/__init__.py"))
PACKAGES = (
    "jaxsync",
    "jaxsync.models",
    "jaxsync.kv",
    "jaxsync.check",
    "jaxsync.weights",
    "jaxsync.testing",
)


def exported(module: types.ModuleType) -> dict[str, object]:
    """The names a module exports and their objects: its `__all__`, else its public names that
    are not modules nor `__future__` features (what `from module import *` would bind)."""
    names = getattr(module, "__all__", None)
    if names is None:
        names = [
            n
            for n, v in vars(module).items()
            if not n.startswith("_")
            and not isinstance(v, types.ModuleType)
            and type(v).__module__ != "__future__"
        ]
    return {n: getattr(module, n) for n in names}


def clashes(packages: Mapping[str, Mapping[str, object]]) -> list[str]:
    """Every name that two packages export bound to different objects, as readable lines."""
    owners: dict[str, list[tuple[str, object]]] = {}
    for package, names in packages.items():
        for name, value in names.items():
            owners.setdefault(name, []).append((package, value))
    found = []
    for name, seen in sorted(owners.items()):
        if len({id(v) for _, v in seen}) > 1:
            found.append(f"{name}: " + ", ".join(f"{p} ({type(v).__name__})" for p, v in seen))
    return found


def test_the_public_names_are_all_and_few():
    assert jaxsync.__all__ == PUBLIC
    assert len(PUBLIC) <= 25


def test_dir_lists_the_public_names_only():
    import jaxsync._host  # a private module bound on the package by its import
    import jaxsync.pytest_plugin  # a public-named module bound the same way (pytest loads it)

    assert [n for n in dir(jaxsync) if not n.startswith("_")] == PUBLIC
    assert "__version__" in dir(jaxsync)


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_resolves(name):
    assert getattr(jaxsync, name) is not None


@pytest.mark.parametrize("name", sorted(INTERNAL))
def test_internal_names_live_in_their_private_module_only(name):
    importlib.import_module(INTERNAL[name])  # binds the private module on the package
    with pytest.raises(AttributeError, match=name):
        getattr(jaxsync, name)
    assert getattr(importlib.import_module(INTERNAL[name]), name) is not None


def test_no_two_packages_export_one_name_for_different_things():
    surface = {p: exported(importlib.import_module(p)) for p in PACKAGES}
    assert surface["jaxsync.kv"] and surface["jaxsync.check"] and surface["jaxsync.testing"]
    assert clashes(surface) == []


@pytest.mark.parametrize("family", FAMILIES)
def test_no_family_exports_a_core_name_for_another_thing(family):
    """A family may re-export a core name (`Embeddings`), never bind it to its own object.
    (Families share the contract's names among themselves by design.)"""
    surface = {p: exported(importlib.import_module(p)) for p in PACKAGES}
    module = importlib.import_module(f"jaxsync.models.{family}")
    surface[module.__name__] = exported(module)
    assert surface[module.__name__]
    assert clashes(surface) == []


def test_the_clash_check_catches_a_clash():
    a, b = types.ModuleType("a"), types.ModuleType("b")
    a.stack_layers, b.stack_layers = (lambda: 1), (lambda: 2)  # one name, two things
    shared = object()
    a.same = b.same = shared  # a re-export of one object is no clash
    a.__all__ = ["stack_layers", "same"]
    assert clashes({"a": exported(a), "b": exported(b)}) == [
        "stack_layers: a (function), b (function)"
    ]
    assert clashes({"a": exported(a)}) == []  # negative control: one package alone


def test_exported_without_all_skips_modules_and_private_names():
    m = types.ModuleType("m")
    m.np, m._hidden, m.thing = types, 1, 2
    exec("from __future__ import annotations", vars(m))
    assert exported(m) == {"thing": 2}


# `jaxsync.<name>` in the user-facing docs and examples: only public names (or dunders).
_NAMED = re.compile(r"\bjaxsync\.([A-Za-z]\w*)")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


@pytest.mark.parametrize("path", DOCS + EXAMPLES, ids=lambda p: p.name)
def test_docs_and_examples_name_public_names_only(path):
    named = set(_NAMED.findall(path.read_text()))
    assert named - set(PUBLIC) == set(), path.name


def test_the_docs_check_flags_an_internal_name():
    assert set(_NAMED.findall("call `jaxsync.host_ints(x)` then jaxsync.bucket(n)")) - set(
        PUBLIC
    ) == {"host_ints"}
