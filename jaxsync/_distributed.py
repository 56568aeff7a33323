"""Runs a function in several local processes under `jax.distributed`, for multi-process tests.

Every process starts a fresh Python with its own XLA flags (`devices_per_process` simulated CPU
devices), joins a loopback coordinator on a free port and uses gloo for cross-process CPU
collectives, so one global mesh spans all processes' devices as it would span several hosts:

    def load(ctx, checkpoint):                     # importable: a module-level function
        tower = q3.load_model(checkpoint, mesh=ctx.mesh)
        return ctx.gather(step(tower, x).rows)     # every process returns its picklable result

    results = jaxsync.testing.run_distributed(load, checkpoint)   # [result of process 0, 1]

The global mesh `ctx.mesh` has axes `("data", "model")`, its "model" axis spanning the processes
(process p holds model shards p * w .. p * w + w - 1 of w per process, for every data index), so
a weight sharded over "model" is split between processes and one sharded over "data" is not.
A failure or a timeout in any process kills every process and raises `DistributedError` with
each one's exit status and output: no test hangs on a peer stuck in a collective.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


_TAIL = 6000  # characters of each process's output in an error


class DistributedError(RuntimeError):
    """A process failed, or the processes did not finish in time; the message holds every
    process's exit status and the tail of its stderr and stdout."""


@dataclasses.dataclass(frozen=True)
class DistributedContext:
    """What `fn(ctx, *args)` gets in each process.

    Attributes:
      process_id: this process's index, 0 .. num_processes - 1 (`jax.process_index()`).
      num_processes: processes in the run.
      mesh: the global `("data", "model")` mesh over every process's devices, "model" spanning
        the processes (see the module docstring).
      workdir: a folder shared by the processes of one run (same machine), for files they
        exchange; removed after the run.
    """

    process_id: int
    num_processes: int
    mesh: Any
    workdir: Path

    def gather(self, x: Any) -> np.ndarray:
        """The global value of a (possibly non-addressable) array, on the host of every process:
        `multihost_utils.process_allgather(x, tiled=True)`; a collective, so every process must
        call it."""
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def global_mesh(num_processes: int, devices_per_process: int) -> Any:
    """The `("data", "model")` mesh of `DistributedContext.mesh` over all processes' devices.

    "data" takes 2 when each process holds an even number of devices (else 1), "model" the rest:
    row d of the device grid is, for each process in turn, its local devices d * w .. d * w +
    w - 1 (w = devices_per_process / data). Call after `jax.distributed.initialize`.
    """
    import jax

    data = 2 if devices_per_process % 2 == 0 else 1
    width = devices_per_process // data
    local = [
        sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
        for p in range(num_processes)
    ]
    if any(len(devs) != devices_per_process for devs in local):
        raise DistributedError(f"expected {devices_per_process} devices per process: {local}")
    grid = np.array(
        [[devs[d * width + j] for devs in local for j in range(width)] for d in range(data)]
    )
    return jax.sharding.Mesh(grid, ("data", "model"))


def _free_port() -> int:
    # The port is released before the coordinator binds it; on a loopback-only test machine
    # another process taking it in between is unlikely, and shows as an init failure.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(devices_per_process: int) -> dict[str, str]:
    env = dict(os.environ)
    # The parent's own device count (tests force 8) must not leak into the children.
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices_per_process}"
    env["JAX_PLATFORMS"] = "cpu"  # the processes simulate hosts; an accelerator is never used
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # a shared cache would hide compiles
    return env


def run_distributed(
    fn: Callable[..., Any],
    *args: Any,
    num_processes: int = 2,
    devices_per_process: int = 4,
    timeout: float = 180.0,
) -> list[Any]:
    """Runs `fn(ctx, *args)` in `num_processes` fresh processes under `jax.distributed`.

    Args:
      fn: a module-level function (pickled by reference; its module is imported in each process
        with the caller's `sys.path`). It must not start a jax backend at import time.
      *args: picklable arguments, the same in every process.
      num_processes: processes, each a simulated host.
      devices_per_process: CPU devices of each process.
      timeout: seconds for the whole run, start-up included; then every process is killed.

    Returns:
      Each process's (picklable) return value, in process order.

    Raises:
      DistributedError: a process exited non-zero (every other is then killed), or the run
        timed out; the message holds every process's exit status, stderr and stdout.
    """
    with tempfile.TemporaryDirectory(prefix="jaxsync-dist-") as tmp:
        work = Path(tmp)
        (work / "shared").mkdir()
        spec = dict(
            sys_path=list(sys.path),
            coordinator=f"127.0.0.1:{_free_port()}",
            num_processes=num_processes,
            devices_per_process=devices_per_process,
            workdir=str(work / "shared"),
            timeout=timeout,
        )
        (work / "spec.pkl").write_bytes(pickle.dumps(spec))
        try:  # apart from the spec: unpickling it imports fn's module, which needs sys_path
            (work / "call.pkl").write_bytes(pickle.dumps((fn, args)))
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise DistributedError(f"fn and args must be picklable (fn module-level): {e}") from e
        env = _child_env(devices_per_process)
        procs = []
        for p in range(num_processes):
            out = open(work / f"out{p}", "wb")  # files, not pipes: a full pipe blocks a child
            err = open(work / f"err{p}", "wb")
            cmd = [sys.executable, "-m", "jaxsync._distributed", str(work), str(p)]
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=env))
            out.close()
            err.close()
        failure = _wait(procs, timeout)
        if failure:
            raise DistributedError(failure + "\n" + _outputs(work, procs))
        return [pickle.loads((work / f"result{p}.pkl").read_bytes()) for p in range(len(procs))]


def _wait(procs: list[subprocess.Popen], timeout: float) -> str:
    """Waits for every process; kills all of them at the first failure or at the deadline.
    Returns what went wrong, or "" when every process exited 0."""
    deadline = time.monotonic() + timeout
    failure = ""
    while True:
        codes = [p.poll() for p in procs]  # every one polled: any() would stop at the first
        if None not in codes:
            break
        if any(c not in (None, 0) for c in codes):
            failure = "a process failed; the others were stopped"
            break
        if time.monotonic() > deadline:
            failure = f"timed out after {timeout:g} s; every process was stopped"
            break
        time.sleep(0.1)
    for p in procs:  # only the processes this call started, each by its own handle
        if p.poll() is None:
            p.kill()
        p.wait()
    if not failure and any(p.returncode for p in procs):
        failure = "a process failed"
    return failure


def _outputs(work: Path, procs: list[subprocess.Popen]) -> str:
    parts = []
    for i, p in enumerate(procs):
        err = (work / f"err{i}").read_text(errors="replace")[-_TAIL:]
        out = (work / f"out{i}").read_text(errors="replace")[-_TAIL // 3 :]
        parts.append(f"--- process {i}: exit {p.returncode}\nstderr:\n{err}\nstdout:\n{out}")
    return "\n".join(parts)


def distributed_fixture(*, scope: str = "function", **defaults: Any) -> Any:
    """A pytest fixture (assign it to a module-level name) yielding `run_distributed` with
    `defaults` (e.g. `timeout=`) bound; per-call keywords override them. `scope="module"` lets
    module-scoped fixtures run processes once for several tests.

        distributed = jaxsync.testing.distributed_fixture(timeout=150)

        def test_load(distributed):
            results = distributed(load, checkpoint)
    """
    import functools

    import pytest

    @pytest.fixture(scope=scope)
    def distributed() -> Callable[..., list[Any]]:
        return functools.partial(run_distributed, **defaults)

    return distributed


def _child(work: Path, process_id: int) -> None:
    """One process: joins the run, calls `fn(ctx, *args)` and pickles its result."""
    spec = pickle.loads((work / "spec.pkl").read_bytes())
    sys.path[:] = spec["sys_path"]  # the caller's import path: fn's module must import here
    import jax

    # gloo carries cross-process collectives between CPU devices; set, not left to the default,
    # which has changed across jax versions.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", spec["devices_per_process"])
    jax.distributed.initialize(
        spec["coordinator"],
        num_processes=spec["num_processes"],
        process_id=process_id,
        initialization_timeout=max(int(spec["timeout"]), 1),
    )
    ctx = DistributedContext(
        process_id=process_id,
        num_processes=spec["num_processes"],
        mesh=global_mesh(spec["num_processes"], spec["devices_per_process"]),
        workdir=Path(spec["workdir"]),
    )
    fn, args = pickle.loads((work / "call.pkl").read_bytes())  # after init: fn may use jax
    result = fn(ctx, *args)
    (work / f"result{process_id}.pkl").write_bytes(pickle.dumps(result))
    jax.distributed.shutdown()


def _main() -> None:
    work, process_id = Path(sys.argv[1]), int(sys.argv[2])
    try:
        _child(work, process_id)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # no interpreter teardown: it can block on a peer stuck in a collective
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _main()
