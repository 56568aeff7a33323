"""Harness for jaxsync.models.gemma3n: verify registrations, benchmarks, references."""

import jaxsync.models.gemma3n._verify  # noqa: F401  (registers; moves here)
