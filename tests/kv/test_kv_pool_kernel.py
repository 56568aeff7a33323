"""swap_in through the Pallas kernel that reads the pinned pool directly: in Pallas' interpreter
on CPU, compiled (Triton) on a GPU. It must equal the DMA-loop path bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxsync.check
import jaxsync.testing
from jaxsync.harness.paths.kv.reference import as_numpy, host_random_cache
from jaxsync.kv import KVLayout, _pallas, _pool, host_pool, swap_in, swap_out
from jaxsync.testing import fresh_copy, kv_call


LAYERS = ("l0", "l1", "l2")
DEV = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
LAYOUTS = {  # power-of-two block dims: what the kernel takes
    "packed": dict(kind="packed", num_kv_heads=2, head_dim=8, dtype=jnp.bfloat16),
    "separate": dict(kind="separate", num_kv_heads=4, head_dim=4, dtype=np.float32),
    "mla": dict(kind="mla", latent_dim=16, dtype=np.float16),
    "int8": dict(kind="packed", num_kv_heads=1, head_dim=32, dtype=np.int8),
}


def layout(kind, num_blocks=13):
    return KVLayout(num_blocks=num_blocks, block_size=4, **LAYOUTS[kind])


def filled_pool(kind, num_blocks=11, seed=0):
    """A pool whose block b holds cache block b of a random cache, for every layer."""
    cache = host_random_cache(layout(kind, num_blocks), LAYERS, seed, DEV)
    ids = list(range(num_blocks))
    return swap_out(cache, host_pool(cache, num_blocks), ids, ids)


def bits(cache):
    return [np.asarray(as_numpy(x)).view(np.uint8) for x in jax.tree.leaves(cache)]


def swapped(pool, kind, src, dst, impl, seed=7):
    target = host_random_cache(layout(kind), LAYERS, seed, DEV)
    return bits(kv_call(swap_in, pool, target, src, dst, impl=impl))


@pytest.mark.parametrize("kind", list(LAYOUTS))
@pytest.mark.parametrize(
    "ids",
    [([3, 0, 10], [7, 2, 0]), (list(range(9)), list(range(12, 3, -1))), ([5], [12])],
    ids=["3-in-bucket-8", "9-in-bucket-16", "one"],
)
def test_kernel_equals_dma_loop(kind, ids):
    pool = filled_pool(kind)
    want = swapped(pool, kind, *ids, impl="xla")
    got = swapped(pool, kind, *ids, impl="kernel")
    for a, b in zip(got, want, strict=True):
        assert np.array_equal(a, b)
    before = bits(host_random_cache(layout(kind), LAYERS, 7, DEV))
    untouched = np.setdiff1d(np.arange(13), ids[1])
    assert all(np.array_equal(a[untouched], b[untouched]) for a, b in zip(got, before, strict=True))


def test_kernel_equals_dma_loop_on_many_random_id_sets():
    rng = np.random.default_rng(0)
    pool = filled_pool("packed", num_blocks=29)
    for _ in range(12):
        n = int(rng.integers(1, 14))
        src, dst = rng.integers(0, 29, n), rng.permutation(13)[:n]
        want = swapped(pool, "packed", src, dst, impl="xla")
        got = swapped(pool, "packed", src, dst, impl="kernel")
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)), (src, dst)


def test_auto_takes_the_kernel_on_one_gpu_only(monkeypatch):
    leaves = jax.tree.leaves(host_random_cache(layout("packed"), LAYERS, 0, DEV))

    def choice(leaves):
        plan = _pallas.auto_plan(leaves)
        return "xla" if plan is None else plan.backend

    assert choice(leaves) == ("triton" if jax.default_backend() == "gpu" else "xla")
    monkeypatch.setattr(_pallas, "platform", lambda leaf: "gpu")
    monkeypatch.setattr(_pallas, "TRITON", True)
    assert choice(leaves) == "triton"
    odd = KVLayout(kind="packed", num_blocks=5, block_size=4, num_kv_heads=2, head_dim=3)
    assert choice(jax.tree.leaves(odd.random(LAYERS, jax.random.key(0)))) == "xla"
    mesh = jaxsync.testing.device_mesh("h")
    sharded = jax.tree.leaves(HEADS.random(LAYERS, jax.random.key(0), placement=SHARD(mesh)))
    assert choice(sharded) == "triton"  # per shard
    assert _pallas.auto_plan(sharded).mesh is not None
    by_block = jax.device_put(jnp.zeros((8, 2, 4, 16)), NamedSharding(mesh, P("h")))
    assert choice([by_block]) == "xla"  # blocks split over devices: a shard cannot read a pool
    assert "block axis" in _pallas.plan([by_block])
    monkeypatch.setattr(_pallas, "TRITON", False)  # a jax without Pallas' Triton backend
    assert choice(leaves) == "xla"
    monkeypatch.setattr(_pallas, "TRITON", True)
    monkeypatch.setattr(_pallas, "ALLOW_COMPILED", False)
    assert choice(leaves) == "xla"


HEADS = KVLayout(kind="packed", num_blocks=12, block_size=4, num_kv_heads=8, head_dim=4,
                 dtype=jnp.float32)  # fmt: skip  # 8 kv heads: one per simulated device


def SHARD(mesh):  # noqa: N802 - reads like the constant it stands for
    return NamedSharding(mesh, P(None, "h"))


@pytest.mark.parametrize("impl", ["kernel", pytest.param("auto", marks=pytest.mark.gpu)])
def test_sharded_kernel_runs_per_shard_without_collectives(impl):
    if impl == "auto" and jax.default_backend() != "gpu":
        pytest.skip("the compiled (Triton) kernel needs GPUs")
    mesh = jaxsync.testing.device_mesh("h")
    cache = HEADS.random(LAYERS, jax.random.key(0), placement=SHARD(mesh))
    pool = swap_out(cache, host_pool(cache, 10), list(range(10)), list(range(10)))
    src, dst = [3, 1, 4, 9, 0], [0, 5, 7, 11, 2]
    want = swap_in(pool, HEADS.random(LAYERS, jax.random.key(1), placement=SHARD(mesh)), src,
                   dst, impl="xla")  # fmt: skip
    got = kv_call(swap_in, pool, HEADS.random(LAYERS, jax.random.key(1), placement=SHARD(mesh)),
                  src, dst, impl=impl)  # fmt: skip
    for name in LAYERS:
        assert got[name].sharding.is_equivalent_to(SHARD(mesh), 4)
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]))
    leaves = jax.tree.leaves(cache)
    plan = _pallas.plan(leaves, "triton" if impl == "auto" else "interpret")
    ids = jaxsync.upload_packed(
        {"src": np.zeros(8, np.int32), "dst": np.arange(8, dtype=np.int32)},
        placement=NamedSharding(mesh, P()),
    )
    with _pallas.quiet_triton_deprecation():
        hlo = _pool._swap_in_kernel.lower(pool.blocks, fresh_copy(leaves), ids, plan).as_text()
    assert not [c for c in ("all-gather", "all-to-all", "collective-permute") if c in hlo]


def test_refusals_raise_before_dispatch_and_donate_nothing():
    pool = filled_pool("packed")
    cache = host_random_cache(layout("packed"), LAYERS, 3, DEV)
    for impl in ("mosaic", "pallas", "pallas_interpret"):
        with pytest.raises(ValueError, match="impl must be 'auto' or 'xla'"):
            swap_in(pool, cache, [0], [1], impl=impl)
    assert not any(x.is_deleted() for x in jax.tree.leaves(cache))


def test_kernel_lowers_to_one_triton_call_per_layer_reading_the_pool_for_cuda():
    # Cross-lowered on the CPU: each layer is one Triton call whose operand is the pinned pool
    # itself (no transfer of the pool in the program).
    pool = filled_pool("packed")
    leaves = jax.tree.leaves(host_random_cache(layout("packed"), LAYERS, 3, DEV))
    ids = jaxsync.upload_packed({"src": np.zeros(8, np.int32), "dst": np.arange(8, dtype=np.int32)})
    # quiet: jax >= 0.11 warns on every Triton lowering; abstract_gpu: the CUDA target, GPU-less
    with _pallas.quiet_triton_deprecation(), jaxsync.testing.abstract_gpu():
        traced = _pool._swap_in_kernel.trace(pool.blocks, leaves, ids, _pallas.Plan())
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == len(LAYERS)
    assert "annotate_device_placement" not in text  # no memory-space transfer of the pool


@pytest.mark.gpu
def test_compiled_kernel_equals_dma_loop_and_passes_every_proof_on_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("the compiled (Triton) kernel needs a GPU")
    big = KVLayout(kind="packed", num_blocks=512, block_size=16, num_kv_heads=8, head_dim=128,
                   dtype=jnp.bfloat16)  # fmt: skip  # the released block shape, 4 layers
    names = ("a", "b", "c", "d")
    cache = host_random_cache(big, names, 0, DEV)
    pool = swap_out(cache, host_pool(cache, 700), list(range(512)), list(range(512)))
    rng = np.random.default_rng(0)
    for n in (1, 37, 300, 512):
        src, dst = rng.integers(0, 512, n), rng.permutation(512)[:n]
        target = host_random_cache(big, names, 1, DEV)
        got = bits(swap_in(pool, fresh_copy(target), src, dst, impl="auto"))
        want = bits(swap_in(pool, target, src, dst, impl="xla"))
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)), n
    small = filled_pool("packed", num_blocks=13)
    master = host_random_cache(layout("packed"), LAYERS, 2, DEV)
    assert _pallas.auto_plan(jax.tree.leaves(master)).backend == "triton"

    def step(pool, cache, src_ids, dst_ids):  # swap_in donates the cache: a fresh copy per call
        return swap_in(pool, fresh_copy(cache), src_ids, dst_ids)

    inputs = [(small, master, list(range(k)), list(range(12, 12 - k, -1))) for k in (2, 5, 8)]
    jaxsync.check.assert_sync_free(step, small, master, [0], [1], inputs=inputs)
