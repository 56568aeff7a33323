"""The h2d swap prototypes in tools/ land the same blocks as `swap_in` (tiny sizes, CPU).

docs/benchmarks.md compares their speed with `swap_in`; a prototype that copied the wrong blocks
would make that comparison meaningless, so its parity runs in CI.
"""

import os
import pathlib
import subprocess
import sys


TOOL = pathlib.Path(__file__).parents[2] / "tools" / "explore_swap.py"


def test_every_swap_prototype_lands_the_blocks_swap_in_lands(tmp_path):
    args = ["--tiny", "--pool-only", "--runs", "--blocklist", "--hlo", str(tmp_path),
            "--prototypes", "direct,pipelined8,gather"]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    out = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                         env=env, timeout=300, check=True).stdout  # fmt: skip
    checks = [line for line in out.splitlines() if line.endswith(("True", "False"))]
    assert len(checks) == 5, out  # round trip, block list, and three prototypes
    assert all(line.endswith("True") for line in checks), out
    assert {p.name for p in tmp_path.iterdir()} >= {"swap_in.hlo.txt", "direct.hlo.txt"}


def _prototypes():
    sys.path.insert(0, str(TOOL.parent))
    try:
        import swap_prototypes
    finally:
        sys.path.remove(str(TOOL.parent))
    return swap_prototypes


def test_pallas_host_read_kernel_lands_the_blocks_and_asks_for_the_host_pool():
    """The GPU-only prototype's kernel logic (Pallas interpreter, pool on the device), and its
    CUDA lowering: one Triton call per layer, each asking XLA for the pinned pool in place."""
    import functools as ft

    import jax
    import jax.numpy as jnp
    import numpy as np

    sp = _prototypes()
    rng = np.random.default_rng(0)
    pool = rng.standard_normal((9, 3, 2, 4, 8)).astype(np.float32)  # [P_host, L, *block]
    leaves = [rng.standard_normal((7, 2, 4, 8)).astype(np.float32) for _ in range(3)]
    src, dst = np.array([8, 0, 4], np.int32), np.array([6, 1, 2], np.int32)
    run = jax.jit(ft.partial(sp.pallas_host_read, interpret=True))
    got = run(jnp.asarray(pool), [jnp.asarray(x) for x in leaves], src, dst)
    for i, (g, x) in enumerate(zip(got, leaves, strict=True)):
        want = x.copy()
        want[dst] = pool[src, i]
        np.testing.assert_array_equal(np.asarray(g), want)

    from jaxsync.kv import _pallas

    if not _pallas.TRITON:
        return  # the CUDA lowering needs Pallas' Triton backend (the interpreter part ran)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
    pinned = jax.device_put(pool, device.with_memory_kind("pinned_host"))
    args = (pinned, [jnp.asarray(x) for x in leaves], jnp.asarray(src), jnp.asarray(dst))
    from jaxsync.testing import abstract_gpu  # the CUDA target on a GPU-less host

    with _pallas.quiet_triton_deprecation(), abstract_gpu():  # jax >= 0.11 warns on Triton
        text = jax.jit(sp.pallas_host_read).trace(*args).lower(lowering_platforms=("cuda",))
        plain = jax.jit(ft.partial(sp.pallas_host_read, memory_space=None)).trace(*args)
        plain = plain.lower(lowering_platforms=("cuda",)).as_text()
    text = text.as_text()
    calls = [line for line in text.splitlines() if "custom_call @__gpu$xla.gpu.triton" in line]
    assert len(calls) == 3
    assert all('operands_memory_spaces = "{2:5}"' in line for line in calls)
    assert 'mhlo.memory_kind = "pinned_host"' in text
    assert "operands_memory_spaces" not in plain
