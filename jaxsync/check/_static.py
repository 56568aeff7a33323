"""Static proofs: no host callback in the jaxpr, no host transfer in the lowered or compiled HLO."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax

from jaxsync._compat import quiet_triton_deprecation


# `jax.extend` is imported where a jaxpr is scanned, never at import: on jax >= 0.12 importing it
# loads Pallas, whose config states join JAX's trace context, and every warm jit would trace again.


# Primitives that call back into Python on the host. Any other primitive whose name mentions
# "callback" is reported too, so a future callback flavour is not silently missed.
CALLBACK_PRIMITIVES = frozenset(
    {"pure_callback", "io_callback", "debug_callback", "debug_print", "buffer_callback"}
)
_HOST_IO_PRIMITIVES = frozenset({"infeed", "outfeed"})

# HLO text patterns of host transfers: python-callback custom calls of every backend (CPU, GPU,
# partitioned and legacy variants, buffer callbacks), host send/recv (TPU callbacks), in/outfeed.
_HLO_PATTERNS = (
    ("python callback custom call", re.compile(r"custom_call.*(callback|python)", re.IGNORECASE)),
    ("host send/recv", re.compile(r"is_host_transfer\s*=\s*true", re.IGNORECASE)),
    ("infeed/outfeed", re.compile(r"\b(stablehlo\.|mhlo\.)?(infeed|outfeed)\b")),
)


@dataclasses.dataclass(frozen=True)
class Finding:
    """One host interaction found by a static scan.

    Attributes:
      check: "jaxpr", "lowered" or "compiled".
      what: the primitive or pattern found.
      where: the nesting path in the jaxpr, or the HLO line number.
      detail: source location (jaxpr) or the HLO line.
    """

    check: str
    what: str
    where: str
    detail: str

    def __str__(self) -> str:
        return f"[{self.check}] {self.what} at {self.where}: {self.detail}"


def split_dynamic(args: tuple, kwargs: dict) -> tuple[list[jax.Array], Callable[..., tuple]]:
    """Separates device arrays (traced) from host values (kept static, e.g. block-id lists)."""
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dyn_pos = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
    dyn = [leaves[i] for i in dyn_pos]

    def rebuild(*dyn_values):
        full = list(leaves)
        for i, v in zip(dyn_pos, dyn_values, strict=True):
            full[i] = v
        return jax.tree_util.tree_unflatten(treedef, full)

    return dyn, rebuild


def _sub_jaxprs(value: Any, label: str) -> Iterator[tuple[str, Any]]:
    from jax.extend import core as jex_core

    if isinstance(value, jex_core.ClosedJaxpr):
        yield label, value.jaxpr
    elif isinstance(value, jex_core.Jaxpr):
        yield label, value
    elif isinstance(value, tuple | list):
        for i, v in enumerate(value):
            yield from _sub_jaxprs(v, f"{label}[{i}]")


def iter_eqns(jaxpr: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every equation of `jaxpr` and of every nested jaxpr (cond, while, scan, pjit, remat,
    custom_jvp/vjp, shard_map, ...), with a readable nesting path."""
    for eqn in jaxpr.eqns:
        yield path or "<top>", eqn
        for pname, value in eqn.params.items():
            for label, sub in _sub_jaxprs(value, f"{eqn.primitive.name}.{pname}"):
                yield from iter_eqns(sub, f"{path}/{label}" if path else label)


def _source(eqn: Any) -> str:
    try:
        from jax.extend import source_info_util

        return source_info_util.summarize(eqn.source_info)
    except Exception:  # source info is best effort; never hide the finding itself
        return "?"


def scan_jaxpr(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Finding]:
    """Traces `fn` and reports every host-callback primitive, however deeply nested.

    Host values among the arguments (lists, ints, numpy arrays) stay static; device arrays are
    traced.
    A device->host read inside `fn` fails tracing and is reported as a finding too.

    >>> import jax, jax.numpy as jnp
    >>> def f(x):
    ...     jax.debug.print("x={x}", x=x)
    ...     return x + 1
    >>> [f.what for f in scan_jaxpr(f, jnp.ones(3))]
    ['debug_print']
    >>> scan_jaxpr(lambda x: x * 2, jnp.ones(3))
    []
    """
    dyn, rebuild = split_dynamic(args, kwargs)

    def pure(*d):
        a, k = rebuild(*d)
        return fn(*a, **k)

    try:
        closed = jax.make_jaxpr(pure)(*dyn)
    except jax.errors.ConcretizationTypeError as e:
        return [Finding("jaxpr", "device->host read", "<trace>", str(e).splitlines()[0])]
    except jax.errors.TracerArrayConversionError as e:
        return [Finding("jaxpr", "device->host read", "<trace>", str(e).splitlines()[0])]
    except jax.errors.TracerIntegerConversionError as e:
        return [Finding("jaxpr", "device->host read", "<trace>", str(e).splitlines()[0])]
    except jax.errors.TracerBoolConversionError as e:
        return [Finding("jaxpr", "device->host read", "<trace>", str(e).splitlines()[0])]
    findings = []
    for path, eqn in iter_eqns(closed.jaxpr):
        name = eqn.primitive.name
        if name in CALLBACK_PRIMITIVES or "callback" in name or name in _HOST_IO_PRIMITIVES:
            findings.append(Finding("jaxpr", name, path, _source(eqn)))
    return findings


def scan_hlo_text(text: str, check: str) -> list[Finding]:
    """Reports host-transfer patterns in HLO / StableHLO text."""
    findings = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for what, pattern in _HLO_PATTERNS:
            if pattern.search(line):
                findings.append(Finding(check, what, f"line {lineno}", line.strip()[:160]))
    return findings


def lower(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`jax.jit(fn).lower(...)` with host values among the arguments kept static."""
    dyn, rebuild = split_dynamic(args, kwargs)

    def pure(*d):
        a, k = rebuild(*d)
        return fn(*a, **k)

    with quiet_triton_deprecation():  # an outer program lowers the copy kernel again, here
        return jax.jit(pure).lower(*dyn)


def scan_hlo(
    fn: Callable[..., Any], *args: Any, compiled: bool = True, **kwargs: Any
) -> list[Finding]:
    """Scans the lowered StableHLO and (if `compiled`) the compiled HLO of `fn` for host transfers.

    >>> import jax, jax.numpy as jnp
    >>> def f(x):
    ...     return jax.pure_callback(lambda v: v, jax.ShapeDtypeStruct((3,), jnp.float32), x)
    >>> sorted({f.check for f in scan_hlo(f, jnp.ones(3))})
    ['compiled', 'lowered']
    """
    lowered = lower(fn, *args, **kwargs)
    findings = scan_hlo_text(lowered.as_text(), "lowered")
    if compiled:
        findings += scan_hlo_text(lowered.compile().as_text(), "compiled")
    return findings
