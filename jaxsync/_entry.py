"""TowerEntry: the per-call host pipeline every family's entry runs, in one place.

A family's entry (`<Family><Modality>Encoder`) supplies three things: its input checks, its
planner (`plan(host metadata, cfg, *, buckets=None) -> <Family>Plan`) and its `forward`. The
`TowerEntry` it holds does the rest:

    return entry(x, metadata)   # `calls.find`: a repeated call on device input is one hit;
    # else `run(x, key, plan_of(metadata))`, the full path:
    # device input: the family's declared checks, `planned` (PlanCache: plan + one upload),
    #   the TowerProgram's prepared call, kept under `key`;
    # host input: host_array, the checks that apply to host data, then `host` (finite, staged)

The call cache's key is derived from the checks (`jaxsync._calls.reads`): every check a kept
call skips declares what it reads, so the key covers it. The program is the `TowerProgram` of
the family's forward, shared by every entry of the same structure (it holds no weights), and the
output is `Embeddings.of(encoded, plan)` with the plan's row layout computed once. Uploads and
staging go through the `jaxsync` namespace and finiteness checks through `jaxsync._host`, each
looked up per call (what tests and tools watch).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Hashable, Iterable
from typing import Any, NamedTuple

import jax

import jaxsync
from jaxsync import _host
from jaxsync._calls import CallCache, deleted_message, prepared_call, reads
from jaxsync._host import host_array
from jaxsync._outputs import Embeddings, Encoded
from jaxsync._placement import check_devices, committed, replicated_near
from jaxsync._plans import PlanCache
from jaxsync._tower import TowerProgram
from jaxsync._transfer import Packed


Layout = tuple[tuple[int, ...], tuple[int, ...]]


class Planned(NamedTuple):
    """What an entry keeps per plan key: all a repeated call needs."""

    plan: Any  # the family's plan (`lengths`, `meta`, its static pads)
    meta: Packed  # the plan's meta, uploaded once
    finish: Callable[[Encoded], Embeddings]  # Encoded -> Embeddings on the plan's row layout


def assembler(layout: Layout) -> Callable[[Encoded], Embeddings]:
    """`Encoded -> Embeddings.of(encoded, plan)` on the plan's row layout computed once:
    extras "finite" and the forward's own."""

    def finish(out: Encoded) -> Embeddings:
        extras = {"finite": out.finite, **out.extras} if out.extras else {"finite": out.finite}
        return Embeddings.from_layout(out.rows, layout, extras)

    return finish


def planned(plan: Any, placement: Any) -> Planned:
    """A plan, its one packed upload to `placement` and its output assembly; a plan with a
    `warning` (a `Warning`, or None) has it emitted by the assembly, on every call with it."""
    finish = assembler(Embeddings.layout(plan.lengths))
    warning = getattr(plan, "warning", None)
    if warning is not None:
        finish = warning_on(finish, warning)
    return Planned(plan, jaxsync.upload_packed(plan, placement=placement), finish)


def warning_on(finish: Callable[[Encoded], Embeddings], warning: Warning) -> Callable:
    """`finish` that first warns `warning` at the caller's line (`warn_at_caller`)."""

    def finish_warned(out: Encoded) -> Embeddings:
        warn_at_caller(warning)
        return finish(out)

    return finish_warned


def warn_at_caller(warning: Warning) -> None:
    """`warnings.warn(warning)` at the first frame outside jaxsync's packages: the line that
    called the entry, however many of jaxsync's frames lie between (a kept call, a first call,
    the `entry_point` wrapper)."""
    ours = tuple(
        os.path.join(path, "")
        for name in ("jaxsync", "jaxsync.models", "jaxsync.kv")
        for path in getattr(sys.modules.get(name), "__path__", ())
    )
    frame, level = sys._getframe(1), 2  # stacklevel 2: this function's caller
    while frame is not None and frame.f_code.co_filename.startswith(ours):
        frame, level = frame.f_back, level + 1
    warnings.warn(warning, stacklevel=level)


def alive(name: str) -> Callable[[jax.Array], None]:
    """A check refusing a deleted (donated) device input (a kept call re-checks it per call)."""

    @reads("live")
    def check(x: jax.Array) -> None:
        if not isinstance(x, jax.core.Tracer) and x.is_deleted():
            raise ValueError(deleted_message(name))

    return check


def on_devices(
    devices: Iterable[jax.Device], name: str, *, uncommitted_moves: bool = False
) -> Callable[[jax.Array], None]:
    """A check refusing a device input that lives on other devices than `devices` (the
    weights'), naming both. `uncommitted_moves`: an uncommitted input passes (JAX moves it)."""
    want = frozenset(devices)

    @reads("sharding")
    def check(x: jax.Array) -> None:
        check_devices(x, want, name)

    @reads("sharding", "committed")
    def check_committed(x: jax.Array) -> None:
        if committed(x) is not None:
            check_devices(x, want, name)

    return check_committed if uncommitted_moves else check


class TowerEntry:
    """The shared host pipeline of one entry point over one `TowerProgram`.

    Args:
      program: the family's `TowerProgram(model, forward)`.
      name: the device input's name in errors (e.g. "pixel_values").
      checks: the family's checks of a device input, in order, each declared with
        `jaxsync._calls.reads`; `check(x)` runs them and the call cache's key covers their reads.
      fits: a check of a device input against its plan, `fits(x, plan)` (e.g. padded to the
        plan's bucket), declared with `reads` too; `device` runs it before keeping the call.
      plan_reads: what the family's planner reads of a device input (its checks of the
        input's shape against the metadata): the key covers it as well.
      plan_cache_size: plan keys (and call signatures) kept, least recently used evicted first.
      plans: a plan cache to share with another entry of the same encoder (default: its own).
      to_host: host input as numpy (default `host_array(x, name=name)`), before the host checks.
      placement: where host input's metadata goes (`run`'s default; None: JAX's default device).
      stage_at: where host input goes (`run`'s default; None: `placement`).
      plan_of: the family's planner of a call's host metadata, `plan_of(*metadata) -> planner`
        (`run`'s `planner`), for `entry(x, *metadata)`.
      rank, shape, dtype: `run`'s defaults (the program's input rank, padded shape and dtype).
      miss: the family's own path of a call `calls.find` missed, `miss(x, key, *metadata)`
        (other input kinds, its own staging); default `run(x, key, plan_of(*metadata))`.
    """

    def __init__(
        self,
        program: TowerProgram,
        *,
        name: str,
        checks: Iterable[Callable[[jax.Array], Any]] = (),
        plan_cache_size: int = 64,
        fits: Callable[[jax.Array, Any], Any] | None = None,
        plans: PlanCache[Planned] | None = None,
        plan_reads: tuple[str, ...] = ("shape", "metadata"),
        to_host: Callable[[Any], Any] | None = None,
        placement: Any = None,
        stage_at: Any = None,
        plan_of: Callable[..., Callable] | None = None,
        rank: int | None = None,
        shape: Callable[[Any], tuple[int, ...]] | None = None,
        dtype: Any = None,
        miss: Callable[..., Any] | None = None,
    ):
        self.program = program
        self.plan_of, self.rank, self.shape, self.dtype = plan_of, rank, shape, dtype
        if miss is not None:
            self.miss = miss
        self.placement, self.stage_at = placement, stage_at
        self.to_host = to_host
        self.name = name
        self.checks = tuple(checks)
        self.fits = fits
        self.plans: PlanCache[Planned] = PlanCache(plan_cache_size) if plans is None else plans
        planner = reads(*plan_reads)(lambda x: None)  # the planner's reads (it checks itself)
        declared = (*self.checks, planner) if fits is None else (*self.checks, fits, planner)
        self.calls = CallCache(plan_cache_size, checks=declared)
        # host data has no liveness nor placement: the checks reading neither apply to it too
        placed = {"live", "sharding", "committed"}
        self.host_checks = tuple(c for c in self.checks if not c.reads & placed)

    def __call__(self, x: Any, *metadata: Any) -> Any:
        """A call of the entry point on input `x` and host `metadata`: a repeated call on device
        input runs the call it kept (one lookup); any other goes to `miss`."""
        run, key = self.calls.find(x, *metadata)
        if run is not None:
            return run(x)
        return self.miss(x, key, *metadata)

    def miss(self, x: Any, key: Hashable | None, *metadata: Any) -> Any:
        """The full path of a call `calls.find` missed: `run` with `plan_of(*metadata)`."""
        return self.run(x, key, self.plan_of(*metadata))

    def check(self, x: jax.Array) -> None:
        """Runs the declared checks of a device input (what a kept call of it skips)."""
        for check in self.checks:
            check(x)

    def run(
        self,
        x: Any,
        key: Hashable | None,
        planner: Callable[[Any, Any], tuple[Hashable, Callable[[], Any]]],
        *,
        placement: Any = None,
        near: Callable[[jax.Array], Any] = replicated_near,
        rank: int | None = None,
        shape: Callable[[Any], tuple[int, ...]] | None = None,
        dtype: Any = None,
        stage_at: Any = None,
        name: str | None = None,
    ) -> Embeddings:
        """The full path of a call `calls.find` missed, on device or host input `x`.

        `planner(x, where) -> (plan key, plan build)` for input `x` whose metadata goes to
        `where`: `near(x)` for a device input (checked by `check`, kept under `key`),
        `placement` for host data (checked by the host checks, then as `host`; a function of
        no argument gives it after the checks). `placement` and `stage_at` default to the
        entry's, as do `rank`, `shape` and `dtype`. `rank`: the program's input rank; an input
        one axis short is one item (a leading axis added).
        """
        rank = self.rank if rank is None else rank
        shape = self.shape if shape is None else shape
        dtype = self.dtype if dtype is None else dtype
        if isinstance(x, jax.Array):
            self.check(x)
            where = near(x)
            plan_key, build = planner(x, where)
            p = self.planned(plan_key, build, where)
            return self.device(x, key, p, unbatched=rank is not None and x.ndim == rank - 1)
        x = host_array(x, name=self.name) if self.to_host is None else self.to_host(x)
        for check in self.host_checks:
            check(x)
        if rank is not None and x.ndim == rank - 1:
            x = x[None]
        placement = self.placement if placement is None else placement
        if callable(placement):
            placement = placement()
        stage_at = self.stage_at if stage_at is None else stage_at
        plan_key, build = planner(x, placement)
        return self.host(
            x, plan_key, build, placement, shape=shape, dtype=dtype, stage_at=stage_at, name=name
        )

    def planned(
        self,
        key: Hashable,
        plan: Callable[[], Any],
        placement: Any,
        *,
        on_miss: Callable[[], Any] | None = None,
    ) -> Planned:
        """The `Planned` of `key`, else `planned(plan(), placement)` after `on_miss()`."""
        return self.plans.get(key, lambda: planned(plan(), placement), on_miss=on_miss)

    def host(
        self,
        x: Any,
        key: Hashable,
        plan: Callable[[], Any],
        placement: Any,
        *,
        shape: Callable[[Any], tuple[int, ...]] | None = None,
        dtype: Any = None,
        stage_at: Any = None,
        name: str | None = None,
        stage: Callable[[Any], jax.Array] | None = None,
        finite: Callable[[], Any] | None = None,
    ) -> Embeddings:
        """A call on host data `x`: NaN / inf refused before a new plan's metadata goes up, or,
        on a known plan, as `x` is copied into its staging buffer (one pass), zero padded to
        `shape(plan)`, uploaded to `stage_at` (default `placement`), then the program and
        `finished`. Host data the family stages itself (e.g. a list of rows) gives `stage(plan)`
        (the copy into the plan's bucket, checked as it copies, uploaded) and `finite()` (the
        check before a new plan)."""
        name = self.name if name is None else name
        if finite is None:
            finite = lambda: _host.check_finite(x, name=name)  # noqa: E731
        p = self.planned(key, plan, placement, on_miss=finite)
        at = placement if stage_at is None else stage_at
        if stage is not None:
            return self.finished(x, self.program(stage(p.plan), p.meta), p, at)
        staged = jaxsync.default_staging.put(
            x, None if shape is None else shape(p.plan), dtype=dtype, placement=at, finite=name
        )
        return self.finished(x, self.program(staged, p.meta), p, at)

    def staged(
        self, x: Any, buffer: Any, key: Hashable, plan: Callable[[], Any], placement: Any,
        stage_at: Any,
    ) -> Any:  # fmt: skip
        """A call on host data `x` the family staged itself: `buffer`, a `default_staging`
        buffer it filled (and checked) at `stage_at`, released if the plan of `key` fails,
        else uploaded; then the program and `finished`."""
        ring = jaxsync.default_staging
        try:
            p = self.planned(key, plan, placement)
        except BaseException:
            ring.release(buffer)
            raise
        return self.finished(x, self.program(ring.upload(buffer), p.meta), p, stage_at)

    def finished(self, x: Any, out: Encoded, p: Planned, where: Any) -> Any:
        """The output of a call on host data `x` staged at `where`: `Embeddings.of(out, plan)`
        (an entry with another output form, or work after a plan's first call, overrides it)."""
        return p.finish(out)

    def device(
        self, x: jax.Array, key: Hashable | None, p: Planned, *, unbatched: bool = False
    ) -> Embeddings:
        """A call on a checked device input: `fits(x, plan)`, then the prepared call, kept
        under `key`, run. `unbatched`: `x` lacks the program's leading batch axis."""
        if self.fits is not None:
            self.fits(x, p.plan)
        run = self.program.prepared(p.meta, finish=p.finish, name=self.name)
        if unbatched:
            run = prepared_call(lambda x, run=run: run(x[None]), self.name)
        return self.calls.keep(key, run)(x)
