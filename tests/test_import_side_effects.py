"""Importing any jaxsync module, at any time, recompiles none of the caller's programs.

A server imports jaxsync's packages after its own warm-up as readily as before it; an import
that changed JAX's global configuration or registered platform kernels eagerly would make
every warm `jax.jit` trace and compile again on its next call. Each module is imported in a
fresh process after a warm jit, and the jit's next call must compile nothing.
"""

import pkgutil
import subprocess
import sys

import jax
import pytest

import jaxsync


def _modules() -> list[str]:
    names = ["jaxsync.kv", "jaxsync.models", "jaxsync.check", "jaxsync.weights", "jaxsync.testing"]
    for pkg in ("jaxsync.kv", "jaxsync.models", "jaxsync.check", "jaxsync.weights"):
        module = __import__(pkg, fromlist=["__path__"])
        names += [f"{pkg}.{m.name}" for m in pkgutil.walk_packages(module.__path__) if m.ispkg]
        names += [f"{pkg}.{m.name}" for m in pkgutil.iter_modules(module.__path__)]
    return sorted(set(names))


# The child imports nothing of jaxsync before its warm jit, and counts traces and compiles with
# JAX's own events. On jax >= 0.12 importing flax (through `jax.extend`, which loads Pallas) adds
# config states to JAX's trace context, so that first import retraces warm jits whoever makes it:
# modules built on flax NNX are imported after flax, as a server on flax has it before its
# warm-up; every other module (kv, check, testing) with no flax at all.
FLAX_USERS = ("jaxsync.models", "jaxsync.weights")
CHILD = """
import importlib, sys
PRELUDE
import jax, jax.numpy as jnp
events = []
def on_event(event, duration, **kwargs):
    if event.endswith(("jaxpr_trace_duration", "backend_compile_duration")):
        events.append(event)
jax.monitoring.register_event_duration_secs_listener(on_event)
step = jax.jit(lambda x: x * 2 + 1)
x = jnp.ones((3,))
step(x).block_until_ready()
bad = []
for name in sys.argv[1:]:
    events.clear()
    try:
        importlib.import_module(name)
        step(x).block_until_ready()
    except Exception as e:
        events.append(f"{type(e).__name__}: {str(e)[:200]}")
    if events:
        bad.append(f"{name}: {events[:3]}")
print("BAD" if bad else "OK", *bad, sep="\\n")
"""


def test_importing_any_module_after_a_warm_jit_recompiles_nothing():
    modules = _modules()
    assert "jaxsync.kv._pallas" in modules and "jaxsync.models.glm4v" in modules
    on_flax = [m for m in modules if m.startswith(FLAX_USERS)]
    rest = [m for m in modules if m not in on_flax]
    assert "jaxsync.kv._pallas" in rest and "jaxsync.check" in rest
    for prelude, names in (("import flax.nnx", on_flax), ("", rest)):
        code = CHILD.replace("PRELUDE", prelude)
        proc = subprocess.run(
            [sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.splitlines()[0] == "OK", (prelude, proc.stdout)


def test_the_check_catches_an_import_that_recompiles():
    """Negative control: a module that flips a JAX setting which keys the jit cache."""
    code = CHILD.replace("PRELUDE", "").replace(
        "importlib.import_module(name)", "jax.config.update('jax_enable_x64', True)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "any.module"], capture_output=True, text=True, timeout=300
    )
    assert proc.stdout.splitlines()[0] == "BAD", (proc.stdout, proc.stderr[-2000:])
    assert jaxsync.__version__


@pytest.mark.skipif(
    tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 12),
    reason="importing Pallas changes the trace context from jax 0.12 on",
)
def test_the_check_catches_an_eager_pallas_import():
    """Negative control for the lazy Pallas imports of jaxsync.kv and jaxsync.check."""
    code = CHILD.replace("PRELUDE", "")
    proc = subprocess.run(
        [sys.executable, "-c", code, "jax.experimental.pallas"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.stdout.splitlines()[0] == "BAD", (proc.stdout, proc.stderr[-2000:])
