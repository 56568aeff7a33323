"""The pytest plugin: the `sync_free` marker and fixture, and the `gpu` marker."""

import subprocess
import sys

import jax


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
def test_needs_gpu():  # skipped on a CPU-only machine, run (and passing) on a GPU/TPU
    assert jax.default_backend() != "cpu"
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
    want = (
        "2 failed, 2 passed, 1 skipped" if jax.default_backend() == "cpu" else "2 failed, 3 passed"
    )
    assert want in out, out
    assert "test_reads" in out and "test_recompiles" in out
