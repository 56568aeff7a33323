"""The Pallas block-copy kernel: `copy_blocks` device->device and pinned host->device on GPUs, and
`swap_in` from a `HostPool` (`copy_leaf`; "auto" takes it where `auto_plan` allows).

Why: XLA runs the block copy as a gather and a scatter, two passes over the copied bytes. This
kernel copies each block straight from the source cache into the donated destination in one
pass. Grid `(blocks, row_tiles)`: each program moves a `[1, tile_rows, cols]` slab of one layer's
`[P, rows, cols]` view. Padded entries carry out-of-range destination ids and are skipped.

Pallas warns on every Triton lowering (its Triton backend is deprecated); copies run with that
one warning silenced (`quiet_triton_deprecation`), since test suites that turn warnings into
errors would otherwise fail a correct copy.

Sharded caches: `pallas_call` has no sharding rule, so `plan` runs the kernel per shard under
`shard_map` when src and dst share one NamedSharding that leaves the block axis whole (caches
split over kv heads). Every device copies its slice of every block with the replicated ids; no
collective.

The kernel is pinned to Triton (its `CompilerParams()`): it relies on un-blocked refs being
global-memory pointers, each program loading and storing one slab. Pallas' default GPU backend
(Mosaic GPU) stages un-blocked refs through shared memory instead.

`INTERPRET` (private, for tests): runs the kernel in Pallas' interpreter wherever "auto" looks
for a kernel, so CPU tests exercise the kernel path `copy_blocks` / `swap_in` take on GPUs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools as ft
import math
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec, SingleDeviceSharding

import jaxsync
from jaxsync._compat import quiet_triton_deprecation
from jaxsync.kv import _tpu
from jaxsync.kv._layout import Cache


TRITON: bool | None = None
"""Whether this jax has Pallas' Triton backend (the GPU kernel); None until first asked. Pallas
plans to drop that backend: without it "auto" copies through XLA on GPUs."""


def _pltriton() -> Any:
    """Pallas' Triton module, or None. Imported on first use, never at import: importing Pallas
    adds config states to JAX's trace context (jax >= 0.12), so a server importing jaxsync.kv
    after its warm-up would otherwise trace and compile every warm jit again."""
    try:
        from jax.experimental.pallas import triton as pltriton
    except ImportError:  # pragma: no cover - depends on the installed jax
        return None
    return pltriton


def has_triton() -> bool:
    global TRITON
    if TRITON is None:
        TRITON = _pltriton() is not None
    return TRITON


ALLOW_COMPILED = True
"""Compiled (non-interpret) use of the kernels; a switch to turn them off if a device
misbehaves ("auto" then copies through XLA)."""

INTERPRET: str | None = None
"""Private test switch: "gpu" ("tpu") makes "auto" run the GPU (TPU) kernel in Pallas'
interpreter on any backend (where `plan` accepts the caches)."""


@contextlib.contextmanager
def interpreted(kind: str = "gpu"):
    """Private, for tests: within the block, "auto" runs the `kind` kernel in Pallas'
    interpreter on any backend (see `INTERPRET`)."""
    global INTERPRET
    before, INTERPRET = INTERPRET, kind
    try:
        yield
    finally:
        INTERPRET = before


_TILE_ELEMENTS = 4096  # per program: 8 KiB of bf16, few registers per thread


def platform(leaf: jax.Array) -> str:
    """ "gpu", "cpu" or "tpu": where a cache leaf lives (the default backend for a traced leaf,
    as static scans trace there)."""
    if isinstance(leaf, jax.core.Tracer):
        return jax.default_backend()
    name = next(iter(leaf.devices())).platform
    return "gpu" if name in ("cuda", "rocm", "gpu") else name


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@ft.cache  # called per leaf on every GPU copy (impl="auto"): ~1 us uncached, 32+ leaves
def slab(shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """`(rows, cols, tile_rows)` of a `[P, ...]` leaf viewed as `[P, rows, cols]`, or None when
    Triton's power-of-two block shapes cannot cover it."""
    cols = shape[-1]
    rows = math.prod(shape[1:-1]) if len(shape) > 2 else 1
    if not (_is_pow2(cols) and _is_pow2(rows)):
        return None
    tile = max(1, min(rows, _TILE_ELEMENTS // cols))
    return rows, cols, tile


def _kernel(src_ids, dst_ids, src, dst_in, out, *, row0: int = 0):
    from jax.experimental import pallas as pl  # see `_tpu`: imported where a kernel is built

    del dst_in  # aliased to `out`: blocks not written keep their values
    i, r = pl.program_id(0), pl.program_id(1)
    tile = out.shape[1] // pl.num_programs(1)
    d = dst_ids[i]

    @pl.when(d < out.shape[0])  # padding entries point past the cache
    def _():
        s = src_ids[i]
        out[pl.ds(d, 1), pl.ds(r * tile, tile), :] = src[
            pl.ds(s, 1), pl.ds(row0 + r * tile, tile), :
        ]


def copy_leaf(
    s: jax.Array, d: jax.Array, src_ids, dst_ids, backend: str, *, leaf: int | None = None
) -> jax.Array:
    """d[dst_ids[k]] <- s[src_ids[k]] for one leaf `d: [Pd, *block]`. With `leaf`, `s` is a
    block-major pool `[Ps, L, *block]` and its leaf-th slot of each block is read (`_pool`'s
    host->device swap: the Triton kernel then reads pinned host memory directly).

    backend: "triton" (compiled, GPUs), "interpret" (Pallas' interpreter, any backend), or
    "tpu" / "tpu_interpret" (the Mosaic TPU DMA kernel of `_tpu`, device->device only)."""
    if backend in ("tpu", "tpu_interpret"):
        return _tpu.copy_leaf(s, d, src_ids, dst_ids, interpret=backend == "tpu_interpret")
    rows, cols, tile = slab(d.shape)
    s3 = s.reshape(s.shape[0], -1, cols)  # [Ps, rows] or, for a pool, [Ps, L * rows]
    d3 = d.reshape(d.shape[0], rows, cols)
    interpret = backend == "interpret"
    from jax.experimental import pallas as pl

    out = pl.pallas_call(
        ft.partial(_kernel, row0=(leaf or 0) * rows),
        out_shape=jax.ShapeDtypeStruct(d3.shape, d3.dtype),
        grid=(src_ids.shape[0], rows // tile),
        input_output_aliases={3: 0},
        interpret=interpret,
        # Triton, not the default Mosaic GPU: the kernel relies on un-blocked refs being pointers.
        compiler_params=None if interpret else _pltriton().CompilerParams(),
    )(src_ids, dst_ids, s3, d3)
    return out.reshape(d.shape)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How the kernel runs on a cache: on one device, or per shard under `shard_map` when the
    cache is split over a mesh on axes other than the block axis (then every device copies its
    own slice of every block with the replicated ids, and nothing crosses devices)."""

    mesh: Any = None  # jax.sharding.Mesh / AbstractMesh, None on one device
    spec: PartitionSpec | None = None  # every leaf's spec, block axis unsharded
    backend: str = "triton"  # "triton" / "tpu" (compiled), "interpret" / "tpu_interpret"


def _local_shape(shape: tuple[int, ...], mesh: Any, spec: tuple) -> tuple[int, ...] | None:
    out = list(shape)
    for dim, axes in enumerate(spec):
        for axis in (axes,) if isinstance(axes, str) else (axes or ()):
            if out[dim] % mesh.shape[axis]:
                return None
            out[dim] //= mesh.shape[axis]
    return tuple(out)


_AUTO = "auto axes"


def _leaf_sharding(leaf: jax.Array) -> tuple[Any, tuple] | str | None:
    """(mesh, full-length spec), (None, ()) on one device, `_AUTO` for a traced leaf on a mesh
    with Auto axes, None when not expressible."""
    traced = isinstance(leaf, jax.core.Tracer)
    sharding = jax.typeof(leaf).sharding if traced else leaf.sharding
    if isinstance(sharding, SingleDeviceSharding):  # the common case, without a device set
        return None, ()
    if traced and sharding.mesh.empty or not traced and len(sharding.device_set) == 1:
        return None, ()
    if not isinstance(sharding, NamedSharding):
        return None
    mesh = sharding.mesh
    if traced and any(t != AxisType.Explicit for t in mesh.axis_types):
        return _AUTO  # auto axes are not in the traced type: the real spec is unknown here
    return mesh, tuple(sharding.spec) + (None,) * (leaf.ndim - len(sharding.spec))


def plan(leaves: list[jax.Array], backend: str = "triton") -> Plan | str:
    """The kernel's `Plan` for these leaves (all of src and dst), or why it cannot run them."""
    placements = {_leaf_sharding(x) for x in leaves}
    if _AUTO in placements:
        return "traced caches on a mesh with Auto axes carry no sharding in their type"
    if None in placements or len(placements) != 1:
        return "src and dst leaves must share one placement (a NamedSharding or one device)"
    ((mesh, spec),) = placements
    if spec and spec[0] is not None:
        return "the block axis must not be sharded"
    # Each distinct (shape, itemsize) once: a cache's layers share a few at most.
    kinds = {(tuple(x.shape), x.dtype.itemsize) for x in leaves}
    local = {(_local_shape(shape, mesh, spec) if mesh else shape, size) for shape, size in kinds}
    tiled = not backend.startswith("tpu")  # the TPU kernel moves whole blocks by DMA
    bad = sorted(
        (shape for shape, _ in local if shape is None or tiled and slab(shape) is None), key=repr
    )
    if bad:
        return f"needs power-of-two (per-device) block dims; got leaf shapes {bad}"
    return Plan(mesh, PartitionSpec(*spec) if mesh else None, backend)


def auto_plan(leaves: list[jax.Array], *, tpu: bool = False) -> Plan | None:
    """The kernel plan "auto" runs on these leaves (all of src and dst), or None for XLA.

    GPUs: the compiled Triton kernel (compiled kernels on, a `plan` for them). TPUs, where the
    caller allows it (`tpu`: device->device copies), the Mosaic TPU DMA kernel; never a GPU
    kernel there. The private `INTERPRET` switch runs either kernel interpreted anywhere."""
    where = "gpu" if INTERPRET == "gpu" else "tpu" if INTERPRET == "tpu" else None
    where = where or (platform(leaves[0]) if ALLOW_COMPILED else None)
    if where == "gpu" and (INTERPRET == "gpu" or has_triton()):
        backend = "interpret" if INTERPRET == "gpu" else "triton"
    elif where == "tpu" and tpu:
        backend = "tpu_interpret" if INTERPRET == "tpu" else "tpu"
    else:
        return None
    kernel_plan = plan(leaves, backend)
    return kernel_plan if isinstance(kernel_plan, Plan) else None


@ft.partial(jax.jit, donate_argnames="dst", static_argnames="plan")
def _copy_pallas(src: Cache, dst: Cache, ids: jaxsync.Packed, plan: Plan) -> Cache:
    def local(src, dst, src_ids, dst_ids):
        return jax.tree.map(lambda s, d: copy_leaf(s, d, src_ids, dst_ids, plan.backend), src, dst)

    return per_shard(local, plan, src, dst, ids)


def copy(
    src: Cache, dst: Cache, ids: jaxsync.Packed, kernel_plan: Plan, *, compiled: bool = False
) -> Cache:
    """Same contract as the XLA `_copy_same_memory` (ids padded with out-of-range dst ids), for
    device caches; `src` may also be in pinned host memory (h2d: the kernel reads it directly,
    as `_pool`'s kernel swap does). `compiled`: this exact call signature ran before, so
    nothing is lowered (the warning filter, process-wide state, is then left alone)."""
    if compiled:
        return _copy_pallas(src, dst, ids, kernel_plan)
    with quiet_triton_deprecation():  # Pallas warns whenever the Triton kernel is lowered
        return _copy_pallas(src, dst, ids, kernel_plan)


def per_shard(
    local, plan: Plan, src, dst, ids: jaxsync.Packed, src_spec: PartitionSpec | None = None
):
    """`local(src, dst, src_ids, dst_ids)` on one device, or per shard under `shard_map` when
    `plan.mesh` is set (pallas_call itself has no sharding rule): dst in `plan.spec`, src in
    `src_spec` (default the same), the ids replicated."""
    if plan.mesh is not None:
        replicated = PartitionSpec()
        local = jax.shard_map(
            local,
            mesh=plan.mesh,
            in_specs=(src_spec or plan.spec, plan.spec, replicated, replicated),
            out_specs=plan.spec,
            check_vma=False,
        )
    return local(src, dst, ids["src"], ids["dst"])
