"""Harness for jaxsync.models.chameleon: verify registrations, benchmarks, references."""

from jaxsync.harness.paths.chameleon import bench as bench, verify as verify  # noqa: F401  (registers)
