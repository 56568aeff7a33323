"""jaxsync: sync-free multimodal and KV paths for JAX serving stacks, with proofs.

The public API is `__all__`; every other name lives in a private module (`jaxsync._<name>`).

Uploads:
  async_h2d, upload_packed, Packed - explicit, alias-safe host->device uploads; many small
                                     arrays in one transfer, indexed by name inside jit.
  bucket                           - pad sizes to buckets so many inputs share one program.
  replicated_near                  - where small per-call data used next to an array goes.
  DeviceCache, default_cache       - per-placement device copies of host constant tables.
  StagingRing, default_staging     - reused pinned host buffers for large padded host batches.
A model path (docs/ARCHITECTURE.md):
  LayerStack                       - a tower's repeated layers stored stacked [L, ...], one scan.
  Encoded                          - what every forward returns (rows, finite, extras).
  Embeddings                       - what every entry returns: the rows with host offsets.
  PlanCache                        - host plans and their packed uploads, cached per shape mix.
  TowerProgram                     - a family's forward compiled over the model's state.
  TowerEncoder                     - the base of every family's entry class: the program and
                                     the host pipeline (checks, plans, kept calls, staging).
  flat_state                       - a module's state as flat leaves for a server's own jit.
Serving:
  precompile, Target               - compile a server's encoders for every bucket ahead of use.
Sub-packages: check (the proofs), testing, models, kv, weights (the HF loader), hfconfig
(strict HF configs), harness (`jaxsync verify`, `jaxsync bench`, the registry; the runtime never
imports it).
"""

import importlib
from typing import TYPE_CHECKING


# Names are imported on first use (PEP 562): `import jaxsync` and the `jaxsync` command's
# `--help` import no jax, and a server pays for what it touches.
_EXPORTS = {
    "DeviceCache": "jaxsync._device_cache",
    "default_cache": "jaxsync._device_cache",
    "TowerEncoder": "jaxsync._encoder",
    "flat_state": "jaxsync._jit",
    "Embeddings": "jaxsync._outputs",
    "Encoded": "jaxsync._outputs",
    "replicated_near": "jaxsync._placement",
    "PlanCache": "jaxsync._plans",
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
__all__ = sorted([*_EXPORTS, *_SUBPACKAGES])

if TYPE_CHECKING:  # (harness aside: the runtime never imports it, not even here)
    from jaxsync import (
        check as check,
        hfconfig as hfconfig,
        kv as kv,
        models as models,
        testing as testing,
        weights as weights,
    )
    from jaxsync._device_cache import DeviceCache as DeviceCache, default_cache as default_cache
    from jaxsync._encoder import TowerEncoder as TowerEncoder
    from jaxsync._jit import flat_state as flat_state
    from jaxsync._outputs import Embeddings as Embeddings, Encoded as Encoded
    from jaxsync._placement import replicated_near as replicated_near
    from jaxsync._plans import PlanCache as PlanCache
    from jaxsync._precompile import Target as Target, precompile as precompile
    from jaxsync._stack import LayerStack as LayerStack
    from jaxsync._staging import StagingRing as StagingRing, default_staging as default_staging
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
    """The public names and the module's own dunders; not the private modules nor the
    public-named modules an import happened to bind here (`jaxsync.pytest_plugin`)."""
    return sorted({*__all__, *(n for n in globals() if n.startswith("__"))})


__version__ = "0.1.0"
