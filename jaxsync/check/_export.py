"""Cross-lowering proof: an entry point exports for another platform (TPU) from any host.

`lower_for` traces the entry point as one function (host values static, uploads made while
tracing go through `jax.device_put`), exports it with `jax.export` for the target platform, and
reports what would not run there: a host callback, a host transfer, a float64 value (TPUs have no
native float64), a custom call that only exists on GPUs, or one not known to lower on TPU.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax

from jaxsync._compat import quiet_triton_deprecation
from jaxsync.check._static import (
    Finding,
    scan_hlo_text,
    scan_jaxpr,
    split_dynamic,
)


_FLOAT64 = re.compile(r"(?<=[<x(,\s])f64\b")
_CUSTOM_CALL = re.compile(r'custom_call\s*@"?([^\s("]+)|call_target_name\s*=\s*"([^"]+)"')
# Custom calls of GPU-only libraries and kernels (Triton, cuDNN, Mosaic GPU, CUB, cuBLAS, ...).
_GPU_ONLY = re.compile(
    r"__gpu\$|triton|cudnn|mosaic_gpu|__cub\$|cublas|cusolver|cusparse|^cu_|rocm|hip"
)
_HOST_CALLBACK = re.compile(r"callback|python", re.IGNORECASE)
# Custom calls XLA:TPU lowers: Mosaic TPU kernels (Pallas), sharding and memory-space markers,
# shape assertions, and XLA's own decompositions.
TPU_CUSTOM_CALLS = frozenset(
    {
        "tpu_custom_call",
        "Sharding",
        "SPMDFullToShardShape",
        "SPMDShardToFullShape",
        "annotate_device_placement",
        "shape_assertion",
        "MoveToHost",
        "MoveToDevice",
        "AllocateBuffer",
        "ApproxTopK",
        "TopK",
        "Qr",
        "Eigh",
        "LuDecomposition",
        "ProductOfElementaryHouseholderReflectors",
    }
)
_TPU_PREFIXES = ("xla.sdy.", "stablehlo.", "mhlo.")


def custom_call_findings(text: str, platform: str) -> list[Finding]:
    """Custom calls in StableHLO `text` that are host callbacks, GPU-only, or unknown on TPU."""
    findings = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for match in _CUSTOM_CALL.finditer(line):
            target = match.group(1) or match.group(2)
            if _HOST_CALLBACK.search(target):
                what = f"host callback custom call {target}"
            elif _GPU_ONLY.search(target):
                what = f"GPU-only custom call {target}"
            elif target in TPU_CUSTOM_CALLS or target.startswith(_TPU_PREFIXES):
                continue
            else:
                what = f"custom call {target} not known to lower on {platform}"
            findings.append(
                Finding(f"export:{platform}", what, f"line {lineno}", line.strip()[:160])
            )
    return findings


def exported_text(fn: Callable[..., Any], *args: Any, platform: str = "tpu", **kwargs: Any) -> str:
    """The StableHLO text of `fn(*args, **kwargs)` exported for `platform` (host values static)."""
    dyn, rebuild = split_dynamic(args, kwargs)

    def pure(*d):
        a, k = rebuild(*d)
        return fn(*a, **k)

    with quiet_triton_deprecation():
        return jax.export.export(jax.jit(pure), platforms=[platform])(*dyn).mlir_module()


def lower_for(
    fn: Callable[..., Any], *args: Any, platform: str = "tpu", **kwargs: Any
) -> list[Finding]:
    """Everything in `fn(*args, **kwargs)` that keeps it from running on `platform`; [] if none.

    >>> import jax, jax.numpy as jnp
    >>> lower_for(lambda x: x * 2, jnp.ones(3))
    []
    >>> def wide(x):
    ...     with jax.enable_x64(True):
    ...         return (x.astype(jnp.float64) * 2).astype(jnp.float32)
    >>> [f.what for f in lower_for(wide, jnp.ones(3))][:1]
    ['float64 value']
    """
    check = f"export:{platform}"
    findings = [Finding(check, f.what, f.where, f.detail) for f in scan_jaxpr(fn, *args, **kwargs)]
    if findings:  # a callback or a read at trace time: the export below would only restate it
        return findings
    try:
        text = exported_text(fn, *args, platform=platform, **kwargs)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        return [
            Finding(
                check,
                f"does not lower for {platform}",
                "<export>",
                f"{type(e).__name__}: {first[:200]}",
            )
        ]
    for lineno, line in enumerate(text.splitlines(), 1):
        if _FLOAT64.search(line):
            findings.append(Finding(check, "float64 value", f"line {lineno}", line.strip()[:160]))
            break  # one line names the problem; a float64 path has many
    findings += [Finding(check, f.what, f.where, f.detail) for f in scan_hlo_text(text, check)]
    return findings + custom_call_findings(text, platform)
