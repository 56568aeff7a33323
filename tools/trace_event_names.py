"""Prints the execute-event names one jitted call leaves in a profiler trace, with their counts
(what `jaxsync.bench._timing.count_executions` reads). Usage: python3 tools/trace_event_names.py"""

import collections
import gzip
import json
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp


f = jax.jit(lambda v: v * 2)
x = jnp.ones(8)
jax.block_until_ready(f(x))
with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
        jax.block_until_ready(f(x))
    trace = json.loads(gzip.open(next(Path(tmp).rglob("*perfetto_trace.json.gz"))).read())
events = trace["traceEvents"] if isinstance(trace, dict) else trace
names = collections.Counter(
    e["name"] for e in events if e.get("ph") == "X" and "Execut" in e["name"]
)
print(jax.devices()[0].device_kind, dict(names))
