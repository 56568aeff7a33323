"""Strict test configuration; runs before any JAX backend is initialised."""

import importlib.util
import os
from pathlib import Path

import pytest


# 8 simulated CPU devices so sharded code runs in CI. Must be set before the backend starts.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# A persistent compilation cache would hide compiles from the recompile checks.
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)

import jax  # noqa: E402


jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
# fp32 parity at 1e-5 needs full-precision matmuls on GPU (the default there uses TF32).
jax.config.update("jax_default_matmul_precision", "highest")


def _load_example(name: str):
    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def load_example():
    """`load_example(name)`: a fresh module of `examples/<name>.py`, its top level run at the
    call (after whatever environment the test set first)."""
    return _load_example
