"""`jaxsync verify`, the registry, doctests of the public core, and the pytest plugin."""

import doctest
import importlib
import json
import subprocess
import sys

import pytest

from jaxsync import _cli, registry


def test_verify_demo_path_json(capsys):
    rc = _cli.main(["verify", "--paths", "core.table_gather", "--json"])
    out = json.loads(capsys.readouterr().out)
    (row,) = out["paths"]
    assert rc == 0 and row["ok"], row
    assert row["parity"]["status"] == "pass"
    assert {c["check"]: c["ok"] for c in row["checks"]} == {
        "jaxpr: no host callback": True,
        "hlo: no host transfer": True,
        "runtime: sync_guard": True,
        "no recompile": True,
        "dispatch probe": True,
    }


def test_verify_fails_on_a_bad_path(capsys):
    import jax

    @jax.jit
    def f(x):
        return x + 1

    def reads(x):
        return f(x) * float(x[0])

    import jax.numpy as jnp

    @registry.register_path("test.reads_back", "negative control")
    def _build(checkpoint):
        return registry.PathCase(reads, [(jnp.ones(3),), (jnp.zeros(3),)])

    try:
        rc = _cli.main(["verify", "--paths", "test.reads_back", "--no-probe"])
        out = capsys.readouterr().out
        assert rc == 1 and "NO" in out and "device->host read" in out
    finally:
        registry._paths.pop("test.reads_back")


def test_unknown_path_and_usage(capsys):
    with pytest.raises(ValueError, match="unknown path"):
        registry.paths(["nope"])
    assert _cli.main([]) == 2


def test_every_registered_path_builds_and_lists():
    specs = registry.paths()
    assert any(s.name == "core.table_gather" for s in specs)
    assert len({s.name for s in specs}) == len(specs)


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
]


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE | doctest.IGNORE_EXCEPTION_DETAIL
    result = doctest.testmod(module, optionflags=flags)
    assert result.failed == 0


PLUGIN_TEST = """
import jax, jax.numpy as jnp, pytest

f = jax.jit(lambda x: x * 2)
x = jnp.ones(4)
f(x)

@pytest.mark.sync_free
def test_clean():
    f(x)

@pytest.mark.sync_free
def test_reads():
    int(f(x)[0])

@pytest.mark.sync_free
def test_recompiles():
    f(jnp.ones(5))

def test_fixture(sync_free):
    with sync_free():
        f(x)

@pytest.mark.gpu
def test_needs_gpu():
    assert False
"""


def test_pytest_plugin(tmp_path):
    (tmp_path / "test_user.py").write_text(PLUGIN_TEST)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    out = proc.stdout
    assert "2 failed, 2 passed, 1 skipped" in out, out
    assert "test_reads" in out and "test_recompiles" in out
