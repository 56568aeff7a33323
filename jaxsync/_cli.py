"""The `jaxsync` console command: `verify` (the main job), `bench`, `precompile`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any


def _verify_one(spec: Any, checkpoint: str | None, probe: bool, precompile: bool) -> dict[str, Any]:
    from jaxsync._precompile import Target, precompile as run_precompile
    from jaxsync.check import check_sync_free

    row: dict[str, Any] = {"path": spec.name, "description": spec.description}
    t0 = time.perf_counter()
    try:
        case = spec.build(checkpoint)
    except Exception as e:
        row.update(ok=False, error=f"build failed: {e!r}")
        return row
    row["build_s"] = round(time.perf_counter() - t0, 2)
    if precompile:  # the same instance verify then runs, so its programs are the warm ones
        done = run_precompile([Target(spec.name, case)])
        row["precompiled_buckets"] = [c.bucket for c in done]

    if case.parity is None:
        row["parity"] = {"status": "none", "detail": "no reference registered"}
    else:
        try:
            p = case.parity()
            row["parity"] = {
                "status": "pass" if p.ok else "fail",
                "metric": p.metric,
                "max_err": p.max_err,
                "tol": p.tol,
                "detail": p.detail,
            }
        except ImportError as e:
            row["parity"] = {
                "status": "skipped",
                "detail": f"torch/transformers not importable ({e})",
            }
        except Exception as e:
            row["parity"] = {"status": "fail", "detail": f"error: {e!r}"}

    first, *rest = case.inputs
    try:
        report = check_sync_free(case.fn, *first, inputs=rest, probe=probe, **case.kwargs)
        row["checks"] = [{"check": r.check, "ok": r.ok, "detail": r.detail} for r in report.rows]
        row["compiles_in_bucket"] = report.compiles
        if report.blocking is not None:
            row["blocked_ms"] = round(report.blocking.blocked_ms, 3)
            row["queued_ms"] = round(report.blocking.queued_ms, 1)
        checks_ok = report.ok
    except Exception as e:
        row["checks"] = [{"check": "run", "ok": False, "detail": repr(e)[:300]}]
        checks_ok = False
    row["ok"] = checks_ok and row["parity"]["status"] != "fail"
    return row


_HEADER = (
    f"{'path':<30} {'parity':<30} {'static':<7} {'guard':<6} {'recomp':<7} {'blocked':>10}  ok"
)


def _format_row(r: dict[str, Any]) -> str:
    checks = {c["check"]: c["ok"] for c in r.get("checks", [])}
    static = checks.get("jaxpr: no host callback") and checks.get("hlo: no host transfer")
    p = r.get("parity", {})
    if p.get("status") in ("pass", "fail") and "max_err" in p:
        parity = f"{p['status']} {p['metric'][:4]} {p['max_err']:.1e}/{p['tol']:.0e}"
    else:
        parity = p.get("status", "-") + (" (no torch)" if p.get("status") == "skipped" else "")

    def v(x):
        return "-" if x is None else ("PASS" if x else "FAIL")

    blocked = f"{r['blocked_ms']:.2f} ms" if "blocked_ms" in r else "-"
    lines = [
        f"{r['path']:<30} {parity:<30} {v(static):<7} "
        f"{v(checks.get('runtime: sync_guard')):<6} "
        f"{v(checks.get('no recompile')):<7} {blocked:>10}  {'yes' if r.get('ok') else 'NO'}"
    ]
    if "error" in r:
        lines.append(f"    {r['error']}")
    for c in r.get("checks", []):
        if c["ok"] is False:
            lines.append(f"    {c['check']}: {c['detail']}")
    if p.get("status") == "fail":
        lines.append(f"    parity: {p.get('detail')}")
    return "\n".join(lines)


def verify(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="jaxsync verify", description="Verify every registered path.")
    ap.add_argument("--paths", nargs="*", help="path names or families (default: all)")
    ap.add_argument("--checkpoint", help="HF checkpoint (file/dir) for a single selected path")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--no-probe", action="store_true", help="skip the dispatch probe")
    ap.add_argument("--precompile", action="store_true", help="compile every bucket first")
    args = ap.parse_args(argv)

    import jax

    from jaxsync import registry

    jax.config.update("jax_default_matmul_precision", "highest")
    specs = registry.paths(args.paths)
    if args.checkpoint and len(specs) != 1:
        ap.error("--checkpoint needs exactly one path selected with --paths")
    backend = f"{jax.default_backend()} ({jax.devices()[0].device_kind}, jax {jax.__version__})"
    if not args.json:  # rows stream as they finish: a slow or killed run still shows its results
        print(f"jaxsync verify — backend: {backend}")
        print(_HEADER)
        print("-" * len(_HEADER), flush=True)
    rows = []
    for spec in specs:
        rows.append(_verify_one(spec, args.checkpoint, not args.no_probe, args.precompile))
        if not args.json:
            print(_format_row(rows[-1]), flush=True)
    if args.json:
        print(json.dumps({"backend": backend, "paths": rows}, indent=2, default=str))
    else:
        failed = [r["path"] for r in rows if not r.get("ok")]
        print(
            f"{len(rows) - len(failed)} of {len(rows)} paths verified"
            + (f"; FAILED: {', '.join(failed)}" if failed else "")
        )
    return 0 if rows and not any(not r.get("ok") for r in rows) else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"verify": verify}
    try:
        from jaxsync.bench._cli import bench

        commands["bench"] = bench
    except ImportError:
        pass
    if not argv or argv[0] not in commands:
        print(f"usage: jaxsync {{{','.join(commands)}}} [options]   (try: jaxsync verify --help)")
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
