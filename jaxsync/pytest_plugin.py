"""pytest plugin (entry point `jaxsync`): assert sync-freedom of your own code in your own suite.

- `@pytest.mark.gpu`: skipped unless JAX sees a GPU or TPU.
- `@pytest.mark.sync_free`: the test body runs inside `sync_guard("error")` and `no_recompile()`
  (warm up your functions in fixtures).
- fixture `sync_free`: a context-manager factory for the same, around part of a test body:

      def test_step(sync_free, step, batch):
          step(batch)                 # warm up / compile
          with sync_free():
              out = step(batch)       # must not read back, must not recompile
"""

from __future__ import annotations

import contextlib

import pytest


def _accelerator_present() -> bool:
    import jax

    return any(d.platform in ("gpu", "cuda", "rocm", "tpu") for d in jax.devices())


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs an accelerator (GPU/TPU); skipped on CPU")
    config.addinivalue_line(
        "markers", "sync_free: run the test body under jaxsync sync_guard and no_recompile"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    if _accelerator_present():
        return
    skip = pytest.mark.skip(reason="needs a GPU/TPU (jax.devices() has none)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@contextlib.contextmanager
def _sync_free_region(mode: str = "error"):
    from jaxsync.check import no_recompile, sync_guard

    with no_recompile(), sync_guard(mode):
        yield


@pytest.fixture
def sync_free():
    """Returns a context manager: `with sync_free(): ...` is guarded and must not recompile."""
    return _sync_free_region


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    if pyfuncitem.get_closest_marker("sync_free") is None:
        return (yield)
    with _sync_free_region():
        return (yield)
