"""Harness for jaxsync.models.glm4v: verify registrations, benchmarks, references."""

import jaxsync.models.glm4v._verify  # noqa: F401  (registers; moves here)
