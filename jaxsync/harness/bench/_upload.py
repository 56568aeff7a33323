"""Large host uploads: pageable transfers against the pinned staging ring (one device).

For each batch (15 MB float32 waveforms, 9 MB bfloat16 patches, 61 MB float32 features; the
data a few rows short of its bucket, as an entry pads it) prints the median host time until
the call returns and the end-to-end rate (call to last byte on the device) of:

* `device_put`: `jax.device_put` of a ready, full-size pageable array;
* `async_h2d`: `jaxsync.async_h2d` of the same (its private host copy included);
* `pad + async_h2d`: a fresh zero-padded buffer, filled, uploaded with `copy=False`;
* `ring`: `StagingRing.put` (the padding copy into a pinned buffer, then the DMA);
* `ring DMA`: the ring's pinned->device transfer alone, from a filled buffer, in both forms
  (`jaxsync._pinned.transfer`: a jitted copy, GPUs' default, and `device_put`);
* `torch pinned`: `tensor.to("cuda", non_blocking=True)` from pinned memory (torch + CUDA only).

Then the voxtral entry on 8 x 30 s host waveforms (a one-layer tower with Whisper's 1500
positions), through the ring and with the ring bypassed (its rate counts the whole forward).
Each call runs alone (the previous one
finished), so the ring reuses one buffer.

`--small` instead compares the two paths where `StagingRing.min_bytes` draws the line (64 KiB to
16 MiB): host ms of `async_h2d` and of a pinned `StagingRing.put`, cold and in a stream behind
queued device work (the bench's harness), and the end-to-end ms of one call run alone.

    jaxsync bench upload [--repeats 20] [--small]
    jaxsync bench upload --smoke   # small batches, few repeats: a CPU check
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
from flax import nnx

import jaxsync
from jaxsync import _pinned


CASES = {  # name: (bucket shape, dtype, real rows)
    "15 MB f32 [8, 480000]": ((8, 480_000), np.float32, 7),
    "9 MB bf16 [4096, 1176]": ((4096, 1176), jax.numpy.bfloat16, 4001),
    "61 MB f32 [32, 128, 3750]": ((32, 128, 3750), np.float32, 29),
}
SMOKE_CASES = {"61 KB f32 [8, 1920]": ((8, 1920), np.float32, 7)}


def _measure(fn, wait, nbytes: int, repeats: int) -> tuple[float, float]:
    """(median host ms to return, end-to-end GB/s) over `repeats` calls, each run alone."""
    wait(fn())  # warm up (compiles, first allocations)
    host, total = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        wait(out)
        host.append(t1 - t0)
        total.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(host), nbytes / statistics.median(total) / 1e9


def _torch_pinned(data: np.ndarray):
    """(call, wait) for a pinned torch DMA of `data`, or None without torch + CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    src = torch.from_numpy(data.view(np.uint8).copy()).pin_memory()  # bytes: bf16 included
    return (lambda: src.to("cuda", non_blocking=True)), (lambda _: torch.cuda.synchronize())


def bench_case(shape, dtype, rows: int, repeats: int) -> dict[str, tuple[float, float]]:
    device = jax.devices()[0]
    target = jax.sharding.SingleDeviceSharding(device)
    dtype = np.dtype(dtype)
    full = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    data = full[:rows]
    nbytes = full.nbytes
    ring = jaxsync.StagingRing()
    ring.reserve(shape, dtype, device, count=2)
    pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    stage = jax.block_until_ready(jax.device_put(full, pinned))  # a filled pinned buffer

    def padded():
        host = np.zeros(shape, dtype)
        host[:rows] = data
        return jaxsync.async_h2d(host, placement=device, copy=False)

    calls = {
        "device_put": lambda: jax.device_put(full, device),
        "async_h2d": lambda: jaxsync.async_h2d(full, placement=device),
        "pad + async_h2d": padded,
        "ring": lambda: ring.put(data, shape, placement=device),
        "ring DMA (jitted copy)": lambda: _pinned.transfer(stage, target, "jit"),
        "ring DMA (device_put)": lambda: _pinned.transfer(stage, target, "put"),
    }
    results = {name: _measure(fn, jax.block_until_ready, nbytes, repeats)
               for name, fn in calls.items()}  # fmt: skip
    torch_call = _torch_pinned(full)
    if torch_call is not None:
        results["torch pinned"] = _measure(*torch_call, nbytes, repeats)
    return results


def bench_voxtral(repeats: int, seconds: int = 30) -> dict[str, tuple[float, float]]:
    """The voxtral entry on 8 host waveforms of `seconds` each, through the default ring and
    bypassing it."""
    from jaxsync.models.voxtral import VoxtralAudioConfig, VoxtralAudioEncoder, VoxtralAudioTower

    cfg = VoxtralAudioConfig(
        num_mel_bins=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, max_source_positions=1500, text_hidden_size=64,
    )  # fmt: skip
    enc = VoxtralAudioEncoder(VoxtralAudioTower(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(1)
    samples = 16_000 * seconds
    audio = [(0.1 * rng.standard_normal(samples)).astype(np.float32) for _ in range(8)]
    nbytes = 8 * samples * 4

    def call():
        return enc(audio).embeddings

    results = {"voxtral entry, ring": _measure(call, jax.block_until_ready, nbytes, repeats)}
    floor = jaxsync.default_staging.min_bytes
    jaxsync.default_staging.min_bytes = 1 << 62  # every upload takes the pageable path
    try:
        results["voxtral entry, pageable"] = _measure(call, jax.block_until_ready, nbytes, repeats)
    finally:
        jaxsync.default_staging.min_bytes = floor
    return results


SMALL_KIB = (64, 256, 1024, 1536, 4096, 8192, 16384)


def small_uploads(kib: tuple[int, ...] = SMALL_KIB, repeats: int = 20) -> None:
    """Pageable `async_h2d` against a pinned `StagingRing.put` per size (see the docstring)."""
    from jaxsync.harness.bench._timing import _Side, blocked_ms, stream_ms

    side, ring = _Side("jax"), jaxsync.StagingRing(min_bytes=0)
    print(f"\n{'size':>9}  {'path':<10}{'cold ms':>9}{'stream ms':>11}{'alone ms':>10}")
    for k in kib:
        x = np.random.default_rng(0).standard_normal(k * 256).astype(np.float32)
        for name, fn in (("async_h2d", lambda x=x: jaxsync.async_h2d(x)),
                         ("ring.put", lambda x=x: ring.put(x, x.shape))):  # fmt: skip
            jax.block_until_ready(fn())
            cold = statistics.median(blocked_ms(fn, side) for _ in range(min(11, repeats)))
            alone = _measure(fn, jax.block_until_ready, x.nbytes, repeats)[1]
            stream = stream_ms(fn, side, repeat=min(5, repeats))
            print(f"{k:>6} KiB  {name:<10}{cold:>9.3f}{stream:>11.3f}"
                  f"{x.nbytes / alone / 1e6:>10.3f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="jaxsync bench upload", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-voxtral", action="store_true")
    parser.add_argument("--small", action="store_true", help="the pageable / pinned crossover")
    parser.add_argument("--smoke", action="store_true", help="small batches (a CPU check)")
    args = parser.parse_args(argv)
    repeats = min(args.repeats, 3) if args.smoke else args.repeats
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    if args.small:
        small_uploads((64, 256) if args.smoke else SMALL_KIB, repeats)
        return 0
    cases = SMOKE_CASES if args.smoke else CASES
    sections = {name: bench_case(*case, repeats) for name, case in cases.items()}
    if not args.no_voxtral:
        seconds = 1 if args.smoke else 30
        title = (
            f"voxtral 8 x {seconds} s host waveforms ({8 * 16_000 * seconds * 4 / 1e6:g} MB f32)"
        )
        sections[title] = bench_voxtral(repeats, seconds)
    for title, results in sections.items():
        print(f"\n{title}\n  {'path':<28}{'host ms':>10}{'GB/s':>10}")
        for name, (host_ms, gbps) in results.items():
            print(f"  {name:<28}{host_ms:>10.3f}{gbps:>10.1f}")
    return 0
