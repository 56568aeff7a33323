"""Harness for jaxsync.kv: verify registrations, benchmarks, references."""

from jaxsync.paths.kv import bench as bench, verify as verify
