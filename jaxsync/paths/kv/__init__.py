"""Harness for jaxsync.kv: verify registrations, benchmarks, references."""

import jaxsync.kv._bench  # noqa: F401
import jaxsync.kv._verify  # noqa: F401  (registers; moves here)
