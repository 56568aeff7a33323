"""Where the host time of one `copy_blocks` call goes (GPU exploration, not a test).

Prints host ms for each piece, with ~30 ms of device work queued (so nothing waits on the
device): the whole call, the packed id upload alone, the jitted copy program alone (ids already
on the device), and a do-nothing jit taking and donating the same 2 x L arrays (the dispatch
floor for that many arguments). Python validation is the whole call minus the rest.

  python tools/explore_kv_host.py [--tiny] [--blocks N] [--uploads]

Run it with and without XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1 to compare runtime clients.
--uploads splits the id upload (packing, raw device_put) and times a pinned-host route (a host
copy into pinned memory, then the move to the device inside a program).
"""

from __future__ import annotations

import functools as ft
import statistics
import sys

import jax
import numpy as np

import jaxsync
from jaxsync.bench._timing import _Side, blocked_ms
from jaxsync.kv import _copy, _pallas, copy_blocks
from jaxsync.kv._bench import SIZES
from jaxsync.kv._layout import index_placement


def _blocked(side: _Side, fn, n: int = 9) -> float:
    return statistics.median(blocked_ms(fn, side) for _ in range(n))


@ft.partial(jax.jit, donate_argnames="dst")
def _touch(src, dst):  # returns the donated buffers unchanged: no kernel, only dispatch
    return dst


def main() -> None:
    cfg = SIZES["tiny" if "--tiny" in sys.argv else "released"]  # the `jaxsync bench kv` caches
    layout, layers = cfg["layout"], cfg["layers"]
    n = int(sys.argv[sys.argv.index("--blocks") + 1]) if "--blocks" in sys.argv else 512
    n = min(n, layout.num_blocks // 2)
    names = [f"layer{i:02d}" for i in range(layers)]
    src = layout.random(names, jax.random.key(0))
    state = {"dst": layout.random(names, jax.random.key(1))}
    side = _Side("jax")
    rng = np.random.default_rng(0)
    ids = [(rng.choice(layout.num_blocks, n, replace=False),
            rng.choice(layout.num_blocks, n, replace=False)) for _ in range(4)]  # fmt: skip
    it = iter(range(1 << 30))
    size = jaxsync.bucket(n)
    fields = {"src": np.zeros(size, np.int32), "dst": np.arange(size, dtype=np.int32)}
    leaf = jax.tree.leaves(src)[0]
    impl = "pallas" if _copy._pallas_fits(jax.tree.leaves(src) * 2) else "xla"
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {layers} layers, {n} blocks, "
          f"impl {impl}")  # fmt: skip

    def whole():
        s, d = ids[next(it) % 4]
        state["dst"] = copy_blocks(src, state["dst"], s, d)
        return state["dst"]

    def upload():
        return jaxsync.upload_packed(fields, placement=index_placement(leaf))

    packed = upload()

    def program():
        if impl == "pallas":
            plan = _pallas.plan(jax.tree.leaves(src) * 2)
            with _pallas.quiet_triton_deprecation():
                state["dst"] = _pallas.copy_pallas(src, state["dst"], packed, plan=plan)
        else:
            state["dst"] = _copy._copy_same_memory(src, state["dst"], packed)
        return state["dst"]

    def touch():
        state["dst"] = _touch(src, state["dst"])
        return state["dst"]

    pieces = [("whole copy_blocks", whole), ("packed id upload", upload),
              ("jitted copy program", program),
              (f"no-op jit, {2 * layers} args", touch)]  # fmt: skip
    if "--uploads" in sys.argv:  # where the upload's host time goes, and a pinned-host route
        pieces += _upload_pieces(fields, leaf)
    for name, fn in pieces:
        jax.block_until_ready(fn())
        print(f"{name:28s} {_blocked(side, fn):7.3f} ms host", flush=True)


def _upload_pieces(fields, leaf):
    """Host time of the id upload's parts: packing alone, the raw `device_put` of the packed
    words to the device, the same words to pinned host memory (a host copy), and a jit moving
    pinned ids to the device inside the program (what a pinned-host upload route would add)."""
    words = np.concatenate([np.asarray(v).view(np.uint32) for v in fields.values()])
    device = index_placement(leaf) or jax.devices()[0]
    on_dev = device if isinstance(device, jax.sharding.Sharding) else (
        jax.sharding.SingleDeviceSharding(device))  # fmt: skip
    pinned = on_dev.with_memory_kind("pinned_host")
    staged = jax.device_put(words, pinned)
    to_device = jax.jit(lambda w: jax.device_put(w, jax.memory.Space.Device))
    return [
        ("  packing only (numpy)", lambda: np.concatenate([np.asarray(v).view(np.uint32)
                                                          for v in fields.values()])),
        ("  device_put words -> device", lambda: jax.device_put(words, on_dev)),
        ("  device_put words -> pinned", lambda: jax.device_put(words, pinned)),
        ("  jit: pinned words -> device", lambda: to_device(staged)),
    ]  # fmt: skip


if __name__ == "__main__":
    main()
