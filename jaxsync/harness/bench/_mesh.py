"""Tensor-parallel rows: each big tower's forward on 1, 2 and 4 "model" devices.

Each family's tower is built at its released size (random weights, as `jaxsync bench
first-call` builds it), and one host input of its bucket goes through the entry's host steps up
to the program call. Then, per "model" size m, on a `("data", "model")` mesh of shape (1, m):

- the state is placed by the family's `PARTITION_RULES` (the loader's own placement function:
  what `load_model(..., mesh=)` gives), the inputs and metadata replicated;
- the family's forward runs in a server's own jit over the state leaves
  (`jaxsync.testing.server_step`);
- device ms per forward (busy work queued on each of the m devices) and host ms (cold, and per
  call in a stream) are taken as in `jaxsync bench`; the collectives of the compiled HLO are
  counted; a profiler trace of a few calls gives the device time per call of its collective
  kernels (`jaxsync bench profile`'s "collective" class), summed over the m devices and divided
  by m: one device's share.

Needs 2 or more accelerator devices; `--smoke` runs the tiny sizes on whatever devices exist
(CPU: `XLA_FLAGS=--xla_force_host_platform_device_count=8`), where a trace has no device lanes:
its collective time there is host threads' (rendezvous waits included), not a device time.

    jaxsync bench mesh                                   # glm4v voxtral qwen3_omni gemma3n
    jaxsync bench mesh --paths voxtral --model 1 2 --out mesh.json
    jaxsync bench mesh --smoke --paths voxtral           # tiny sizes, any devices
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import types
from collections.abc import Callable, Iterator
from typing import Any


FAMILIES = ("glm4v", "voxtral", "qwen3_omni", "gemma3n")
COLLECTIVES = ("all-reduce", "all-gather", "collective-permute", "reduce-scatter", "all-to-all")


def collectives(hlo: str) -> dict[str, int]:
    """How many ops of each collective kind the compiled HLO text holds (async starts count)."""
    return {op: len(re.findall(rf"= [^=\n]*? {op}(?:-start)?\(", hlo)) for op in COLLECTIVES}


def accelerator_count() -> int:
    """Devices of the default backend that are not the host CPU."""
    import jax

    return 0 if jax.default_backend() == "cpu" else jax.device_count()


def _refusal(smoke: bool) -> str | None:
    n = accelerator_count()
    if smoke or n >= 2:
        return None
    import jax

    return (
        f"{n} accelerator device{'s' * (n != 1)} (backend {jax.default_backend()!r}): "
        "tensor-parallel rows need 2 or more (--smoke runs tiny sizes on whatever devices exist)"
    )


def placed_by_rules(model: Any, mesh: Any, rules: Any) -> Any:
    """A copy of `model` with each variable where `load_model(..., mesh=mesh,
    partition_rules=rules)` would put it (a stacked layer's rule describes one layer)."""
    import jax
    from flax import nnx

    from jaxsync._stack import stacks
    from jaxsync.weights._placement import param_placement
    from jaxsync.weights._plan import path_str

    graphdef, state = nnx.split(model)
    stacked = stacks(model)
    flat = []
    for path, var in nnx.to_flat_state(state):
        target, value = path_str(path), var.get_value()
        layered = any(target.startswith(prefix + ".layer.") for prefix in stacked)
        place = param_placement(target, tuple(value.shape), layered, None, mesh, rules, None)
        flat.append((path, var.replace(value=jax.device_put(value, place))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def mesh_side(devices: Any) -> Any:
    """`_timing._Side("jax")` whose busy work is queued on every one of `devices`: a sharded
    forward queued behind it starts on all of them only once each is free."""
    from jaxsync.check._probe import spin_for
    from jaxsync.harness.bench._timing import _Side

    side = _Side("jax")
    spins = [spin_for(d, 30.0).run for d in devices]
    side._spin = lambda: [spin() for spin in spins]
    return side


@contextlib.contextmanager
def _program_calls_captured() -> Iterator[None]:
    """`TowerProgram` calls raise `_first_call._Captured` inside, run again after."""
    from jaxsync._tower import TowerProgram
    from jaxsync.harness.bench._first_call import _capture_program_calls

    saved = TowerProgram.__call__, TowerProgram.prepared
    _capture_program_calls()
    try:
        yield
    finally:
        TowerProgram.__call__, TowerProgram.prepared = saved


def tower_and_call(family: str, size: str) -> tuple[Any, Callable, tuple, int]:
    """`(tower, forward, inputs, bucket)`: the family's tower at `size` (random weights), the
    forward its entry runs and that entry's device inputs for one host input of its bucket."""
    from flax import nnx

    from jaxsync.harness.bench._first_call import _bucket_input, _encoder, _program_call

    tower, make_encoder = _encoder(family, size)
    enc = make_encoder()
    bucket, args, kwargs = _bucket_input(enc, family, size)
    with _program_calls_captured():
        captured = _program_call(enc, family, args, kwargs)
    if nnx.graphdef(tower) != captured.program.graphdef:
        raise RuntimeError(f"{family}'s program is not over the tower built here")
    return tower, captured.program._forward, captured.inputs, bucket


def row(family: str, tower: Any, forward: Callable, inputs: tuple, m: int, args) -> dict:
    """One tensor-parallel row of `family` on a (1, m) mesh."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxsync.harness.bench._profile import profile
    from jaxsync.harness.bench._timing import measure
    from jaxsync.testing import server_step

    axis_types = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((1, m), ("data", "model"), axis_types, devices=jax.devices()[:m])
    rules = importlib.import_module(f"jaxsync.models.{family}").PARTITION_RULES
    step, leaves = server_step(placed_by_rules(tower, mesh, rules), forward)
    replicated = NamedSharding(mesh, P())
    on_mesh = jax.tree.map(
        lambda a: jax.device_put(a, replicated) if isinstance(a, jax.Array) else a, inputs
    )
    split = sum(leaf.sharding.shard_shape(leaf.shape) != leaf.shape for leaf in leaves)
    found = collectives(step.lower(leaves, *on_mesh).compile().as_text())

    def call() -> Any:
        return step(leaves, *on_mesh)

    timed = measure(call, mesh_side(mesh.devices.flat), repeat=args.repeat)
    # the trace's events of all m devices, per call: divided by m, the time of one device
    per_class, _ = profile(types.SimpleNamespace(jax_fn=call), args.calls)
    return {
        "family": family,
        "model": m,
        "split_leaves": split,
        "leaves": len(leaves),
        **timed,
        "collectives": found,
        "collective_ms": per_class.get("collective", 0.0) / m,
        "trace_ms": sum(per_class.values()) / m,
    }


def _line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"  {r['family']:<12}{r['model']:>6}  error {r['error'][:160]}"
    c = r["collectives"]
    counts = "".join(f"{c[op]:>5}" for op in COLLECTIVES[:4])
    return (
        f"  {r['family']:<12}{r['model']:>6}{r['bucket']:>8}{r['split_leaves']:>5}/{r['leaves']:<4}"
        f"{r['device_ms']:>10.3f}{r['blocked_ms']:>9.3f}{r['stream_ms']:>10.3f}"
        f"{r['collective_ms']:>13.3f}{counts}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="jaxsync bench mesh",
        description=__doc__.split("\n")[0],
        epilog="\n".join(__doc__.splitlines()[-3:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--paths", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--model", nargs="+", type=int, default=[1, 2, 4], help='"model" sizes')
    ap.add_argument("--repeat", type=int, default=5, help="timed repeats per row (median)")
    ap.add_argument("--calls", type=int, default=5, help="calls in the profiler trace")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on whatever devices exist")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    reason = _refusal(args.smoke)
    if reason:
        print(f"jaxsync bench mesh: {reason}")
        return 2

    import jax

    jax.config.update("jax_default_matmul_precision", "default")  # serving precision
    size = "tiny" if args.smoke else "released"
    device = jax.devices()[0]
    client = "tfrt" if os.environ.get("XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT") else "default"
    print(f"tensor-parallel rows: {jax.device_count()} x {device.device_kind} ({device.platform},"
          f" {client} client), {size} sizes, mesh (data 1, model m), server form")  # fmt: skip
    if device.platform == "cpu":
        print("  (CPU: a tiny forward is within the busy work's noise, so device ms may read 0; "
              "the trace has no device lanes, so coll. ms is the host threads' collective ops, "
              "rendezvous waits included, not a device time)")  # fmt: skip
    print(
        f"  {'family':<12}{'model':>6}{'bucket':>8}{'split':>10}{'device ms':>10}"
        f"{'cold ms':>9}{'stream ms':>10}{'coll. ms/dev':>13}{'AR':>5}{'AG':>5}{'CP':>5}{'RS':>5}"
    )
    print(
        "  (split: state leaves split over model; AR all-reduce, AG all-gather, CP collective-"
        "permute, RS reduce-scatter: ops in the compiled HLO, a layer scan's body once; coll. "
        "ms/dev: collective kernels' time per call on one device, from a profiler trace)"
    )
    rows: list[dict[str, Any]] = []
    for family in args.paths:
        try:
            tower, forward, inputs, bucket = tower_and_call(family, size)
        except Exception as e:
            rows.append({"family": family, "model": 0, "error": f"build failed: {e!r}"})
            print(_line(rows[-1]), flush=True)
            continue
        for m in args.model:
            if m > jax.device_count():
                print(f"  {family:<12}{m:>6}  skipped: {jax.device_count()} devices present")
                continue
            try:
                r = row(family, tower, forward, inputs, m, args)
            except Exception as e:
                r = {"family": family, "model": m, "error": repr(e)[:300]}
            rows.append({"size": size, "bucket": bucket, **r})
            print(_line(rows[-1]), flush=True)
    if args.out:
        env = {"device": device.device_kind, "platform": device.platform,
               "devices": jax.device_count(), "jax": jax.__version__, "client": client}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=2)
    return 0 if rows and not any("error" in r for r in rows) else 1
