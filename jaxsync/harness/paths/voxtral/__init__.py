"""Harness for jaxsync.models.voxtral: verify registrations, benchmarks, references."""

from jaxsync.harness.paths.voxtral import bench as bench, verify as verify  # registration on import
