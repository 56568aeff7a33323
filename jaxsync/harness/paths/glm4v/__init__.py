"""Harness for jaxsync.models.glm4v: verify registrations, benchmarks, transformers references."""

from jaxsync.harness.paths.glm4v import bench as bench, verify as verify  # noqa: F401  (registration)
