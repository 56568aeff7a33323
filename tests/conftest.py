"""Strict test configuration; runs before any JAX backend is initialised."""

import os


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
