"""`jaxsync verify`'s dispatch proof of every registered path holds on a loaded machine: each
path is proven several times with every core busy (a full verify run is too slow for the suite;
`.ci/run` runs that)."""

import os
import subprocess
import sys

import jax
import pytest

from jaxsync.check import measure_blocking
from jaxsync.harness import registry


RUNS = 3  # proofs per path, each of several gated calls


@pytest.fixture(scope="module")
def busy_cores():
    """Every core kept busy by a spinning process for the module's tests."""
    n = os.cpu_count() or 2
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    yield
    for p in procs:
        p.kill()
        p.wait()


@pytest.fixture(scope="module")
def cases():
    """Every registered path built and compiled (its first call) before the cores get busy:
    what is measured under load is the proof, not the compiler."""
    jax.config.update("jax_default_matmul_precision", "highest")  # as `jaxsync verify` runs
    built = {}
    for spec in registry.paths():
        case = spec.build(None)
        jax.block_until_ready(case.fn(*case.inputs[0], **case.kwargs))
        built[spec.name] = case
    return built


@pytest.mark.parametrize("name", [s.name for s in registry.paths()])
def test_dispatch_proof_of_every_path_under_load(name, cases, busy_cores):
    case = cases[name]
    for _ in range(RUNS):
        report = measure_blocking(case.fn, *case.inputs[0], **case.kwargs)
        assert report.ok is True and report.method == "gate", f"{name}: {report}"
