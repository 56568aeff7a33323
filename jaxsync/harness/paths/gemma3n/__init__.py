"""Harness for jaxsync.models.gemma3n: verify registrations, benchmarks, references."""

from jaxsync.harness.paths.gemma3n import bench as bench, verify as verify  # registration on import
