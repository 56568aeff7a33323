"""Harness for jaxsync.models.voxtral: verify registrations, benchmarks, references."""

import jaxsync.models.voxtral._verify  # noqa: F401  (registers; moves here)
