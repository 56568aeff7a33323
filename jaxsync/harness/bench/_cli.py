"""`jaxsync bench`: every registered bench case, jaxsync vs its PyTorch baselines, in one run."""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxsync.harness.bench._render import REFERENCE_LABELS as REFERENCE_LABELS, render


def _environment() -> dict[str, Any]:
    import jax
    import torch

    try:
        import transformers

        tf = transformers.__version__
    except ImportError:
        tf = None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": jax.devices()[0].device_kind,
        "torch_device": torch.cuda.get_device_name(0),
        "jax": jax.__version__,
        "torch": torch.__version__,
        "transformers": tf,
        "python": platform.python_version(),
        # the runtime client decides host time per call: report which one measured it
        "client": "tfrt" if os.environ.get("XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT") else "default",
    }


def _accelerator_or_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not importable: the PyTorch baselines cannot run"
    import jax

    if jax.default_backend() not in ("gpu", "cuda", "rocm"):
        return f"no GPU for JAX (backend {jax.default_backend()!r}): numbers would mean nothing"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device: the baselines cannot run on the same device"
    return None


def _no_grad(fn):
    import torch

    def run():
        with torch.no_grad():
            return fn()

    return run


def _summary(row: dict[str, Any]) -> str:
    """`label device/blocked/stream ms` per measured side, for the log of a run that may be cut
    short."""
    if "error" in row:
        return f"error {row['error'][:120]}"
    sides = [(k, v) for k, v in row.items() if isinstance(v, dict) and "device_ms" in v]
    return ", ".join(
        f"{k} {v['device_ms']:.3f}/{v['blocked_ms']:.3f}/{v.get('stream_ms', 0):.3f} ms"
        for k, v in sides
    )


def _save(out: Path, env: dict, ceilings: dict, rows: list) -> dict[str, Any]:
    result = {"environment": env, "copy_ceiling_gbps": ceilings, "rows": rows}
    result["dispatch_floor_ms"] = env.get("dispatch_floor_ms")
    (out / "bench.json").write_text(json.dumps(result, indent=2, default=str))
    return result


# `jaxsync bench SUBCOMMAND`: name -> (help, module under jaxsync.harness.bench with `main(argv)`)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "host-time": ("host time, cold and in a stream: the voxtral entry, programs", "_host_time"),
    "host-overhead": ("every entry's host time against a do-nothing jit", "_host_overhead"),
    "upload": ("host uploads: pageable transfers against the pinned staging ring", "_upload"),
    "roofline": ("a floor under the voxtral encoder: its matmuls and attention alone", "_roofline"),
    "profile": ("device time per op class, from a profiler trace of bench rows", "_profile"),
    "first-call": ("first call of each form, each in a fresh process", "_first_call"),
    "mesh": ("tensor-parallel rows: big towers on 1, 2, 4 model devices (2+ GPUs)", "_mesh"),
    "render": ("re-render a bench.json as markdown and PNG chart", "_render"),
}  # fmt: skip


def bench(argv: Sequence[str]) -> int:
    argv = list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        module = importlib.import_module(f"jaxsync.harness.bench.{SUBCOMMANDS[argv[0]][1]}")
        return module.main(argv[1:])
    ap = argparse.ArgumentParser(
        prog="jaxsync bench",
        usage="jaxsync bench [options]\n       jaxsync bench SUBCOMMAND [options]",
        description=__doc__,
        epilog="subcommands:\n"
        + "\n".join(f"  {name:<14} {text}" for name, (text, _) in SUBCOMMANDS.items())
        + "\n\nRun `jaxsync bench SUBCOMMAND --help` for a subcommand's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--paths", nargs="*", help="families or path names (default: all)")
    ap.add_argument(
        "--sizes", nargs="*", default=["released"], help="size presets (tiny, released)"
    )
    ap.add_argument("--match", help="only the cases whose name contains this text")
    ap.add_argument("--repeat", type=int, default=5, help="timed repeats per row (median)")
    ap.add_argument("--out", default="bench-out", help="folder for bench.json and bench.png")
    ap.add_argument(
        "--jaxsync-only",
        action="store_true",
        help="skip the PyTorch baselines (host time per call under another client, say)",
    )
    args = ap.parse_args(argv)

    # JAX's caches and torch's baselines share one GPU: JAX must not grab 75% of it up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    reason = _accelerator_or_reason()
    if reason:
        print(f"jaxsync bench: {reason}")
        return 2

    import jax

    from jaxsync.harness import registry
    from jaxsync.harness.bench._programs import jax_executions_per_call, torch_kernels_per_call
    from jaxsync.harness.bench._timing import (
        _Side,
        copy_ceiling_gbps,
        dispatch_floor_ms,
        matmul_tflops,
        measure,
        same_args_floor,
    )

    jax.config.update("jax_default_matmul_precision", "default")  # serving precision
    env = _environment()
    jax_side, torch_side = _Side("jax"), _Side("torch")
    ceilings = {"jax": copy_ceiling_gbps("jax"), "torch": copy_ceiling_gbps("torch")}
    env["dispatch_floor_ms"] = dispatch_floor_ms(jax_side)
    env["matmul_tflops"] = matmul_tflops()
    floors = ", ".join(f"{n} args {ms:.3f}" for n, ms in env["dispatch_floor_ms"].items())
    print(f"  do-nothing jit host time ({env['client']} client): {floors} ms", flush=True)
    floor_by_args = dict(env["dispatch_floor_ms"])  # grows by each case's jit argument count
    stream_floors: dict[int, float] = {}  # the same, per call in a stream of calls
    rows: list[dict[str, Any]] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for family, build in registry.benches(args.paths).items():
        for size in args.sizes:
            try:
                cases = build("cuda", size)
            except Exception as e:
                rows.append({"family": family, "size": size, "error": f"build failed: {e!r}"})
                continue
            for case in cases:
                if args.match and args.match not in case.name:
                    continue
                row: dict[str, Any] = {"family": family, "size": size, "name": case.name}
                try:
                    row["jaxsync"] = measure(case.jax_fn, jax_side, repeat=args.repeat)
                    row["jaxsync"]["kernels"] = jax_executions_per_call(case.jax_fn)
                    row["jaxsync"].update(
                        same_args_floor(case, jax_side, floor_by_args, stream_floors)
                    )
                    baselines = {} if args.jaxsync_only else case.torch_fns
                    for label, fn in baselines.items():
                        fn = _no_grad(fn)  # inference: no autograd bookkeeping in the baselines
                        row[label] = measure(fn, torch_side, repeat=args.repeat)
                        row[label]["kernels"] = torch_kernels_per_call(fn)
                    if case.bytes_moved:
                        row["bytes_moved"] = case.bytes_moved
                        for label in ["jaxsync", *baselines]:
                            ms = row[label]["device_ms"]
                            row[label]["gbps"] = (
                                case.bytes_moved / (ms * 1e-3) / 1e9 if ms else None
                            )
                    if case.flops:
                        row["flops"] = case.flops
                        for label in ["jaxsync", *baselines]:
                            ms = row[label]["device_ms"]
                            row[label]["tflops"] = case.flops / (ms * 1e-3) / 1e12 if ms else None
                except Exception as e:
                    row["error"] = repr(e)[:300]
                rows.append(row)
                _save(out, env, ceilings, rows)  # a run cut short still leaves its rows
                print(f"  measured {case.name}: {_summary(row)}", flush=True)
    result = _save(out, env, ceilings, rows)
    render(result, out)
    return 0 if rows and not any("error" in r for r in rows) else 1
