"""Where a path's device time goes, per op class, from a profiler trace of its bench calls.

Runs each selected bench row's jaxsync forward a few times under `jax.profiler.trace`, reads the
device events of the trace and sums their time per call by class (collective, attention, matmul,
conv, copy/transpose, fusion, other), next to a large bf16 matmul's rate measured in the same run
(the ceiling the model's matmuls are compared with).

    jaxsync bench profile [--paths voxtral glm4v] [--size released] [--calls 5] [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile

import jax

from jaxsync.harness.bench._timing import matmul_tflops


# XLA's collective op names (all-reduce.3, all-gather-start) and kernels (nccl*, all_reduce)
_COLLECTIVE = r"nccl|all[-_]?(reduce|gather|to[-_]?all)|collective[-_]permute|reduce[-_]scatter"
CLASSES = (  # first match wins; kernel names of XLA:GPU, cuDNN, cuBLAS, NCCL and Triton
    ("collective", _COLLECTIVE),
    ("attention", r"flash|fmha|cudnn.*(attn|sdpa)|softmax"),
    ("matmul", r"gemm|cublas|nvjet|matmul|dot|wgmma|xmma|cutlass"),
    ("conv", r"conv(?!ert)|fprop_implicit"),  # not XLA's "convert" fusions
    ("copy/transpose", r"copy|transpose|memcpy|memset|dynamic.update.slice|concatenate"),
    ("fusion", r"fusion|reduce|loop_|input_"),
)


def classify(name: str) -> str:
    low = name.lower()
    for label, pattern in CLASSES:
        if re.search(pattern, low):
            return label
    return "other"


def device_events(trace_dir: str) -> list[dict]:
    """Complete events on device (GPU/TPU) lanes of the perfetto trace written under trace_dir."""
    (path,) = glob.glob(f"{trace_dir}/**/*perfetto_trace.json.gz", recursive=True)[:1]
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    device = {pid for pid, n in names.items() if re.search(r"/device:(GPU|TPU)", n)}
    if not device:  # CPU backend: XLA ops run on host threads
        device = set(names)
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in device]


def profile(case, calls: int, top: int = 8) -> tuple[dict[str, float], list[tuple[str, float]]]:
    jax.block_until_ready(case.jax_fn())  # compile and warm up outside the trace
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            outs = [case.jax_fn() for _ in range(calls)]
            jax.block_until_ready(outs)
        events = device_events(d)
    per_class: dict[str, float] = collections.defaultdict(float)
    per_kernel: dict[str, float] = collections.defaultdict(float)
    for e in events:
        ms = e.get("dur", 0) / 1e3 / calls
        per_class[classify(e["name"])] += ms
        per_kernel[e["name"][:70]] += ms
    return dict(per_class), sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]


def main(argv: list[str] | None = None) -> int:
    from jaxsync.harness import registry

    ap = argparse.ArgumentParser(prog="jaxsync bench profile", description=__doc__.splitlines()[0])
    ap.add_argument("--paths", nargs="+", default=None, help="families (default: all)")
    ap.add_argument("--size", default="released", choices=("tiny", "released"))
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--rows", default="", help="only bench rows whose name contains this")
    ap.add_argument("--top", type=int, default=8, help="kernels listed per row")
    args = ap.parse_args(argv)

    device = {"gpu": "cuda"}.get(jax.devices()[0].platform, jax.devices()[0].platform)
    n = 8192 if device != "cpu" else 512
    print(f"device {jax.devices()[0].device_kind}; bf16 matmul {matmul_tflops(n):.0f} TFLOP/s")
    for build in registry.benches(args.paths).values():
        for case in build(device, args.size):
            if args.rows not in case.name:
                continue
            per_class, top = profile(case, args.calls, args.top)
            total = sum(per_class.values())
            split = ", ".join(
                f"{k} {v:.2f}" for k, v in sorted(per_class.items(), key=lambda kv: -kv[1])
            )
            print(f"\n{case.name}: {total:.2f} ms device per call ({split})")
            for name, ms in top:
                print(f"  {ms:8.3f} ms  {name}")
    return 0
