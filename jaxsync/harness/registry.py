"""Registry of sync-free paths, read by `jaxsync verify` and `jaxsync bench`.

Each family registers itself in its package under `jaxsync.harness.paths` (one sub-package per
family: `verify`, `bench`, `reference`); `load_all()` imports every sub-package found there, plus
any module named by a `jaxsync.harness.paths` entry point of another installed distribution.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import pkgutil
from collections.abc import Callable, Sequence
from typing import Any


ENTRY_POINT_GROUP = "jaxsync.harness.paths"
"""Other distributions register paths by naming a module in this entry-point group."""


@dataclasses.dataclass(frozen=True)
class Parity:
    """Result of a comparison against the PyTorch reference.

    Attributes:
      max_err: the measured error (see `metric`).
      tol: the bound it must not exceed.
      metric: "rel" (max-norm relative), "abs", or "mismatches" (count of unequal ids).
      detail: free text (reference used, sizes).
    """

    max_err: float
    tol: float
    metric: str = "rel"
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.max_err <= self.tol

    def __str__(self) -> str:
        return (
            f"{self.metric} {self.max_err:.2e} <= {self.tol:.0e}"
            if self.ok
            else (f"{self.metric} {self.max_err:.2e} > {self.tol:.0e}")
        )


@dataclasses.dataclass(frozen=True)
class PathCase:
    """What `verify` runs for one path.

    Attributes:
      fn: the entry point.
      inputs: two or more argument tuples of one bucket (the first warms up).
      parity: zero-argument callable comparing against the PyTorch reference; raises ImportError
        when torch/transformers are missing.
      kwargs: keyword arguments for every call.
      make_inputs: optional `(bucket) -> argument tuple` giving an input of that bucket, used by
        `jaxsync.precompile` to compile every bucket ahead of serving.
      buckets: the buckets `precompile` compiles by default.
    """

    fn: Callable[..., Any]
    inputs: Sequence[tuple]
    parity: Callable[[], Parity] | None = None
    kwargs: dict = dataclasses.field(default_factory=dict)
    make_inputs: Callable[[int], tuple] | None = None
    buckets: tuple[int, ...] = ()

    def target(self, name: str) -> Any:
        """This case as a `jaxsync.Target` named `name`, for `jaxsync.precompile`."""
        from jaxsync._precompile import Target

        return Target(name, self.fn, self.make_inputs, self.buckets, self.inputs, self.kwargs)


@dataclasses.dataclass(frozen=True)
class PathSpec:
    """A registered path.

    Attributes:
      name: "family.path", e.g. "chameleon.image_tokens".
      description: one line.
      build: `(checkpoint: str | None) -> PathCase`.
      checkpoints: whether `build` loads a checkpoint it is given (`jaxsync verify --checkpoint`);
        False for paths without weights, where verify refuses the option.
    """

    name: str
    description: str
    build: Callable[[str | None], PathCase]
    checkpoints: bool = True

    @property
    def family(self) -> str:
        return self.name.split(".")[0]


@dataclasses.dataclass(frozen=True)
class BenchCase:
    """One benchmark row: the jaxsync path and its PyTorch baselines on the same inputs.

    Attributes:
      name: row label (path and size).
      jax_fn: zero-argument closure that dispatches one forward (rotating inputs), returns outputs.
      torch_fns: label -> zero-argument closure doing the same in torch on the same device.
      bytes_moved: bytes read + written per forward, for bandwidth-bound paths (None otherwise).
      flops: floating-point operations per forward, for matmul-bound paths (None otherwise):
        the row reports TFLOP/s against a bf16 matmul measured in the same run.
      jit_args: zero-argument callable giving the jit argument count of the main program
        `jax_fn` dispatches (the bench times a do-nothing jit of as many arguments beside it).
        None: `jax_fn` is traced once to count them, which suits a closure that keeps no state
        between calls; one that stores its outputs (a donated chain) passes a stateless
        closure here, e.g. `lambda: main_program_args(lambda: copy_blocks(...))`
        (`jaxsync.harness.bench._programs`).
    """

    name: str
    jax_fn: Callable[[], Any]
    torch_fns: dict[str, Callable[[], Any]] = dataclasses.field(default_factory=dict)
    bytes_moved: int | None = None
    flops: float | None = None
    jit_args: Callable[[], int | None] | None = None

    def __post_init__(self):
        unknown = set(self.torch_fns) - set(BASELINES)
        if unknown:
            raise ValueError(f"unknown baseline label(s) {sorted(unknown)}; use {BASELINES}")


# Labels of PyTorch baselines, one vocabulary for every family (the bench chart and tables rely
# on it): vLLM's torch code before / after PR #51458, transformers' modules, reference ceilings.
BASELINES = (
    "vllm_pre_pr",
    "vllm_post_pr",
    "transformers_eager",
    "transformers_sdpa",
    "transformers_torch_extractor",
    "torch_copy_ceiling",
    "torch_pinned_ceiling",
)


_paths: dict[str, PathSpec] = {}
_benches: dict[str, Callable[[str, str], list[BenchCase]]] = {}


def register_path(name: str, description: str = "", *, checkpoints: bool = True) -> Callable:
    """Decorator registering `build(checkpoint) -> PathCase` under `name`.

    `checkpoints=False` declares that the path takes no checkpoint (no weights, or weights it
    cannot load): `jaxsync verify --checkpoint` then refuses it instead of ignoring the option.
    """

    def deco(build: Callable[[str | None], PathCase]) -> Callable[[str | None], PathCase]:
        if name in _paths and _paths[name].build is not build:
            raise ValueError(f"path {name!r} is registered twice")
        _paths[name] = PathSpec(name, description, build, checkpoints)
        return build

    return deco


def register_bench(family: str) -> Callable:
    """Decorator registering `fn(device, size) -> list[BenchCase]` for a family."""

    def deco(fn: Callable[[str, str], list[BenchCase]]) -> Callable[[str, str], list[BenchCase]]:
        _benches[family] = fn
        return fn

    return deco


def path_modules() -> list[str]:
    """The modules whose import registers paths: `jaxsync.harness.paths.<family>`, entry points."""
    import jaxsync.harness.paths

    found = [
        f"jaxsync.harness.paths.{m.name}"
        for m in pkgutil.iter_modules(jaxsync.harness.paths.__path__)
        if not m.name.startswith("_")
    ]
    found += [ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)]
    return sorted(found)


def load_all() -> None:
    """Imports every registering module (a failing import is an error, not a missing family)."""
    for module in path_modules():
        importlib.import_module(module)


def paths(selected: Sequence[str] | None = None) -> list[PathSpec]:
    """Registered paths, optionally filtered by name or family prefix."""
    load_all()
    specs = sorted(_paths.values(), key=lambda s: s.name)
    if not selected:
        return specs
    chosen = [s for s in specs if any(s.name == p or s.family == p for p in selected)]
    unknown = [p for p in selected if not any(s.name == p or s.family == p for s in specs)]
    if unknown:
        raise ValueError(f"unknown path(s) {unknown}; known: {[s.name for s in specs]}")
    return chosen


def benches(
    selected: Sequence[str] | None = None,
) -> dict[str, Callable[[str, str], list[BenchCase]]]:
    """Registered bench builders by family."""
    load_all()
    if not selected:
        return dict(_benches)
    families = {p.split(".")[0] for p in selected}
    return {f: b for f, b in _benches.items() if f in families}
