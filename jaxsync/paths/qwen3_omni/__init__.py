"""Harness for jaxsync.models.qwen3_omni: verify registrations, benchmarks, references."""

import jaxsync.models.qwen3_omni._verify  # noqa: F401  (registers; moves here)
