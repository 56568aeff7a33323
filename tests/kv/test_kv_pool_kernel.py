"""swap_in through the Pallas kernel that reads the pinned pool directly: in Pallas' interpreter
on CPU, compiled (Triton) on a GPU. It must equal the DMA-loop path bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxsync.check
import jaxsync.testing
from jaxsync.kv import KVLayout, _pallas, _pool, host_pool, swap_in, swap_out
from jaxsync.kv._layout import fresh_copy
from jaxsync.kv._reference import as_numpy, host_random_cache


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
    return bits(swap_in(pool, target, src, dst, impl=impl))


@pytest.mark.parametrize("kind", list(LAYOUTS))
@pytest.mark.parametrize(
    "ids",
    [([3, 0, 10], [7, 2, 0]), (list(range(9)), list(range(12, 3, -1))), ([5], [12])],
    ids=["3-in-bucket-8", "9-in-bucket-16", "one"],
)
def test_kernel_equals_dma_loop(kind, ids):
    pool = filled_pool(kind)
    want = swapped(pool, kind, *ids, impl="xla")
    got = swapped(pool, kind, *ids, impl="pallas_interpret")
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
        got = swapped(pool, "packed", src, dst, impl="pallas_interpret")
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)), (src, dst)


def test_auto_takes_the_kernel_on_one_gpu_only(monkeypatch):
    leaves = jax.tree.leaves(host_random_cache(layout("packed"), LAYERS, 0, DEV))

    def choice(leaves, impl="auto"):
        return _pool._swap_in_impl(impl, leaves)[0]

    assert choice(leaves) == ("triton" if jax.default_backend() == "gpu" else "xla")
    monkeypatch.setattr(_pallas, "platform", lambda leaf: "gpu")
    monkeypatch.setattr(_pallas, "TRITON", True)
    assert choice(leaves) == "triton"
    odd = KVLayout(kind="packed", num_blocks=5, block_size=4, num_kv_heads=2, head_dim=3)
    assert choice(jax.tree.leaves(odd.random(LAYERS, jax.random.key(0)))) == "xla"
    mesh = jaxsync.testing.device_mesh("h")
    sharded = jax.tree.leaves(HEADS.random(LAYERS, jax.random.key(0), placement=SHARD(mesh)))
    assert choice(sharded) == "triton"  # per shard
    assert _pool._swap_in_impl("auto", sharded)[1].mesh is not None
    by_block = jax.device_put(jnp.zeros((8, 2, 4, 16)), NamedSharding(mesh, P("h")))
    assert choice([by_block]) == "xla"  # blocks split over devices: a shard cannot read a pool
    with pytest.raises(ValueError, match="block axis"):
        choice([by_block], "pallas_interpret")
    monkeypatch.setattr(_pallas, "TRITON", False)  # a jax without Pallas' Triton backend
    assert choice(leaves) == "xla"
    monkeypatch.setattr(_pallas, "TRITON", True)
    monkeypatch.setattr(_pallas, "ALLOW_COMPILED", False)
    assert choice(leaves) == "xla"


HEADS = KVLayout(kind="packed", num_blocks=12, block_size=4, num_kv_heads=8, head_dim=4,
                 dtype=jnp.float32)  # fmt: skip  # 8 kv heads: one per simulated device


def SHARD(mesh):  # noqa: N802 - reads like the constant it stands for
    return NamedSharding(mesh, P(None, "h"))


@pytest.mark.parametrize(
    "impl", ["pallas_interpret", pytest.param("pallas", marks=pytest.mark.gpu)]
)
def test_sharded_kernel_runs_per_shard_without_collectives(impl):
    if impl == "pallas" and jax.default_backend() != "gpu":
        pytest.skip("the compiled (Triton) kernel needs GPUs")
    mesh = jaxsync.testing.device_mesh("h")
    cache = HEADS.random(LAYERS, jax.random.key(0), placement=SHARD(mesh))
    pool = swap_out(cache, host_pool(cache, 10), list(range(10)), list(range(10)))
    src, dst = [3, 1, 4, 9, 0], [0, 5, 7, 11, 2]
    want = swap_in(pool, HEADS.random(LAYERS, jax.random.key(1), placement=SHARD(mesh)), src,
                   dst, impl="xla")  # fmt: skip
    got = swap_in(pool, HEADS.random(LAYERS, jax.random.key(1), placement=SHARD(mesh)), src, dst,
                  impl=impl)  # fmt: skip
    for name in LAYERS:
        assert got[name].sharding.is_equivalent_to(SHARD(mesh), 4)
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]))
    leaves = jax.tree.leaves(cache)
    backend, plan = _pool._swap_in_impl(impl, leaves)
    ids = jaxsync.upload_packed(
        {"src": np.zeros(8, np.int32), "dst": np.arange(8, dtype=np.int32)},
        placement=NamedSharding(mesh, P()),
    )
    with _pallas.quiet_triton_deprecation():
        hlo = _pool._swap_in_kernel.lower(pool.blocks, leaves, ids, backend, plan).as_text()
    assert not [c for c in ("all-gather", "all-to-all", "collective-permute") if c in hlo]


def test_refusals_raise_before_dispatch_and_donate_nothing():
    pool = filled_pool("packed")
    cache = host_random_cache(layout("packed"), LAYERS, 3, DEV)
    with pytest.raises(ValueError, match="impl must be"):
        swap_in(pool, cache, [0], [1], impl="mosaic")
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="compiles a GPU kernel|Triton backend"):
            swap_in(pool, cache, [0], [1], impl="pallas")
    odd_layout = KVLayout(kind="packed", num_blocks=5, block_size=4, num_kv_heads=2, head_dim=3)
    odd = host_random_cache(odd_layout, LAYERS, 0, DEV)
    odd_pool = swap_out(odd, host_pool(odd, 5), [0], [0])
    with pytest.raises(ValueError, match="power-of-two"):
        swap_in(odd_pool, odd, [0], [1], impl="pallas_interpret")
    assert not any(x.is_deleted() for x in jax.tree.leaves(cache) + jax.tree.leaves(odd))


def test_kernel_lowers_to_one_triton_call_per_layer_reading_the_pool_for_cuda():
    # Cross-lowered on the CPU: each layer is one Triton call whose operand is the pinned pool
    # itself (no transfer of the pool in the program).
    pool = filled_pool("packed")
    leaves = jax.tree.leaves(host_random_cache(layout("packed"), LAYERS, 3, DEV))
    ids = jaxsync.upload_packed({"src": np.zeros(8, np.int32), "dst": np.arange(8, dtype=np.int32)})
    # quiet: jax >= 0.11 warns on every Triton lowering; abstract_gpu: the CUDA target, GPU-less
    with _pallas.quiet_triton_deprecation(), jaxsync.testing.abstract_gpu():
        traced = _pool._swap_in_kernel.trace(pool.blocks, leaves, ids, backend="triton")
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
        got = bits(swap_in(pool, fresh_copy(target), src, dst, impl="pallas"))
        want = bits(swap_in(pool, target, src, dst, impl="xla"))
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)), n
    small = filled_pool("packed", num_blocks=13)
    master = host_random_cache(layout("packed"), LAYERS, 2, DEV)
    assert _pool._swap_in_impl("auto", jax.tree.leaves(master))[0] == "triton"

    def step(pool, cache, src_ids, dst_ids):  # swap_in donates the cache: a fresh copy per call
        return swap_in(pool, fresh_copy(cache), src_ids, dst_ids)

    inputs = [(small, master, list(range(k)), list(range(12, 12 - k, -1))) for k in (2, 5, 8)]
    jaxsync.check.assert_sync_free(step, small, master, [0], [1], inputs=inputs)
