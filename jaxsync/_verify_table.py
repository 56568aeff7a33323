"""How `jaxsync verify` prints its results: one row per path, the summary line, the path list."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


HEADER = (
    f"{'path':<30} {'parity':<30} {'static':<7} {'guard':<6} {'recomp':<7} {'host/call':>10} "
    f"{'blocked':>10}  status"
)
STATUS = {"verified": "verified", "skipped": "skipped", "failed": "FAILED"}


def format_row(r: dict[str, Any]) -> str:
    checks = {c["check"]: c["ok"] for c in r.get("checks", [])}
    static = checks.get("jaxpr: no host callback") and checks.get("hlo: no host transfer")
    p = r.get("parity", {})
    if p.get("status") in ("pass", "fail") and "max_err" in p:
        parity = f"{p['status']} {p['metric'][:4]} {p['max_err']:.1e}/{p['tol']:.0e}"
    else:
        parity = p.get("status", "-") + (" (no torch)" if p.get("status") == "skipped" else "")

    def v(x):
        return "-" if x is None else ("PASS" if x else "FAIL")

    host = f"{r['host_ms']:.3f} ms" if "host_ms" in r else "-"
    blocked = f"{r['blocked_ms']:.2f} ms" if "blocked_ms" in r else "-"
    lines = [
        f"{r['path']:<30} {parity:<30} {v(static):<7} "
        f"{v(checks.get('runtime: sync_guard')):<6} "
        f"{v(checks.get('no recompile')):<7} {host:>10} {blocked:>10}  "
        f"{STATUS[r.get('status', 'failed')]}"
    ]
    if "error" in r:
        lines.append(f"    {r['error']}")
    for c in r.get("checks", []):
        if c["ok"] is False:
            lines.append(f"    {c['check']}: {c['detail']}")
    if p.get("status") == "fail":
        lines.append(f"    parity: {p.get('detail')}")
    if r.get("skipped") and r.get("ok"):
        lines.append(f"    skipped: {', '.join(r['skipped'])}")
    return "\n".join(lines)


def summary_line(rows: list[dict[str, Any]]) -> str:
    by = {k: [r["path"] for r in rows if r.get("status") == k] for k in STATUS}
    line = f"{len(by['verified'])} of {len(rows)} paths verified"
    if by["skipped"]:
        line += f"; {len(by['skipped'])} passed with checks skipped: {', '.join(by['skipped'])}"
    if by["failed"]:
        line += f"; FAILED: {', '.join(by['failed'])}"
    return line


def path_listing(specs: Sequence[Any]) -> str:
    width = max([len(s.name) for s in specs] + [4])
    lines = ["registered paths ([no checkpoint]: --checkpoint is refused):"]
    for s in specs:
        note = "" if s.checkpoints else " [no checkpoint]"
        lines.append(f"  {s.name:<{width}}  {s.description}{note}")
    lines.append("families: " + ", ".join(sorted({s.family for s in specs})))
    return "\n".join(lines)
