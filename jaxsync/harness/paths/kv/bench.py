"""Benchmark cases for `jaxsync bench kv`: block copy and pinned-host swaps vs vLLM's torch pattern.

"released": 32 layers x 4096 blocks x (8 kv heads x block 16 x 2*128) bf16, packed K/V
(256 MiB per layer, 8 GiB per cache), copying 64, 512 and 2048 blocks. `bytes_moved` counts the
bytes read plus written of the copied blocks. Baselines on the same data:

* "vllm post-PR": ids staged pinned and uploaded non_blocking, then `index_select` +
  `index_copy_` per layer (vLLM's copy on CUDA; the swap variants move the gathered blocks with
  `.to(dst.device)` as `insert_blocks_to_device` / `swap_out_blocks_to_host` do);
* "vllm pre-PR": the same with a blocking pageable id upload (`torch.tensor(ids, device=...)`);
* "torch_copy_ceiling": one contiguous device copy of the same number of bytes (read + write);
* "torch_pinned_ceiling": one contiguous pinned-host <-> device copy of the same bytes, next to
  the block-major `HostPool` swaps (rows marked "[pool]"; their vLLM pattern is the per-layer
  row with the same ids).

Layout cases: a d2d copy of 512 blocks at 4 and at 32 layers (same block shape), from and to
`StackedCache`s (rows "... stacked": one `[P, L, ...]` array per cache) next to the same copy
between per-layer caches ("... per-layer"), each with vLLM's per-layer copy as baseline.

Note for the runner: JAX preallocates 75% of GPU memory by default; set
XLA_PYTHON_CLIENT_PREALLOCATE=false so the torch baselines fit next to the JAX caches.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from jaxsync.harness.registry import BenchCase, register_bench
from jaxsync.kv import KVLayout, _pallas, copy_blocks, host_pool, stack_layers, swap_in, swap_out


SIZES = {
    "tiny": dict(layers=4, layout=KVLayout(kind="packed", num_blocks=64, block_size=4,
                 num_kv_heads=2, head_dim=8, dtype=jnp.float32), counts=(8, 16), host_blocks=64,
                 stacked=dict(layers=(2, 4), count=8)),
    "released": dict(layers=32, layout=KVLayout(kind="packed", num_blocks=4096, block_size=16,
                     num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16), counts=(64, 512, 2048),
                     host_blocks=2048, stacked=dict(layers=(4, 32), count=512, blocks=1024)),
}  # fmt: skip
_ROTATE = 4  # distinct id sets per count, all in one bucket
_FRESH = 320  # more distinct id sets than kv's per-content caches keep (256)


def _id_sets(
    count: int, num_src: int, num_dst: int, seed: int, sets: int = _ROTATE
) -> list[tuple[list, list]]:
    rng = np.random.default_rng(seed)
    return [
        (
            rng.choice(num_src, count, replace=False).tolist(),
            rng.choice(num_dst, count, replace=False).tolist(),
        )
        for _ in range(sets)
    ]


def _torch_cases(device, src_t, dst_t, id_sets, to_dst):
    import torch

    pin = device.startswith("cuda")

    def post():
        s, d = next(post.ids)
        s_idx = torch.tensor(s, dtype=torch.int64, pin_memory=pin).to(device, non_blocking=True)
        d_idx = torch.tensor(d, dtype=torch.int64, pin_memory=pin).to(device, non_blocking=True)
        if to_dst == "same":
            for a, b in zip(src_t, dst_t, strict=True):
                b.index_copy_(0, d_idx, a.index_select(0, s_idx))
        else:
            idx_src = s_idx if src_t[0].is_cuda else s_idx.cpu()
            idx_dst = d_idx if dst_t[0].is_cuda else d_idx.cpu()
            for a, b in zip(src_t, dst_t, strict=True):
                b[idx_dst] = a[idx_src].to(b.device)
        return dst_t

    def pre():
        s, d = next(pre.ids)
        s_idx = torch.tensor(s, dtype=torch.int64, device=src_t[0].device)
        d_idx = torch.tensor(d, dtype=torch.int64, device=dst_t[0].device)
        for a, b in zip(src_t, dst_t, strict=True):
            b[d_idx] = a[s_idx].to(b.device)
        return dst_t

    post.ids = itertools.cycle(id_sets)
    pre.ids = itertools.cycle(id_sets)
    return {"vllm_post_pr": post, "vllm_pre_pr": pre}


@register_bench("kv")
def kv_bench(device: str, size: str) -> list[BenchCase]:
    """Copy (d2d) and swap (d2h, h2d) cases of `size` on `device` ("cuda"/"cpu")."""
    import torch

    from jaxsync.harness.paths.kv.reference import to_torch

    cfg = SIZES[size]
    layout: KVLayout = cfg["layout"]
    names = [f"layer{i}" for i in range(cfg["layers"])]
    dev = jax.devices()[0]
    on_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    pinned = on_dev.with_memory_kind("pinned_host")
    host_layout = KVLayout(**{**layout.__dict__, "num_blocks": cfg["host_blocks"]})
    src = layout.random(names, jax.random.key(0), placement=on_dev)
    state = {
        "d2d": layout.random(names, jax.random.key(1), placement=on_dev),
        "d2h": host_layout.random(names, jax.random.key(2), placement=pinned),
        "h2d": layout.random(names, jax.random.key(3), placement=on_dev),
    }
    host_src = host_layout.random(names, jax.random.key(4), placement=pinned)
    pool = {"pool": host_pool(src, cfg["host_blocks"])}

    def torch_cache(cache, where):  # its layers, in order
        out = []
        for name in cache:
            t = to_torch(cache[name]) if size == "tiny" else _torch_like(cache[name], device)
            if where == "pinned":
                t = t.cpu().pin_memory() if device.startswith("cuda") else t.cpu()
            out.append(t if where == "pinned" else t.to(device))
        return out

    src_t = torch_cache(src, "device")
    cases = []
    per_block = layout.block_nbytes * len(names)
    for count in cfg["counts"]:
        for direction in ("d2d", "d2h", "h2d"):
            if direction != "d2d" and count > cfg["host_blocks"] // 2:
                continue
            num_src = layout.num_blocks if direction != "h2d" else cfg["host_blocks"]
            num_dst = layout.num_blocks if direction != "d2h" else cfg["host_blocks"]
            id_sets = _id_sets(count, num_src, num_dst, count)
            s_cache = host_src if direction == "h2d" else src
            rotation = itertools.cycle(id_sets)

            def jax_fn(direction=direction, s_cache=s_cache, ids=rotation):
                s, d = next(ids)
                # dst is donated: keep the returned cache for the next call
                state[direction] = copy_blocks(s_cache, state[direction], s, d)
                return state[direction]

            s_t = src_t if direction == "d2d" else torch_cache(
                s_cache, "pinned" if direction == "h2d" else "device")  # fmt: skip
            d_t = torch_cache(state[direction], "pinned" if direction == "d2h" else "device")
            same = "same" if direction == "d2d" else "cross"
            torch_fns = _torch_cases(device, s_t, d_t, id_sets, same)
            nbytes = 2 * count * per_block  # read + written
            if direction == "d2d":
                a = torch.empty(count * per_block, dtype=torch.uint8, device=device)
                b = torch.empty_like(a)
                torch_fns["torch_copy_ceiling"] = lambda a=a, b=b: b.copy_(a)
            name = f"kv.copy_blocks {direction} {count} blocks ({size})"
            args = _count(
                lambda s_cache=s_cache, d=direction, ids=id_sets[0]: copy_blocks(
                    s_cache, state[d], *ids
                )
            )
            cases.append(BenchCase(name, jax_fn, torch_fns, bytes_moved=nbytes, jit_args=args))
            if direction == "d2d" and device.startswith("cuda") and _pallas.ALLOW_COMPILED:
                # On a GPU the default ("auto") is the Pallas kernel: XLA's copy on the same ids
                cases.append(_impl_case(name, "xla", s_cache, state, id_sets, nbytes))
            if direction == "h2d" and device.startswith("cuda") and _pallas.ALLOW_COMPILED:
                # The default there is the kernel reading the per-layer pinned caches directly:
                # the DMA loop on the same ids
                cases.append(_impl_case(name, "xla", s_cache, state, id_sets, nbytes, "h2d"))
            if direction != "d2d":
                cases.append(_pool_case(name, direction, src, state, pool, id_sets, nbytes, device))
            if direction == "h2d" and device.startswith("cuda"):  # default there: the kernel
                cases.append(
                    _pool_case(name, direction, src, state, pool, id_sets, nbytes, device, "xla")
                )
    return cases + _layout_cases(cfg, size, device, src, src_t, state, torch_cache)


def _layout_cases(cfg, size, device, src, src_t, state, torch_cache) -> list[BenchCase]:
    """d2d copies at each layer count of `cfg["stacked"]`: stacked caches next to per-layer ones
    (the first layers of the bench's source), vLLM's per-layer copy as baseline."""
    # Caches of their own, `blocks` per layer: four 32-layer caches of the bench's full size
    # beside its other caches would not fit in one GPU's memory.
    big: KVLayout = cfg["layout"]
    layout = KVLayout(
        **{**big.__dict__, "num_blocks": cfg["stacked"].get("blocks", big.num_blocks)}
    )
    count = cfg["stacked"]["count"]
    cases = []
    for num_layers in cfg["stacked"]["layers"]:
        names = list(src)[:num_layers]
        where = src[names[0]].sharding
        per_layer = layout.random(names, jax.random.key(4), placement=where)
        dst = layout.random(names, jax.random.key(5), placement=where)
        key = f"d2d {num_layers} layers"
        state[f"{key} per-layer"], state[f"{key} stacked"] = dst, stack_layers(dst)
        stacked_src = stack_layers(per_layer)
        id_sets = _id_sets(count, layout.num_blocks, layout.num_blocks, num_layers)
        torch_fns = _torch_cases(device, src_t[:num_layers], torch_cache(dst, "device"), id_sets,
                                 "same")  # fmt: skip
        nbytes = 2 * count * layout.block_nbytes * num_layers  # read + written
        for tag, s_cache in (("per-layer", per_layer), ("stacked", stacked_src)):
            name = (f"kv.copy_blocks d2d {count} of {layout.num_blocks} blocks {num_layers} layers "
                    f"{tag} ({size})")  # fmt: skip
            case = _impl_case(name, "auto", s_cache, state, id_sets, nbytes, f"{key} {tag}")
            cases.append(
                BenchCase(name, case.jax_fn, torch_fns, bytes_moved=nbytes, jit_args=case.jit_args)
            )
            if device.startswith("cuda") and _pallas.ALLOW_COMPILED:  # auto: the kernel there
                cases.append(_impl_case(name, "xla", s_cache, state, id_sets, nbytes,
                                        f"{key} {tag}"))  # fmt: skip
            if tag == "stacked":  # the same ids as int32 arrays, as a server's block tables hold
                arrays = [tuple(np.asarray(i, np.int32) for i in pair) for pair in id_sets]
                cases.append(_impl_case(name, "auto", s_cache, state, arrays, nbytes,
                                        f"{key} {tag}", label="numpy ids"))  # fmt: skip
                # A server's steady state: other blocks every step, so no call finds its ids'
                # content kept (more distinct sets than the content caches hold).
                fresh = [
                    tuple(np.asarray(i, np.int32) for i in pair)
                    for pair in _id_sets(count, layout.num_blocks, layout.num_blocks, 7, _FRESH)
                ]
                cases.append(
                    _impl_case(
                        name,
                        "auto",
                        s_cache,
                        state,
                        fresh,
                        nbytes,
                        f"{key} {tag}",
                        label="new numpy ids each call",
                    )
                )
    return cases


def _impl_case(
    name, impl, s_cache, state, id_sets, nbytes, direction="d2d", label=None
) -> BenchCase:
    """The copy of `name` with an explicit `impl`, on the same ids (row "[impl]", or
    "[label]")."""
    rotation = itertools.cycle(id_sets)

    def jax_fn():
        s, d = next(rotation)
        state[direction] = copy_blocks(s_cache, state[direction], s, d, impl=impl)
        return state[direction]

    args = _count(lambda: copy_blocks(s_cache, state[direction], *id_sets[0], impl=impl))
    return BenchCase(f"{name} [{label or impl}]", jax_fn, {}, bytes_moved=nbytes, jit_args=args)


def _pool_case(
    name, direction, src, state, pool, id_sets, nbytes, device, impl="auto"
) -> BenchCase:
    """The same swap through a block-major HostPool, next to a pinned transfer of its bytes
    (row "[pool]"; "[pool xla]" for swap_in's DMA loop where "auto" takes the kernel)."""
    import torch

    rotation = itertools.cycle(id_sets)

    def jax_fn():
        s, d = next(rotation)
        if direction == "d2h":
            pool["pool"] = swap_out(src, pool["pool"], s, d)
            return pool["pool"].blocks
        state["h2d"] = swap_in(pool["pool"], state["h2d"], s, d, impl=impl)
        return state["h2d"]

    torch_fns = {}
    if device.startswith("cuda"):
        dev = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
        host = torch.empty(nbytes // 2, dtype=torch.uint8).pin_memory()
        a, b = (dev, host) if direction == "d2h" else (host, dev)
        torch_fns["torch_pinned_ceiling"] = lambda a=a, b=b: b.copy_(a, non_blocking=True)
    tag = "pool" if impl == "auto" else f"pool {impl}"
    s0, d0 = id_sets[0]
    if direction == "d2h":
        args = _count(lambda: swap_out(src, pool["pool"], s0, d0))
    else:
        args = _count(lambda: swap_in(pool["pool"], state["h2d"], s0, d0, impl=impl))
    return BenchCase(f"{name} [{tag}]", jax_fn, torch_fns, bytes_moved=nbytes, jit_args=args)


def _count(call):
    """`BenchCase.jit_args` of a donated chain: its main program traced on the current state
    by a call that stores nothing."""
    from jaxsync.harness.bench._programs import main_program_args

    return lambda: main_program_args(call)


def _torch_like(x: jax.Array, device: str):
    """A torch tensor of x's shape and dtype with random contents, made on `device` directly
    (copying 8 GiB through the host would take longer than the benchmark)."""
    import torch

    dtype = {jnp.dtype(jnp.bfloat16): torch.bfloat16, jnp.dtype(jnp.float32): torch.float32}[
        x.dtype
    ]
    return torch.randn(x.shape, dtype=torch.float32, device=device).to(dtype)
