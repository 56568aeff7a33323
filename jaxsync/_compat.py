"""The private JAX internals jaxsync uses, in one place, each with a public-API fallback.

Everything else in jaxsync uses JAX's public API. Two things live here, with one warning filter
(`quiet_triton_deprecation`) for the kernels and the proofs alike:

- The direct upload (`direct_put`): jaxlib's C++ `batched_device_put`, the call under
  `jax.device_put`, made without `device_put`'s Python around it (about 0.2-0.3 ms of host time
  per small upload on a GPU host with work queued; `jaxsync._transfer` says where the numbers
  come from). It needs the first four symbols of `PRIVATE`; when any of them is missing
  (another jax), `DIRECT_PUT` is False and every upload takes `jax.device_put`, which gives the
  same arrays.
- cuDNN attention over ragged segments (`ragged_attention`), for towers that batch many images
  into one packed sequence; without it (`ragged_attention_available()` False) they take the
  masked dense attention, with the same result.

`tests/test_compat.py` checks each symbol on the installed jax and names the one that moved.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
from typing import Any, NamedTuple

import jax
import numpy as np


class Private(NamedTuple):
    """One private JAX symbol: its module, its (dotted) attribute path there, and why no public
    API replaces it."""

    module: str
    attr: str
    why: str


PRIVATE = (
    Private(
        "jax._src.lib",
        "xla_client.batched_device_put",
        "the C++ transfer under jax.device_put; the public API only offers device_put itself",
    ),
    Private(
        "jax._src.lib",
        "guard_lib.thread_local_state",
        "its `explicit_device_put` flag marks the C++ transfer explicit for the transfer guard, "
        "as device_put does; no public API sets it",
    ),
    Private(
        "jax._src.core",
        "shaped_abstractify",
        "the abstract value batched_device_put takes, built exactly as device_put builds it "
        "(dtype canonicalisation, weak types)",
    ),
    Private(
        "jax._src.core",
        "trace_state_clean",
        "whether a trace is active (an upload under tracing must give a tracer, so it takes "
        "device_put); jax.core no longer exports it",
    ),
    Private(
        "jax._src.cudnn.fused_attention_stablehlo",
        "dot_product_attention",
        "cuDNN flash attention over ragged segments of one packed sequence (segment lengths and "
        "offsets): each segment attends alone and no other segment's blocks are computed; "
        "jax.nn.dot_product_attention takes only per-row padding lengths",
    ),
    Private(
        "jax._src.cudnn.fused_attention_stablehlo",
        "MaskType.PADDING",
        "the mask kind that makes the call above honour the segment lengths",
    ),
)
_UPLOAD = PRIVATE[:4]  # the symbols `direct_put` needs


def _lookup(symbol: Private) -> Any:
    try:
        value = importlib.import_module(symbol.module)
        for name in symbol.attr.split("."):
            value = getattr(value, name)
        return value
    except (ImportError, AttributeError):
        return None


def missing(symbols: tuple[Private, ...] | None = None) -> list[str]:
    """The private symbols (default: all of `PRIVATE`) the installed jax lacks, as
    'module.attr' (empty on a supported jax)."""
    gone = [f"{s.module}.{s.attr}" for s in symbols or PRIVATE if _lookup(s) is None]
    state = _lookup(PRIVATE[1])
    if state is not None and not hasattr(state(), "explicit_device_put"):
        gone.append("jax._src.lib.guard_lib.thread_local_state().explicit_device_put")
    return gone


_batched_device_put, _guard_state, _shaped, _trace_clean = (_lookup(s) for s in _UPLOAD)
DIRECT_PUT = not missing(_UPLOAD)
"""True when `direct_put` can take jaxlib's C++ transfer; False: it calls `jax.device_put`."""


def direct_devices(sharding: jax.sharding.Sharding) -> list[jax.Device] | None:
    """The devices, in the sharding's order, that get a full copy of an array placed by
    `sharding`; None where the array would be split (or the order is not public), which only
    `jax.device_put` handles."""
    if not (sharding.is_fully_replicated and sharding.is_fully_addressable):
        return None
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return list(sharding.device_set)
    if isinstance(sharding, jax.sharding.NamedSharding):
        return list(sharding.mesh.devices.flat)  # the mesh order is the sharding's order
    return None


def direct_put(
    host: np.ndarray,
    target: jax.Device | jax.sharding.Sharding,
    direct: tuple[jax.sharding.Sharding, list[jax.Device]] | None,
) -> jax.Array:
    """`jax.device_put(host, target)` of a host buffer nobody mutates afterwards, through the
    C++ transfer where the installed jax has it, no trace is active and `direct` is
    `(sharding, direct_devices(sharding))` for `target`'s sharding.

    The transfer guard counts it as explicit, as it counts `device_put`. Everything else takes
    `jax.device_put(host, target)` itself (under a trace a device target and its sharding are
    not the same constraint).
    """
    if direct is None or not DIRECT_PUT or not _trace_clean():
        return jax.device_put(host, target)
    sharding, devices = direct
    state = _guard_state()
    explicit, state.explicit_device_put = state.explicit_device_put, True
    try:
        return _batched_device_put(_shaped(host), sharding, [host] * len(devices), devices, True)
    finally:
        state.explicit_device_put = explicit


def tracing() -> bool:
    """Whether a trace may be active (True where the installed jax no longer says): an upload
    then must give a tracer."""
    return _trace_clean is None or not _trace_clean()


def array_type() -> type:
    """The concrete class of `jax.Array` values (jaxlib's ArrayImpl), from a public value: the
    runtime guard patches its conversion methods."""
    with jax.ensure_compile_time_eval():  # a concrete value even if called under a trace
        return type(jax.device_put(np.zeros((), np.int32)))


def ragged_attention_available() -> bool:
    """Whether the installed jax has the cuDNN ragged-segment attention `ragged_attention`
    calls (looked up on first use: the module registers cuDNN primitives on import)."""
    return _lookup(PRIVATE[4]) is not None and _lookup(PRIVATE[5]) is not None


def ragged_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, offsets: jax.Array, scale: float
) -> jax.Array:
    """cuDNN flash attention of every segment of packed rows alone (GPU, 16-bit, inside jit).

    Args:
      q, k, v: [T, N, H] packed rows.
      lengths: int32 [M] rows per segment; -1 in unused slots.
      offsets: int32 [M + 1] first row of each segment, then the end of the last; -1 after it.
      scale: the score scale (1/sqrt(H) for standard attention).

    Returns:
      [T, N, H]; rows in no segment are not written by the kernel (cover every row).
    """
    cudnn = _lookup(PRIVATE[4])
    padding = _lookup(PRIVATE[5])
    lengths, offsets = lengths[None], offsets[None]
    out = cudnn(
        q[None],
        k[None],
        v[None],
        q_seqlen=lengths,
        kv_seqlen=lengths,
        q_offsets=offsets,
        kv_offsets=offsets,
        scale=scale,
        mask_type=padding,
        qkv_layout="BTNH",
    )
    return out[0]


@contextlib.contextmanager
def quiet_triton_deprecation():
    """Silences Pallas' "Triton backend is deprecated" warning, emitted whenever a program holding
    a Pallas Triton kernel (jaxsync.kv's GPU block copy) is lowered, and only that one: under
    warnings-as-errors the lowering would otherwise raise."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning
        )
        yield
