"""`assert_sync_free`: every proof check on one entry point, as one printable report."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxsync.check._guard import SyncError, sync_guard
from jaxsync.check._probe import BlockingReport, measure_blocking
from jaxsync.check._recompile import count_compiles
from jaxsync.check._static import scan_hlo, scan_jaxpr


class SyncFreeError(AssertionError):
    """An entry point failed one of the sync-freedom checks; the message is the report."""


@dataclasses.dataclass(frozen=True)
class Row:
    """One check of a report.

    Attributes:
      check: the check's name.
      ok: whether it passed (None: not run).
      detail: numbers or findings.
    """

    check: str
    ok: bool | None
    detail: str


@dataclasses.dataclass
class Report:
    """The verdicts of `assert_sync_free`, one row per check.

    Attributes:
      name: what was checked.
      rows: the checks.
      blocking: the dispatch-probe numbers (None if the probe did not run).
      compiles: traces + compiles seen while running the extra inputs.
      call_ms: host time of each steady (post warm-up) guarded call, in ms: how long the entry
        point held the host before returning, measured without any extra wait.
    """

    name: str
    rows: list[Row] = dataclasses.field(default_factory=list)
    blocking: BlockingReport | None = None
    compiles: int = 0
    call_ms: list[float] = dataclasses.field(default_factory=list)

    @property
    def host_ms(self) -> float | None:
        """Median host time per steady call (None if no call completed)."""
        return statistics.median(self.call_ms) if self.call_ms else None

    @property
    def ok(self) -> bool:
        return all(r.ok is not False for r in self.rows)

    def row(self, check: str) -> Row:
        return next(r for r in self.rows if r.check == check)

    def __str__(self) -> str:
        width = max([len(r.check) for r in self.rows] + [5])
        lines = [f"sync-freedom report: {self.name}"]
        for r in self.rows:
            verdict = {True: "PASS", False: "FAIL", None: "skip"}[r.ok]
            lines.append(f"  {r.check:<{width}}  {verdict}  {r.detail}")
        return "\n".join(lines)


def _device_leaves(args: tuple, kwargs: dict) -> list[jax.Array]:
    leaves = jax.tree_util.tree_leaves((args, kwargs))
    return [x for x in leaves if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)]


def _findings_row(check: str, findings: list) -> Row:
    if not findings:
        return Row(check, True, "none found")
    return Row(check, False, "; ".join(str(f) for f in findings[:4]))


def check_sync_free(
    fn: Callable[..., Any],
    *args: Any,
    inputs: Sequence[tuple] | None = None,
    probe: bool = True,
    max_blocked_fraction: float = 0.5,
    queue_ms: float = 30.0,
    static: bool = True,
    name: str | None = None,
    progress: Callable[[str], None] | None = None,
    **kwargs: Any,
) -> Report:
    """Runs every check and returns the report without raising (see `assert_sync_free`).

    `progress`, when given, is called with the name of each stage as it starts.
    """
    stage = progress or (lambda text: None)
    report = Report(name or getattr(fn, "__qualname__", repr(fn)))
    if static:
        stage("static scans: tracing, lowering, compiling")
        report.rows.append(
            _findings_row("jaxpr: no host callback", scan_jaxpr(fn, *args, **kwargs))
        )
        try:
            hlo = scan_hlo(fn, *args, **kwargs)
            report.rows.append(_findings_row("hlo: no host transfer", hlo))
        except Exception as e:  # an untraceable fn was already reported by the jaxpr scan
            report.rows.append(Row("hlo: no host transfer", False, f"could not lower: {e!r:.200}"))

    stage("guarded calls")
    calls = [tuple(args)] + [tuple(i) for i in (inputs or [])]
    jax.block_until_ready(fn(*calls[0], **kwargs))  # warm-up: compiles the bucket
    if any(leaf.is_deleted() for leaf in _device_leaves(calls[0], kwargs)):
        raise TypeError(
            "the entry point donated (deleted) its inputs during warm-up, so they cannot be "
            "reused; pass a wrapper that gives each call a fresh on-device copy of the donated "
            "arguments (see tests/kv for an example)"
        )
    guard_row = Row("runtime: sync_guard", True, f"{len(calls)} call(s), no host read")
    outs = []
    with count_compiles() as log:
        try:
            with sync_guard("error"):
                for c in calls:
                    t0 = time.perf_counter()
                    outs.append(fn(*c, **kwargs))
                    report.call_ms.append((time.perf_counter() - t0) * 1e3)
            # Outside the guard (waiting here is the harness's, not the path's), inside the try:
            # on a GPU a guard hit in a host callback surfaces only when the result is awaited.
            jax.block_until_ready(outs)
        except SyncError as e:
            guard_row = Row("runtime: sync_guard", False, str(e).split(". ")[0])
        except Exception as e:  # JAX's own transfer guard (GPU/TPU), or a guard hit in a callback
            guard_row = Row("runtime: sync_guard", False, f"{type(e).__name__}: {str(e)[:200]}")
    report.rows.append(guard_row)
    report.compiles = log.count
    detail = f"{len(calls)} input(s) in one bucket; {log}"
    report.rows.append(Row("no recompile", log.count == 0, detail))

    if probe:
        stage("dispatch probe")
        b = measure_blocking(
            fn, *args, queue_ms=queue_ms, max_blocked_fraction=max_blocked_fraction, **kwargs
        )
        report.blocking = b
        report.rows.append(Row("dispatch probe", b.ok, str(b)))
    return report


def assert_sync_free(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Report:
    """Proves `fn(*args)` never blocks the host; raises `SyncFreeError` with the report otherwise.

    Checks, in order: the jaxpr has no host-callback primitive (nested jaxprs included); the lowered
    and compiled HLO have no host transfer; running `fn` on `args` and on every tuple of `inputs`
    inside `sync_guard("error")` reads nothing back; those calls trace and compile nothing (they
    must share one bucket); and the dispatch probe sees `fn` return while a gate the host holds
    closed keeps its device work queued (`measure_blocking`).

    `fn` is called several times on the same arguments, so it must not donate them: wrap a
    donating entry point so that each call gets a fresh on-device copy (a `TypeError` says so).

    Args:
      fn: the entry point.
      *args: its arguments (device arrays are traced in the static scans, host values stay static).
      inputs: more argument tuples of the same bucket for the no-recompile check.
      probe: run the dispatch probe.
      max_blocked_fraction: the timed fallback's verdict threshold (blocked time / queued device
        time), used only where no gate can be queued on the device (`measure_blocking`).
      **kwargs: keyword arguments for `fn`.

    >>> import jax, jax.numpy as jnp
    >>> f = jax.jit(lambda x: (x * 2).sum())
    >>> print(assert_sync_free(f, jnp.ones(8), inputs=[(jnp.zeros(8),)], queue_ms=5))
    ... # doctest: +ELLIPSIS
    sync-freedom report: ...
      jaxpr: no host callback  PASS  none found
      hlo: no host transfer    PASS  none found
      runtime: sync_guard      PASS  2 call(s), no host read
      no recompile             PASS  2 input(s) in one bucket; 0 trace(s) [], 0 compile(s) []
      dispatch probe           PASS  returned with the queue of 1 device(s) held, ...
    """
    report = check_sync_free(fn, *args, **kwargs)
    if not report.ok:
        raise SyncFreeError(str(report))
    return report
