"""Harness for jaxsync.kv: verify registrations, benchmarks, references."""

from jaxsync.harness.paths.kv import bench as bench, verify as verify, verify_fp8 as verify_fp8
