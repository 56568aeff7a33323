"""jaxsync: sync-free multimodal and KV paths for JAX serving stacks, with proofs.

Core API:
  DeviceCache, default_cache  - per-placement device copies of host constant tables.
  async_h2d, upload_packed    - explicit, alias-safe host->device uploads (one transfer).
  StagingRing, default_staging - reused pinned host buffers: large padded batches written in
                                place and moved by DMA, alias-safe, never waiting.
  Packed                      - a packed upload; index it by field name inside jit.
  bucket                      - pad sizes to buckets so many inputs share one program.
  replicated_near             - device placement for small data used next to an array.
  jit_method                  - jit an NNX module method with its graph split once.
  flat_state                  - a module's state as a flat array list for jit, and its merge.
  precompile, Target          - compile a server's encoders for every bucket ahead of serving.
  LayerStack                  - a tower's repeated layers stored stacked [L, ...], run as one scan.
  TowerProgram                - a family's pure forward compiled over the model's state leaves:
                                the same program a server's own jit compiles.
  Embeddings                  - the output of every model path: padded rows + host lengths.
  PlanCache, metadata_key     - host plans and their packed uploads cached per shape mix,
                                keyed by the exact content of the caller's host metadata.
  CallCache, prepared_call    - repeated calls on device inputs: one lookup, then the program.
  host_array, host_ints,      - host inputs (numpy, lists, torch CPU tensors) validated
  host_int, check_finite        before any upload: no silent truncation, no NaN leaks.
  all_finite, fill_rows         large host checks and padded copies on a small thread pool.
Sub-packages: jaxsync.check (proofs), jaxsync.weights (HF loader), jaxsync.testing,
jaxsync.models, jaxsync.kv; jaxsync.harness (verify, bench, the registry and the `jaxsync`
command), which the runtime never imports.
"""

import importlib
from typing import TYPE_CHECKING


# Names are imported on first use (PEP 562): `import jaxsync` and the `jaxsync` command's
# `--help` import no jax, and a server pays for what it touches.
_EXPORTS = {
    "CallCache": "jaxsync._calls",
    "call_key": "jaxsync._calls",
    "prepared_call": "jaxsync._calls",
    "CacheEntry": "jaxsync._device_cache",
    "DeviceCache": "jaxsync._device_cache",
    "default_cache": "jaxsync._device_cache",
    "all_finite": "jaxsync._fill",
    "fill_rows": "jaxsync._fill",
    "check_finite": "jaxsync._host",
    "host_array": "jaxsync._host",
    "host_int": "jaxsync._host",
    "host_ints": "jaxsync._host",
    "is_torch_tensor": "jaxsync._host",
    "JitMethod": "jaxsync._jit",
    "flat_state": "jaxsync._jit",
    "jit_method": "jaxsync._jit",
    "Embeddings": "jaxsync._outputs",
    "Encoded": "jaxsync._outputs",
    "replicated_near": "jaxsync._placement",
    "PlanCache": "jaxsync._plans",
    "metadata_key": "jaxsync._plans",
    "Compiled": "jaxsync._precompile",
    "Target": "jaxsync._precompile",
    "precompile": "jaxsync._precompile",
    "LayerStack": "jaxsync._stack",
    "StagingRing": "jaxsync._staging",
    "default_staging": "jaxsync._staging",
    "TowerProgram": "jaxsync._tower",
    "Packed": "jaxsync._transfer",
    "async_h2d": "jaxsync._transfer",
    "bucket": "jaxsync._transfer",
    "upload_packed": "jaxsync._transfer",
}
_SUBPACKAGES = ("check", "harness", "hfconfig", "kv", "models", "testing", "weights")

if TYPE_CHECKING:
    from jaxsync._calls import (
        CallCache as CallCache,
        call_key as call_key,
        prepared_call as prepared_call,
    )
    from jaxsync._device_cache import (
        CacheEntry as CacheEntry,
        DeviceCache as DeviceCache,
        default_cache as default_cache,
    )
    from jaxsync._fill import all_finite as all_finite, fill_rows as fill_rows
    from jaxsync._host import (
        check_finite as check_finite,
        host_array as host_array,
        host_int as host_int,
        host_ints as host_ints,
        is_torch_tensor as is_torch_tensor,
    )
    from jaxsync._jit import (
        JitMethod as JitMethod,
        flat_state as flat_state,
        jit_method as jit_method,
    )
    from jaxsync._outputs import Embeddings as Embeddings, Encoded as Encoded
    from jaxsync._placement import replicated_near as replicated_near
    from jaxsync._plans import PlanCache as PlanCache, metadata_key as metadata_key
    from jaxsync._precompile import (
        Compiled as Compiled,
        Target as Target,
        precompile as precompile,
    )
    from jaxsync._stack import LayerStack as LayerStack
    from jaxsync._staging import (
        StagingRing as StagingRing,
        default_staging as default_staging,
    )
    from jaxsync._tower import TowerProgram as TowerProgram
    from jaxsync._transfer import (
        Packed as Packed,
        async_h2d as async_h2d,
        bucket as bucket,
        upload_packed as upload_packed,
    )


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"jaxsync.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxsync' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_SUBPACKAGES})


__version__ = "0.1.0"
