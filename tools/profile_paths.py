"""Which jax / flax Python runs per call outside jit, for every registered path (not a test).

Each `jaxsync verify` path is called 50 times under cProfile (after warm-up, first input set);
the jax and flax Python functions those calls reach are listed by cumulative time per call.
Cold, on a GPU host, such Python costs several times its profiled warm time (docs/benchmarks.md:
`jax.device_put`'s wrapper took ~0.3 ms per call there), so a hot path should reach almost none:
the jitted call's C++ fast path, a few array attributes, and `jaxsync._transfer._put`.
Note that a path's verify step may include harness work (e.g. `kv.swap_out*` copies the donated
pool per call with `jax.device_put`).

  python tools/profile_paths.py [--paths NAME ...] [--top 6]
"""

from __future__ import annotations

import cProfile
import pstats
import sys

import jax

from jaxsync.harness import registry


def _arg_list(flag: str) -> list[str] | None:
    if flag not in sys.argv:
        return None
    rest = sys.argv[sys.argv.index(flag) + 1 :]
    return [a for a in rest[: next((i for i, a in enumerate(rest) if a.startswith("--")), None)]]


def main() -> None:
    registry.load_all()
    top = int((_arg_list("--top") or ["6"])[0])
    calls = 50
    for spec in registry.paths(_arg_list("--paths")):
        case = spec.build(None)
        args = case.inputs[0]

        def call(case=case, args=args):
            return case.fn(*args, **case.kwargs)

        for _ in range(3):
            jax.block_until_ready(call())
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(calls):
            out = call()
        profile.disable()
        jax.block_until_ready(out)
        rows = []
        for (file, line, fn), (_, ncalls, _, cumtime, _) in pstats.Stats(profile).stats.items():
            if "jax/_src" in file or "flax/" in file:
                where = f"{file.split('site-packages/')[-1]}:{line}({fn})"
                rows.append((cumtime / calls * 1e6, ncalls // calls, where))
        print(f"== {spec.name}")
        for us, n, where in sorted(rows, reverse=True)[:top]:
            print(f"   {us:8.1f} us cumulative per call  x{n:<3d} {where}")


if __name__ == "__main__":
    main()
