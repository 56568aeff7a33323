"""The `jaxsync` console command: `verify` (the main job), `precompile`, `bench`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from jaxsync.harness._cli_verify import _select, verify


def precompile(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="jaxsync precompile",
        description="Compile every bucket of the chosen registered paths (jaxsync.precompile). "
        "Useful with a persistent compilation cache (--cache-dir), which later processes reuse.",
    )
    ap.add_argument(
        "--paths", nargs="+", metavar="NAME", help="path names or families (default: all)"
    )
    ap.add_argument(
        "--buckets", nargs="+", type=int, metavar="N", help="bucket sizes (default: each path's)"
    )
    ap.add_argument("--cache-dir", metavar="DIR", help="JAX persistent compilation cache folder")
    args = ap.parse_args(argv)

    bad = [b for b in args.buckets or () if b < 1]
    if bad:
        ap.error(f"--buckets must be positive sizes, got {' '.join(map(str, bad))}")
    import jax

    import jaxsync

    if args.cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
    specs = _select(ap, args.paths)
    # Programs belong to the instances: build each path's own, then compile those.
    done = jaxsync.precompile([s.build(None).target(s.name) for s in specs], args.buckets)
    print(f"{len(done)} program(s) compiled in {sum(c.seconds for c in done):.1f} s")
    return 0


def _bench(argv: Sequence[str]) -> int:
    from jaxsync.harness.bench._cli import bench

    return bench(argv)


COMMANDS: dict[str, tuple[str, Callable[[Sequence[str]], int]]] = {
    "verify": ("prove every registered path parity-exact and sync-free", verify),
    "precompile": ("compile every bucket of registered paths ahead of serving", precompile),
    "bench": ("jaxsync vs its PyTorch baselines on a GPU", _bench),
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jaxsync")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(
        prog="jaxsync",
        description="Sync-free multimodal and KV paths for JAX serving stacks, with proofs that "
        "they never block the host.",
        epilog="commands:\n"
        + "\n".join(f"  {name:<11} {text}" for name, (text, _) in COMMANDS.items())
        + "\n\nRun `jaxsync COMMAND --help` for a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--version", action="version", version=f"jaxsync {_version()}")
    ap.add_argument("command", choices=list(COMMANDS), metavar="COMMAND", help="see below")
    try:
        command = ap.parse_args(argv[:1]).command
        return COMMANDS[command][1](argv[1:])
    except SystemExit as e:  # argparse's --help (0) and usage errors (2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)


if __name__ == "__main__":
    sys.exit(main())
