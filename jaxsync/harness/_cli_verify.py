"""`jaxsync verify`: parity, the static scans, the runtime guard, no recompile and the dispatch
probe of every chosen registered path; `--lower-for tpu` exports each path for TPU instead."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from jaxsync.harness._verify_table import HEADER, Progress, format_row, path_listing, summary_line


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if type(e).__name__ in text else f"{type(e).__name__}: {text}"


def _build(spec: Any, checkpoint: str | None) -> Any:
    """`spec.build(checkpoint)`; with a checkpoint, any failure is the checkpoint's (the path
    builds without one), raised as `CheckpointError` naming it."""
    if checkpoint is None:
        return spec.build(None)
    try:
        return spec.build(checkpoint)
    except Exception as e:
        raise CheckpointError(f"--checkpoint {checkpoint}: {spec.name}: {_one_line(e)}") from e


def _verify_one(
    spec: Any, checkpoint: str | None, probe: bool, precompile: bool, progress: Progress
) -> dict[str, Any]:
    from jaxsync._precompile import precompile as run_precompile
    from jaxsync.check import check_sync_free

    row: dict[str, Any] = {"path": spec.name, "description": spec.description}
    t0 = time.perf_counter()
    progress.stage("building", spec.name)
    try:
        case = _build(spec, checkpoint)
    except CheckpointError:
        raise
    except Exception as e:
        row.update(ok=False, error=f"build failed: {_one_line(e)}", status="failed", checks=[])
        return row
    row["build_s"] = round(time.perf_counter() - t0, 2)
    if precompile:  # the same instance verify then runs, so its programs are the warm ones
        progress.stage("precompiling every bucket")
        done = run_precompile([case.target(spec.name)], progress=False)
        row["precompiled_buckets"] = [c.bucket for c in done]

    progress.stage("parity against the reference")
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
        report = check_sync_free(
            case.fn, *first, inputs=rest, probe=probe, progress=progress.stage, **case.kwargs
        )
        row["checks"] = [{"check": r.check, "ok": r.ok, "detail": r.detail} for r in report.rows]
        row["compiles_in_bucket"] = report.compiles
        if report.host_ms is not None:
            row["host_ms"] = round(report.host_ms, 3)
        if report.blocking is not None:
            row["blocked_ms"] = round(report.blocking.blocked_ms, 3)
            row["queued_ms"] = round(report.blocking.queued_ms, 1)
        checks_ok = report.ok
    except Exception as e:
        row["checks"] = [{"check": "run", "ok": False, "detail": repr(e)[:300]}]
        checks_ok = False
    row["ok"] = checks_ok and row["parity"]["status"] != "fail"
    row["skipped"] = [c["check"] for c in row["checks"] if c["ok"] is None]
    if not probe:
        row["skipped"].append("dispatch probe")
    if row["parity"]["status"] == "skipped":
        row["skipped"].append("parity (no torch)")
    row["status"] = "failed" if not row["ok"] else ("skipped" if row["skipped"] else "verified")
    return row


def _select(
    ap: argparse.ArgumentParser, selected: Sequence[str] | None, checkpoint: str | None = None
) -> list[Any]:
    """The registered paths named by `--paths` (all without it), path names and family names
    alike; unknown names are a usage error (exit 2) that lists the valid ones.

    With a checkpoint, a family name stands for the family's paths that load one, a path named
    explicitly must load one, and the chosen paths must be of one family (one checkpoint is one
    model).
    """
    from jaxsync.harness import registry

    specs = registry.paths()
    known = {s.name for s in specs} | {s.family for s in specs}
    unknown = [p for p in selected or () if p not in known]
    if unknown:
        ap.error(f"unknown path(s) {', '.join(unknown)}\n{path_listing(specs)}")
    chosen = registry.paths(selected)
    if checkpoint is None:
        return chosen
    named = set(selected or ())
    refused = [s.name for s in chosen if not s.checkpoints and s.name in named]
    if refused:
        ap.error(f"--checkpoint: {', '.join(refused)} take(s) no checkpoint")
    chosen = [s for s in chosen if s.checkpoints]
    families = sorted({s.family for s in chosen})
    if len(families) != 1:
        ap.error(
            "--checkpoint needs the paths of one family selected with --paths (a path or a "
            f"family name); selected: {', '.join(families) or 'none that takes a checkpoint'}"
        )
    if not os.path.exists(checkpoint):
        ap.error(f"--checkpoint {checkpoint}: no such file or directory")
    return chosen


class CheckpointError(Exception):
    """A path could not be built from the checkpoint given with `--checkpoint`."""


def _lower_rows(
    specs: Sequence[Any], checkpoint: str | None, platform: str, progress: Progress
) -> list[dict]:
    from jaxsync.check import lower_for

    rows = []
    for spec in specs:
        row: dict[str, Any] = {"path": spec.name, "platform": platform}
        progress.stage("building", spec.name)
        try:
            case = _build(spec, checkpoint)
            first = case.inputs[0]
            progress.stage(f"exporting for {platform}")
            findings = lower_for(case.fn, *first, platform=platform, **case.kwargs)
            row["findings"] = [str(f) for f in findings]
        except CheckpointError:
            raise
        except Exception as e:
            row["findings"] = [f"build or trace failed: {e!r:.200}"]
        row["ok"] = not row["findings"]
        rows.append(row)
        progress.done()
    return rows


def _verify_parser(listing: bool = True) -> argparse.ArgumentParser:
    """verify's parser; `listing` loads the registry for the path list in `--help`."""
    from jaxsync.harness import registry

    ap = argparse.ArgumentParser(
        prog="jaxsync verify",
        description="Verify registered paths: parity against the reference, no host callback or "
        "transfer (static), no host read (runtime guard), no recompile within a bucket, and the "
        "dispatch probe. A path whose parity could not run (no torch) counts as skipped.",
        epilog=path_listing(registry.paths()) if listing else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--paths", nargs="+", metavar="NAME", help="path names or families (default: all)"
    )
    ap.add_argument(
        "--checkpoint", metavar="DIR", help="checkpoint (file/dir) for one selected path"
    )
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--no-probe", action="store_true", help="skip the dispatch probe")
    ap.add_argument("--precompile", action="store_true", help="compile every bucket first")
    ap.add_argument(
        "--strict", action="store_true", help="fail when any check or parity was skipped"
    )
    ap.add_argument(
        "--lower-for",
        choices=["tpu"],
        metavar="PLATFORM",
        help="instead of verifying, export each path for PLATFORM (tpu) from this host and fail on "
        "float64, host callbacks and custom calls that do not lower there",
    )
    return ap


def verify(argv: Sequence[str]) -> int:
    ap = _verify_parser(listing="-h" in argv or "--help" in argv)
    args = ap.parse_args(argv)
    what = "jaxsync verify" + (f" --lower-for {args.lower_for}" if args.lower_for else "")
    progress = Progress(what)  # on stderr from the first second
    try:
        return _verify(ap, args, progress)
    except CheckpointError as e:  # one line, after the bar is gone
        progress.close()
        print(f"jaxsync verify: error: {e}", file=sys.stderr)
        return 2
    finally:
        progress.close()


def _verify(ap: argparse.ArgumentParser, args: argparse.Namespace, progress: Progress) -> int:
    progress.stage("loading jax and the registered paths")
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    specs = _select(ap, args.paths, args.checkpoint)
    backend = f"{jax.default_backend()} ({jax.devices()[0].device_kind}, jax {jax.__version__})"
    progress.start(len(specs))
    if args.lower_for:
        return _lower_for(specs, args, backend, progress)
    if not args.json:  # rows stream as they finish: a slow or killed run still shows its results
        progress.write(f"jaxsync verify — backend: {backend}\n{HEADER}\n{'-' * len(HEADER)}")
    rows = []
    for spec in specs:
        row = _verify_one(spec, args.checkpoint, not args.no_probe, args.precompile, progress)
        rows.append(row)
        progress.done(None if args.json else format_row(row))
    progress.close()
    if args.json:
        print(json.dumps({"backend": backend, "paths": rows}, indent=2, default=str))
    else:
        print(summary_line(rows))
    failed = any(r["status"] == "failed" for r in rows)
    skipped = any(r["status"] == "skipped" for r in rows)
    return 1 if not rows or failed or (args.strict and skipped) else 0


def _lower_for(
    specs: Sequence[Any], args: argparse.Namespace, backend: str, progress: Progress
) -> int:
    rows = _lower_rows(specs, args.checkpoint, args.lower_for, progress)
    progress.close()
    if args.json:
        print(json.dumps({"backend": backend, "lower_for": rows}, indent=2))
    else:
        print(f"jaxsync verify --lower-for {args.lower_for} — traced on: {backend}")
        width = max(len(r["path"]) for r in rows)
        for r in rows:
            print(f"{r['path']:<{width}}  {'ok' if r['ok'] else 'FAILED'}")
            for f in r["findings"][:4]:
                print(f"    {f}")
        bad = [r["path"] for r in rows if not r["ok"]]
        print(
            f"{len(rows) - len(bad)} of {len(rows)} paths lower for {args.lower_for}"
            + (f"; FAILED: {', '.join(bad)}" if bad else "")
        )
    return 0 if rows and all(r["ok"] for r in rows) else 1
