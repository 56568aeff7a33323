"""Load times of each family's tower from a synthetic checkpoint at the released key layout.

Per family, a checkpoint is written once into `--dir/<family>-<size>-<N>L` (a temporary folder,
removed at the end, without `--dir`): every tensor of the released
multimodal model (names and shapes from the transformers class built on the `meta` device with the
released config, under the names `save_pretrained` writes), at the released checkpoint dtype,
sharded as `save_pretrained(max_shard_size="5GB")` shards, with `model.safetensors.index.json`. The
language model's decoder stacks are truncated to `--lm-layers` layers at released width (the
embeddings, heads and every tower are complete); the table says how much was written of how much
released. Tensor bytes are a repeated random pattern: the bench measures I/O and placement only.

Each measurement runs in a fresh process (median of `--repeats`), after `posix_fadvise(DONTNEED)`
on every shard so the files are read from the disk, not the page cache (the output says whether
that took effect, from a timed read of one shard before and after); `--cache warm` instead reads
every shard once first and leaves it cached, so the times are the loader's own work:
  load s     `load_model(dir, dtype=bfloat16)` until every parameter is ready, split into
             abstract (building the module's abstract state), read (tensor bytes from the files),
             transform (layout transforms and casts, written into the parameters' host
             buffers), place (`jax.device_put`) and other (config, headers, checks, and the
             host buffers' pages populated);
  hand s     the same tensors read by hand in another fresh process, alternating with the loads
             (each load and hand read meet the machine in the same state): `safetensors.safe_open`
             (`framework="flax"`, which keeps bf16) and `get_tensor` per key, then one
             `jax.device_put` of each shard's list;
  peak MiB   VmHWM during the load over the VmRSS of the process that imported jax and jaxsync
             (on the CPU backend the placed tower itself is host memory), and of it the peak of
             RssAnon (sampled every 5 ms): the rest is shard pages mapped while they are read;
  MiB read   tensor bytes the loader read (its `read_tensor` calls), and disk MiB the kernel read
             for the process (`/proc/self/io` read_bytes: includes readahead and headers);
  shards     distinct shard files opened (headers included).
The "read every shard" control (`--baseline FAMILY`) `safetensors.flax.load_file`s every shard.

Usage: python tools/bench_load.py [--dir D] [--families glm4v ...] [--lm-layers 2] [--repeats 3]
                                  [--baseline glm4v] [--clean] [--json FILE] [--cache warm]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


sys.path.insert(0, str(Path(__file__).resolve().parent))

from _synth_checkpoint import FAMILIES, build_checkpoint  # noqa: E402


_MIB = 1 << 20


# ---- the measured process ---------------------------------------------------------------------


def _proc(path: str, field: str) -> int:
    """One `field: value` line of a /proc file, as an int (kB fields stay in kB)."""
    for line in Path(path).read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _instrument() -> dict[str, Any]:
    """Counts the shard files opened (every `safe_open` and the loader's data reads), the tensor
    bytes and keys the loader reads, and the seconds of each phase of `load_weights`: building
    the abstract module (`abstract`), reading tensor bytes (`read`), transforms and casts on the
    host (`transform`) and placing (`place`: `jax.device_put`); the rest is `other` (config,
    headers, checks)."""
    import jax
    import safetensors

    from jaxsync.weights import _loader, _stream

    seen: dict[str, Any] = {"files": set(), "bytes": 0, "keys": []}
    phases = dict(abstract=0.0, read=0.0, transform=0.0, place=0.0)
    seen["phases"] = phases

    def timed(phase: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[phase] += time.perf_counter() - t0

        return wrapper

    real_open = safetensors.safe_open

    def safe_open(filename, *args, **kwargs):
        seen["files"].add(os.path.basename(os.fspath(filename)))
        return real_open(filename, *args, **kwargs)

    for module in list(sys.modules.values()):
        if getattr(module, "safe_open", None) is real_open:
            module.safe_open = safe_open
    real_read = _stream.read_tensor

    def read_tensor(handle, info, **kwargs):
        seen["bytes"] += info.nbytes
        seen["keys"].append([str(info.file), info.key])
        return real_read(handle, info, **kwargs)

    _stream.read_tensor = timed("read", read_tensor)
    _stream.read_slice = timed("read", _stream.read_slice)
    _stream._host_value = timed("transform", _stream._host_value)
    _stream.write = timed("transform", _stream.write)
    _loader.abstract_module = timed("abstract", _loader.abstract_module)
    jax.device_put = timed("place", jax.device_put)
    return seen


class _AnonPeak(threading.Thread):
    """Samples RssAnon (the process's own memory: mapped file pages excluded) every 5 ms."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = _proc("/proc/self/status", "RssAnon")
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.005):
            self.peak = max(self.peak, _proc("/proc/self/status", "RssAnon"))

    def stop(self) -> int:
        self._done.set()
        self.join()
        return max(self.peak, _proc("/proc/self/status", "RssAnon"))


def _child(family: str, checkpoint: str, mode: str, keys_file: str | None) -> dict[str, Any]:
    import importlib

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jaxsync  # noqa: F401

    models = importlib.import_module(f"jaxsync.models.{family}")
    from safetensors import safe_open
    from safetensors.flax import load_file

    jax.devices()
    seen = _instrument()
    hand_keys: dict[str, list[str]] = {}
    if mode == "hand":
        for file, key in json.loads(Path(keys_file).read_text()):
            hand_keys.setdefault(file, []).append(key)
    bare = _proc("/proc/self/status", "VmRSS")
    bare_anon = _proc("/proc/self/status", "RssAnon")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    anon = _AnonPeak()
    anon.start()
    disk0 = _proc("/proc/self/io", "read_bytes")
    t0 = time.perf_counter()
    tower_bytes = tower_params = 0
    if mode == "all":
        for shard in sorted(Path(checkpoint).glob("*.safetensors")):
            tensors = load_file(shard)
            jax.block_until_ready(tensors)
            seen["files"].add(shard.name)
            seen["bytes"] += sum(t.nbytes for t in tensors.values())
            del tensors
    elif mode == "hand":  # the same tensors, by hand: safetensors, then one device_put per shard
        device = jax.devices()[0]
        for file, keys in hand_keys.items():
            with safe_open(file, framework="flax") as f:
                arrays = [f.get_tensor(k) for k in keys]
            placed = jax.device_put(arrays, device)
            jax.block_until_ready(placed)
            seen["files"].add(Path(file).name)
            seen["bytes"] += sum(a.nbytes for a in arrays)
            tower_bytes += sum(a.nbytes for a in placed)
            tower_params += sum(a.size for a in placed)
            del arrays, placed
    else:
        tower = models.load_model(checkpoint, dtype=jnp.bfloat16)
        leaves = jax.tree.leaves(nnx.state(tower, nnx.Param))
        jax.block_until_ready(leaves)
        tower_bytes = sum(x.nbytes for x in leaves)
        tower_params = sum(x.size for x in leaves)
        if keys_file:
            Path(keys_file).write_text(json.dumps(seen["keys"]))
    seconds = time.perf_counter() - t0
    phases = dict(seen["phases"]) if mode == "load" else dict.fromkeys(seen["phases"], 0.0)
    return dict(
        seconds=seconds,
        **{f"{k}_s": v for k, v in phases.items()},
        other_s=seconds - sum(phases.values()) if mode == "load" else 0.0,
        peak_mib=(_proc("/proc/self/status", "VmHWM") - bare) / 1024,
        peak_anon_mib=(anon.stop() - bare_anon) / 1024,
        read_mib=seen["bytes"] / _MIB,
        disk_mib=(_proc("/proc/self/io", "read_bytes") - disk0) / _MIB,
        shards_opened=len(seen["files"]),
        tower_bytes=tower_bytes,
        tower_params=tower_params,
    )


# ---- the driver -------------------------------------------------------------------------------


def evict(checkpoint: Path) -> None:
    """Asks the kernel to drop the shards' clean pages from the page cache."""
    for shard in checkpoint.glob("*.safetensors"):
        fd = os.open(shard, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _timed_read(path: Path, nbytes: int) -> tuple[float, int]:
    """(seconds, bytes the kernel read from the disk) to read the first `nbytes` of `path`."""
    disk0 = _proc("/proc/self/io", "read_bytes")
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while nbytes > 0 and (chunk := f.read(min(nbytes, 8 * _MIB))):
            nbytes -= len(chunk)
    return time.perf_counter() - t0, _proc("/proc/self/io", "read_bytes") - disk0


def cache_check(checkpoint: Path, nbytes: int = 512 * _MIB) -> dict[str, float]:
    """Whether eviction works here: one shard read warm, then after `evict`."""
    shard = max(checkpoint.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    nbytes = min(nbytes, shard.stat().st_size)
    _timed_read(shard, nbytes)
    warm_s, warm_disk = _timed_read(shard, nbytes)
    evict(checkpoint)
    cold_s, cold_disk = _timed_read(shard, nbytes)
    return dict(
        mib=nbytes / _MIB,
        warm_gbps=nbytes / warm_s / 1e9,
        cold_gbps=nbytes / cold_s / 1e9,
        warm_disk_mib=warm_disk / _MIB,
        cold_disk_mib=cold_disk / _MIB,
    )


def measure(
    family: str,
    checkpoint: Path,
    repeats: int,
    baseline: bool = False,
    *,
    mode: str | None = None,
    keys: Path | None = None,
    warm: bool = False,
) -> dict:
    """Median over `repeats` fresh processes, each after evicting the shards.

    mode: "load" (the family's `load_model`; writes the keys it read to `keys`), "hand" (the
    keys in `keys`, read by hand) or "all" (every shard; `baseline=True` means it too).
    warm: leave the shards in the page cache (read once first) instead of evicting them.
    """
    mode = mode or ("all" if baseline else "load")
    if warm:
        _warm(checkpoint)
    runs = [_run(family, checkpoint, mode, keys, warm) for _ in range(repeats)]
    return _median(runs)


def measure_side_by_side(
    family: str, checkpoint: Path, repeats: int, keys: Path, warm: bool = False
) -> tuple[dict, dict]:
    """The load and the hand read of the same keys, alternately in fresh processes (so each
    pair meets the machine in the same state, which matters on a shared one): their medians."""
    if warm:
        _warm(checkpoint)
    loads, hands = [], []
    for _ in range(repeats):
        loads.append(_run(family, checkpoint, "load", keys, warm))
        hands.append(_run(family, checkpoint, "hand", keys, warm))
    return _median(loads), _median(hands)


def _warm(checkpoint: Path) -> None:
    for shard in checkpoint.glob("*.safetensors"):
        _timed_read(shard, shard.stat().st_size)


def _run(family: str, checkpoint: Path, mode: str, keys: Path | None, warm: bool) -> dict:
    """One measurement in a fresh process (the shards evicted first unless `warm`)."""
    if not warm:
        evict(checkpoint)
    cmd = [sys.executable, __file__, "--child", family, str(checkpoint), "--mode", mode]
    cmd += ["--keys", str(keys)] if keys else []
    out = subprocess.run(cmd, capture_output=True, text=True, env=_child_env())
    if out.returncode:
        raise RuntimeError(f"{family} measurement failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def table(rows: list[dict]) -> str:
    """One row per family: the load, its phases, the hand read of the same tensors, and the
    memory and bytes of the load; rows labelled "read every shard" are the whole-checkpoint
    control."""
    head = (
        "| family | tower params / MiB | checkpoint GiB / shards written (released) "
        "| shards opened | load s | abstract / read / transform / place / other s "
        "| hand read s | load / hand | peak host MiB over bare (anon) | MiB read |"
    )
    lines = [head, "|" + " --- |" * (head.count(" | ") + 1)]
    for r in rows:
        m, c, hand = r["measured"], r["checkpoint"], r.get("hand")
        params = f"{m['tower_params'] / 1e6:.1f} M / {m['tower_bytes'] / _MIB:,.0f}"
        phases = " / ".join(
            f"{m[k]:.2f}" for k in ("abstract_s", "read_s", "transform_s", "place_s", "other_s")
        )
        if r["label"].endswith("read every shard"):
            params, phases = "", ""
        vs_hand = f"{hand['seconds']:.2f}" if hand else ""
        ratio = f"{m['seconds'] / hand['seconds']:.2f}" if hand else ""
        lines.append(
            f"| {r['label']} | {params} | {c['bytes'] / 2**30:.2f} / {c['shards']} "
            f"({c['released_bytes'] / 2**30:.1f} / {c['shards_released']}) "
            f"| {m['shards_opened']:.0f} | {m['seconds']:.2f} | {phases} | {vs_hand} | {ratio} "
            f"| {m['peak_mib']:,.0f} ({m['peak_anon_mib']:,.0f}) | {m['read_mib']:,.0f} |"
        )
    return "\n".join(lines)


def _family_rows(family: str, root: Path, args: argparse.Namespace) -> list[dict]:
    """Builds (or reuses) one family's checkpoint and measures it (and its baseline)."""
    rows = []
    directory = root / f"{family}-{args.size}-{args.lm_layers}L"
    t0 = time.perf_counter()
    facts = build_checkpoint(
        family, directory, size=args.size, lm_layers=args.lm_layers,
        max_shard_size=args.max_shard_size,
    )  # fmt: skip
    print(f"# {family}: checkpoint ready in {time.perf_counter() - t0:.0f} s ({directory})")
    for note in facts["notes"]:
        print(f"#   {note}")
    print(f"# {family}: page cache eviction check {json.dumps(cache_check(directory))}")
    keys = directory / "keys-read.json"
    warm = args.cache == "warm"
    measured, hand = measure_side_by_side(family, directory, args.repeats, keys, warm=warm)
    rows.append(dict(label=family, checkpoint=facts, measured=measured, hand=hand))
    if family in args.baseline:
        measured = measure(family, directory, args.repeats, baseline=True)
        rows.append(dict(label=f"{family}: read every shard", checkpoint=facts, measured=measured))
    if args.clean:
        shutil.rmtree(directory)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=Path, default=None, help="checkpoint cache (default: a temp dir)")
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--size", default="released", choices=["released", "tiny"])
    p.add_argument("--lm-layers", type=int, default=2)
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline", nargs="*", default=[], help="families to also read whole")
    p.add_argument("--clean", action="store_true", help="delete each checkpoint once measured")
    p.add_argument(
        "--cache", default="cold", choices=["cold", "warm"], help="shards evicted, or cached"
    )
    p.add_argument("--json", type=Path, default=None, help="write the rows here too")
    p.add_argument("--child", nargs=2, metavar=("FAMILY", "CHECKPOINT"), help=argparse.SUPPRESS)
    p.add_argument(
        "--mode", default="load", choices=["load", "hand", "all"], help=argparse.SUPPRESS
    )
    p.add_argument("--keys", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(*args.child, args.mode, args.keys)))
        return
    root = args.dir or Path(tempfile.mkdtemp(prefix="jaxsync-bench-load-"))
    try:
        rows = [row for family in args.families for row in _family_rows(family, root, args)]
    finally:
        if args.dir is None:
            shutil.rmtree(root)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
