"""Harness for jaxsync.models.chameleon: verify registrations, benchmarks, references."""

import jaxsync.models.chameleon._verify  # noqa: F401  (registers; moves here)
