"""How `jaxsync verify` prints its results: one row per path, the summary line, the path list,
and the progress bar on stderr."""

from __future__ import annotations

import sys
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


class Progress:
    """A `tqdm` bar on stderr over the paths of a run, naming the path and what it is doing.

    Rows go to stdout through `row` (printed above the bar, in order, as soon as each path is
    done); the bar itself never touches stdout, so `--json` output stays machine-readable.
    """

    def __init__(self, what: str):
        from tqdm import tqdm

        self._tqdm = tqdm
        self.bar = tqdm(
            total=None,
            desc=what,
            unit="path",
            bar_format="{desc} {n_fmt}/{total_fmt} [{bar:20}] {elapsed}{postfix}",
            ascii=" #",
            file=sys.stderr,
            mininterval=0.2,
            leave=False,  # erased when done: what stays is the table, the summary or the error
        )
        self.path = ""

    def start(self, total: int) -> None:
        """The paths are known: `total` of them."""
        self.bar.reset(total=total)

    def stage(self, text: str, path: str | None = None) -> None:
        """Shows `path: text` (the current path when `path` is None)."""
        if path is not None:
            self.path = path
        self.bar.set_postfix_str(f"{self.path}: {text}" if self.path else text)

    def write(self, text: str) -> None:
        """Prints `text` on stdout above the bar."""
        self._tqdm.write(text, file=sys.stdout)
        sys.stdout.flush()

    def done(self, row: str | None = None) -> None:
        """One path finished; its table row (if any) is printed on stdout above the bar."""
        if row is not None:
            self.write(row)
        self.bar.update(1)
        self.bar.refresh()  # a finished path shows at once, whatever tqdm's redraw interval

    def close(self) -> None:
        self.bar.close()
