"""Shared helpers for parity tests against PyTorch / transformers references."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from jaxsync._dispatch_watch import (
    DispatchCount as DispatchCount,
    assert_refused as assert_refused,
    count_dispatch as count_dispatch,
    main_arg_count as main_arg_count,
    watch_uploads as watch_uploads,
)
from jaxsync._distributed import (
    DistributedContext as DistributedContext,
    DistributedError as DistributedError,
    distributed_fixture as distributed_fixture,
    run_distributed as run_distributed,
)


__all__ = [
    "DispatchCount",
    "DistributedContext",
    "DistributedError",
    "abstract_gpu",
    "assert_close",
    "assert_layers_run",
    "assert_refused",
    "assert_same_math",
    "block_id_pairs",
    "count_dispatch",
    "device_mesh",
    "distributed_fixture",
    "donation_copy",
    "fresh_copy",
    "kv_call",
    "main_arg_count",
    "rel_err",
    "requires_torch",  # noqa: F822 (built on first use by __getattr__)
    "run_distributed",
    "save_torch_state",
    "server_step",
    "torch_available",
    "two_devices",
    "watch_uploads",
]


def _host(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor
        x = x.detach().float().cpu().numpy() if x.is_floating_point() else x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.dtype.kind == "V" or str(arr.dtype) == "bfloat16":
        arr = arr.astype(np.float32)
    return arr


def rel_err(actual: Any, expected: Any) -> float:
    """Max-norm relative error: max|a - b| / max|b| (0 when both are all zero).

    >>> rel_err([1.0, 2.0], [1.0, 2.5])
    0.2
    """
    a, b = _host(actual).astype(np.float64), _host(expected).astype(np.float64)
    if a.shape != b.shape:
        raise AssertionError(f"shape mismatch: {a.shape} vs {b.shape}")
    scale = np.max(np.abs(b)) if b.size else 0.0
    diff = np.max(np.abs(a - b)) if a.size else 0.0
    if scale == 0.0:
        return float(diff)
    return float(diff / scale)


def assert_close(actual: Any, expected: Any, *, rtol: float, atol: float = 0.0, err_msg: str = ""):
    """Asserts max|a - b| <= atol + rtol * max|b| and reports both errors on failure.

    The relative part is against the max-norm of `expected` (the convention of every jaxsync parity
    test); NaN never passes.
    """
    a, b = _host(actual).astype(np.float64), _host(expected).astype(np.float64)
    if a.shape != b.shape:
        raise AssertionError(f"{err_msg}: shape mismatch {a.shape} vs {b.shape}")
    if np.isnan(a).any() or np.isnan(b).any():
        raise AssertionError(f"{err_msg}: NaN in {'actual' if np.isnan(a).any() else 'expected'}")
    diff = float(np.max(np.abs(a - b))) if a.size else 0.0
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    if diff > atol + rtol * scale:
        rel = diff / scale if scale else float("inf")
        raise AssertionError(
            f"{err_msg}: max abs err {diff:.3e}, max-norm rel err {rel:.3e} "
            f"(allowed atol={atol:g}, rtol={rtol:g}; scale {scale:.3e})"
        )


def assert_same_math(actual: Any, expected: Any, *, rtol: float = 1e-5, err_msg: str = ""):
    """Two formulations of one float computation (a scanned vs an unrolled layer loop, packed vs
    separate weights): bit-identical on XLA:CPU, where that is observed, and within `rtol`
    (max-norm relative) on other backends, whose compilers may fuse the two programs
    differently and round differently (1e-5: the fp32 parity standard)."""
    import jax

    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(_host(actual), _host(expected), err_msg=err_msg)
    else:
        assert_close(actual, expected, rtol=rtol, err_msg=err_msg)


def save_torch_state(module_or_state: Any, path: str | Path) -> str:
    """Saves a torch module's state_dict (or a dict of tensors) as one safetensors file.

    Tied / shared tensors are cloned so safetensors accepts them; non-contiguous ones are made
    contiguous. Returns the path as a string.
    """
    from safetensors.torch import save_file

    state = (
        module_or_state.state_dict() if hasattr(module_or_state, "state_dict") else module_or_state
    )
    seen: dict[int, str] = {}
    out = {}
    for key, t in state.items():
        t = t.detach().cpu()
        ptr = t.untyped_storage().data_ptr() if t.numel() else -1
        if ptr in seen and ptr != -1:
            t = t.clone()
        seen[ptr] = key
        out[key] = t.contiguous()
    save_file(out, str(path))
    return str(path)


def device_mesh(axis: str = "x", max_devices: int = 8, *, auto: bool = False):
    """A 1-D mesh over the largest power of two <= min(max_devices, devices) of this backend.

    CI gets 8 simulated CPU devices; a multi-GPU machine gets its GPUs. Skips the calling test
    when fewer than 2 devices exist. `auto=True` gives the axis AxisType.Auto (shardings not in
    traced types) instead of jax's default, Explicit.
    """
    import jax

    n = min(max_devices, len(jax.devices()))
    n = 1 << (n.bit_length() - 1)
    if n < 2:
        import pytest

        pytest.skip("needs at least 2 devices")
    kind = jax.sharding.AxisType.Auto if auto else jax.sharding.AxisType.Explicit
    return jax.make_mesh((n,), (axis,), devices=jax.devices()[:n], axis_types=(kind,))


def two_devices():
    """Two distinct devices for per-placement tests: the backend's first two, else (a one-GPU
    machine) two CPU devices, since placement logic does not depend on the backend. Skips the
    calling test when neither exists."""
    import jax

    for devices in (jax.devices(), jax.devices("cpu")):
        if len(devices) >= 2:
            return devices[0], devices[1]
    import pytest

    pytest.skip("needs two devices of one backend")


def block_id_pairs(num_src: int = 13, num_dst: int = 13, *, unique_src: bool = False):
    """Hypothesis strategy: equal-length `(src_ids, dst_ids)` host lists of 1..min(num_src,
    num_dst) block ids, destination ids unique (and source ids too with `unique_src`)."""
    from hypothesis import strategies as st

    @st.composite
    def pairs(draw):
        n = draw(st.integers(1, min(num_src, num_dst)))
        src = st.lists(st.integers(0, num_src - 1), min_size=n, max_size=n, unique=unique_src)
        dst = st.lists(st.integers(0, num_dst - 1), min_size=n, max_size=n, unique=True)
        return draw(src), draw(dst)

    return pairs()


def abstract_gpu(device_kind: str = "NVIDIA H100 80GB HBM3", num_cores: int = 132):
    """A context for lowering Pallas Triton kernels for "cuda" on a host without a GPU.

    Newer jax reads the target GPU from the abstract mesh's device; without one the Triton
    lowering raises "No supported GPU devices found". On a GPU host it does nothing.
    """
    import contextlib

    import jax

    if jax.default_backend() != "cpu":
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(
        device_kind=device_kind, num_cores=num_cores, platform="gpu"
    )
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)


def torch_available() -> bool:
    """True when torch and transformers import."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _requires_torch():
    import pytest

    return pytest.mark.skipif(not torch_available(), reason="torch/transformers not installed")


def __getattr__(name: str):
    if name == "requires_torch":  # built lazily so importing this module does not need pytest
        return _requires_torch()
    raise AttributeError(name)


def _copy_leaves(leaves: list) -> list:
    import jax
    import jax.numpy as jnp

    global _copy_leaves_jit
    if _copy_leaves_jit is None:
        _copy_leaves_jit = jax.jit(lambda xs: [jnp.copy(x) for x in xs])
    return _copy_leaves_jit(leaves)


_copy_leaves_jit = None


def fresh_copy(tree: Any, memory_kind: str = "device") -> Any:
    """An asynchronous copy of a device-resident cache (or `jaxsync.kv.HostPool`) in
    `memory_kind` ("device" or "pinned_host"), same shardings otherwise, for callers that must
    keep an input an entry point donates (tests, `jaxsync verify`).

    Copies *from* pinned host are refused: a program reading a whole pinned-host array can block
    the host until the device queue drains, while device -> pinned transfers do not. Keep the
    master copy on the device (see `donation_copy`).
    """
    import jax

    def on_device(x) -> bool:
        if isinstance(x, jax.core.Tracer):  # traced by a static scan
            return jax.typeof(x).memory_space != jax.memory.Space.Host
        return (x.sharding.memory_kind or "device") == "device"

    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not all(map(on_device, leaves)):
        raise ValueError("fresh_copy copies from device memory only; keep the master on device")
    if memory_kind == "device":
        return jax.tree_util.tree_unflatten(treedef, _copy_leaves(leaves))
    if memory_kind != "pinned_host":
        raise ValueError(f"memory_kind must be 'device' or 'pinned_host', got {memory_kind!r}")
    placed = [jax.device_put(x, x.sharding.with_memory_kind(memory_kind)) for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, placed)


def donation_copy(arg: Any, master: Any, memory_kind: str) -> Any:
    """For harnesses that call a donating entry point repeatedly with one pinned-host argument
    `arg`: a fresh copy of its device-resident `master` (same values) in `memory_kind`, or `arg`
    itself while traced, so that static scans see the entry point's real input."""
    import jax

    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(arg)):
        return arg
    return fresh_copy(master, memory_kind)


def kv_call(fn: Any, *args: Any, impl: str, **kwargs: Any) -> Any:
    """Calls a kv entry point with `impl` "auto" / "xla", or "kernel": the Pallas kernel "auto"
    runs on GPUs, here in Pallas' interpreter on any backend (tests of the kernel path)."""
    if impl != "kernel":
        return fn(*args, impl=impl, **kwargs)
    from jaxsync.kv import _pallas

    with _pallas.interpreted("gpu"):
        return fn(*args, impl="auto", **kwargs)


def assert_layers_run(model: Any, forward: Any, *inputs: Any, rtol: float = 1e-6) -> None:
    """Asserts that every `jaxsync.LayerStack` in `model` reaches `forward`'s output.

    For each stack, its first and last layers' weights are replaced by other values (every
    weight scaled by 2 and shifted by 0.5), and the forward's rows must change: a forward that
    loops over nothing, returns its input, or skips a run of layers is caught. Runs the forward
    under `jax.jit` as a server would (the module merged inside the trace).

    Raises:
      AssertionError: a stack whose layers do not change the output, or a model with no stack.
    """
    import jax
    from flax import nnx

    from jaxsync._stack import LayerStack

    graphdef, state = nnx.split(model)
    step = jax.jit(lambda s, *a: forward(nnx.merge(graphdef, s), *a))
    base = _rows(step(state, *inputs))
    stacks = [(p, n) for p, n in nnx.iter_graph(model) if isinstance(n, LayerStack)]
    if not stacks:
        raise AssertionError("the model holds no jaxsync.LayerStack")
    for path, stack in stacks:
        if not stack.num_layers:
            continue
        for layer in {0, stack.num_layers - 1}:
            changed = nnx.clone(model)
            target = changed
            for p in path:
                target = target[p] if isinstance(p, int) else getattr(target, p)
            for var in jax.tree.leaves(target.layer, is_leaf=lambda x: isinstance(x, nnx.Variable)):
                if isinstance(var, nnx.Variable) and np.issubdtype(var[...].dtype, np.floating):
                    var[...] = var[...].at[layer].set(var[...][layer] * 2 + 0.5)
            out = _rows(step(nnx.state(changed), *inputs))
            if np.allclose(out, base, rtol=rtol, atol=0):
                name = ".".join(str(p) for p in path)
                raise AssertionError(
                    f"changing layer {layer} of {name!r} does not change the output: the forward "
                    "does not run that stack's layers"
                )


def _rows(out: Any) -> np.ndarray:
    """The rows of a forward's output (an `Encoded`, a tuple whose first item is rows, or rows)."""
    rows = getattr(out, "rows", None)
    if rows is None:
        rows = out[0] if isinstance(out, tuple) else out
    return np.asarray(rows, np.float64)


def server_step(model: Any, forward: Any, **jit_kwargs: Any) -> tuple[Any, list]:
    """A server's own jitted step around a family's forward, and the leaves it takes.

    `step(leaves, *inputs) = forward(nnx.merge(graphdef, unflatten(leaves)), *inputs)` under
    `jax.jit`, the state passed as its flat leaves as tpu-inference and sglang-jax pass it: the
    server form that tests and benchmarks compare an entry against.

    Returns:
      `(step, leaves)`: call `step(leaves, *inputs)`; a new state's leaves of the same
      structure need no recompile.
    """
    import jax
    from flax import nnx

    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)

    def step(leaves: list, *inputs: Any) -> Any:
        return forward(nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves)), *inputs)

    return jax.jit(step, **jit_kwargs), leaves
