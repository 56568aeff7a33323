"""Harness for jaxsync.models.qwen3_omni: verify registrations, benchmarks, references."""

from jaxsync.harness.paths.qwen3_omni import bench as bench, verify as verify
