"""Terminal table, markdown table and PNG chart of a `jaxsync bench` result."""

from __future__ import annotations

from pathlib import Path
from typing import Any


# The chart's baseline: the first label a row has (vLLM's post-PR torch pattern when it exists).
REFERENCE_LABELS = (
    "vllm_post_pr",
    "transformers_sdpa",
    "transformers_eager",
    "torch_pinned_ceiling",
)


def _baseline(row: dict[str, Any]) -> str | None:
    return next((label for label in REFERENCE_LABELS if label in row), None)


def _labels(row: dict[str, Any]) -> list[str]:
    skip = {"family", "size", "name", "bytes_moved", "flops", "error"}
    return [k for k in row if k not in skip]


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    ceil = result["copy_ceiling_gbps"]
    lines = [
        f"{env['date']} · {env['device']} · jax {env['jax']} · torch {env['torch']} · "
        f"transformers {env['transformers']} · Python {env['python']}",
        f"device-to-device copy ceiling: JAX {ceil['jax']:.0f} GB/s, "
        f"torch {ceil['torch']:.0f} GB/s",
        "",
        "| case | impl | device ms/fwd | host-blocked ms | stream host ms | first call ms "
        "| dispatches | GB/s (% ceiling) | jit args | floor same args ms (blocked / stream) "
        "| TFLOP/s (% matmul) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    matmul = env.get("matmul_tflops")
    if matmul:
        lines.insert(2, f"bf16 matmul ceiling (8192³): {matmul:.0f} TFLOP/s")
    floors = result.get("dispatch_floor_ms") or env.get("dispatch_floor_ms")
    if floors:
        listed = ", ".join(f"{n} args {ms:.3f}" for n, ms in floors.items())
        lines.insert(2, f"do-nothing jit host time: {listed} ms")
    for row in result["rows"]:
        if "error" in row:
            lines.append(
                f"| {row.get('name', row['family'])} | error | {row['error'][:80]} "
                "| | | | | | | | |"
            )
            continue
        for label in _labels(row):
            m = row[label]
            gbps = ""
            if m.get("gbps"):
                c = ceil["jax" if label == "jaxsync" else "torch"]
                pinned = row.get("torch_pinned_ceiling", {}).get("gbps")
                if pinned:  # a host<->device row: its own pinned transfer is the ceiling
                    c = pinned
                gbps = f"{m['gbps']:.0f} ({100 * m['gbps'] / c:.0f}%)"
            kernels = "" if m.get("kernels") is None else str(m["kernels"])
            args = "" if m.get("jit_args") is None else str(m["jit_args"])
            floor = _ms(m.get("floor_same_args_ms"))
            if m.get("floor_stream_ms") is not None:
                floor += f" / {m['floor_stream_ms']:.3f}"
            rate = ""
            if m.get("tflops"):
                share = f" ({100 * m['tflops'] / matmul:.0f}%)" if matmul else ""
                rate = f"{m['tflops']:.0f}{share}"
            lines.append(
                f"| {row['name']} | {label} | {m['device_ms']:.3f} | {m['blocked_ms']:.3f} | "
                f"{_ms(m.get('stream_ms'))} | {m['first_call_ms']:.0f} | {kernels} | {gbps} | "
                f"{args} | {floor} | {rate} |"
            )
    return "\n".join(lines)


def render(result: dict[str, Any], out: Path) -> None:
    text = markdown(result)
    (out / "bench.md").write_text(text + "\n")
    try:
        from rich.console import Console
        from rich.markdown import Markdown

        Console().print(Markdown(text))
    except ImportError:
        print(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullFormatter
    except ImportError:
        print("matplotlib not installed: no chart")
        return
    rows = [r for r in result["rows"] if "error" not in r and _baseline(r)]
    if not rows:
        return
    fig, axes = plt.subplots(1, 2, figsize=(14, max(3, 0.45 * len(rows) + 1.5)))
    names = [r["name"] for r in rows]
    for ax, metric, title in (
        (axes[0], "device_ms", "device time / forward, ratio to baseline (lower is better)"),
        (axes[1], "blocked_ms", "host-blocked time, ratio to baseline (lower is better)"),
    ):
        labels = sorted({lab for r in rows for lab in _labels(r)})
        height = 0.8 / len(labels)
        for i, label in enumerate(labels):
            vals = []
            for r in rows:
                base = r[_baseline(r)][metric]
                v = r.get(label, {}).get(metric)
                vals.append(v / base if v is not None and base > 0 else float("nan"))
            ax.barh([j + i * height for j in range(len(rows))], vals, height, label=label)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor log labels collide
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_yticks([j + 0.4 - height / 2 for j in range(len(rows))], names, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    env = result["environment"]
    fig.suptitle(
        f"jaxsync bench · {env['device']} · jax {env['jax']} · torch {env['torch']}", fontsize=10
    )
    fig.text(0.01, 0.01, "missing bar: below timing resolution", fontsize=7)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(out / "bench.png", dpi=110)


def main(argv: list[str] | None = None) -> int:
    """`jaxsync bench render RESULT.json OUT_DIR`: the tables and chart of a saved run."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="jaxsync bench render", description=main.__doc__)
    ap.add_argument("result", type=Path, help="a bench.json written by `jaxsync bench`")
    ap.add_argument("out", type=Path, help="folder for bench.md and bench.png")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    render(json.loads(args.result.read_text()), args.out)
    return 0
