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
