"""Where the compiled Pallas block copy differs from the XLA copy (GPU diagnostic, not a test).

For each layout of tests/kv/test_kv_pallas.py: which destination blocks differ, and whether each
differing block holds the old destination (never written), the intended source block (then the
difference is elsewhere), or something else. Also prints which GPU backend the kernel lowers to.

  python tools/diagnose_pallas.py
"""

from __future__ import annotations

import jax
import numpy as np

from jaxsync.kv import KVLayout, _pallas, copy_blocks
from jaxsync.kv._reference import as_numpy


IMPL = "pallas" if jax.default_backend() == "gpu" else "pallas_interpret"  # CPU: a dry run


def main() -> None:
    _pallas.ALLOW_COMPILED = True
    layout = KVLayout(kind="packed", num_blocks=13, block_size=4, num_kv_heads=2, head_dim=8)
    src_ids, dst_ids = list(range(9)), list(range(12, 3, -1))
    src = layout.random(["l0"], jax.random.key(0))
    text = (
        jax.jit(lambda s, d: copy_blocks(s, d, src_ids, dst_ids, impl=IMPL))
        .lower(src, layout.random(["l0"], jax.random.key(1)))
        .as_text()
    )
    print("lowering:", "triton" if "xla.gpu.triton" in text else "mosaic" if "mosaic" in text
          else "other")  # fmt: skip
    old = as_numpy(layout.random(["l0"], jax.random.key(1))["l0"])
    s = as_numpy(src["l0"])
    want = as_numpy(
        copy_blocks(src, layout.random(["l0"], jax.random.key(1)), src_ids, dst_ids)["l0"]
    )
    got = as_numpy(
        copy_blocks(src, layout.random(["l0"], jax.random.key(1)), src_ids, dst_ids,
                    impl=IMPL)["l0"]
    )  # fmt: skip
    intended = dict(zip(dst_ids, src_ids, strict=True))
    for b in range(layout.num_blocks):
        if np.array_equal(got[b], want[b]):
            continue
        bad = np.argwhere(got[b] != want[b])
        kind = (
            "old dst" if np.array_equal(got[b], old[b])
            else f"src block {next((k for k in range(13) if np.array_equal(got[b], s[k])), None)}"
        )  # fmt: skip
        print(f"block {b}: intended src {intended.get(b)}, holds {kind}, "
              f"{len(bad)}/{got[b].size} elements differ, first {bad[:3].tolist()}")  # fmt: skip
    print("done")


if __name__ == "__main__":
    main()
