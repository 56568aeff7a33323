"""The one-pass Pallas block copy: in Pallas' interpreter on CPU, compiled (Triton) on a GPU.

It must equal the XLA path bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxsync.check
import jaxsync.testing
from jaxsync.kv import KVLayout, _pallas, copy_blocks
from jaxsync.kv._pallas import slab


LAYERS = ["l0", "l1", "l2"]
LAYOUTS = {
    "packed": KVLayout(kind="packed", num_blocks=13, block_size=4, num_kv_heads=2, head_dim=8,
                       dtype=jnp.bfloat16),
    "separate": KVLayout(kind="separate", num_blocks=13, block_size=8, num_kv_heads=4, head_dim=4,
                         dtype=jnp.float32),
    "mla": KVLayout(kind="mla", num_blocks=13, block_size=4, latent_dim=16, dtype=jnp.float16),
}  # fmt: skip
LOWERING = {**LAYOUTS, "mla_wide": KVLayout(kind="mla", num_blocks=5, block_size=4, latent_dim=512,
                                            dtype=jnp.bfloat16)}  # fmt: skip
# ^ MLA 512 wide: the Mosaic kernel re-views its rows 256 wide (a TMA box limit)
HEADS = KVLayout(kind="packed", num_blocks=16, block_size=4, num_kv_heads=8, head_dim=8,
                 dtype=jnp.bfloat16)  # fmt: skip  # 8 kv heads: one per simulated device


def _copy(layout, impl, src_ids, dst_ids, seed=0):
    src = layout.random(LAYERS, jax.random.key(seed))
    dst = layout.random(LAYERS, jax.random.key(seed + 1))
    return copy_blocks(src, dst, src_ids, dst_ids, impl=impl)


@pytest.mark.parametrize("kind", list(LAYOUTS))
@pytest.mark.parametrize("ids", [([3, 0, 12], [7, 2, 0]), (list(range(9)), list(range(12, 3, -1)))])
def test_pallas_equals_xla(kind, ids):
    want = _copy(LAYOUTS[kind], "xla", *ids)
    got = _copy(LAYOUTS[kind], "pallas_interpret", *ids)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_slab_view():
    assert slab((13, 8, 16, 256)) == (128, 256, 16)  # released packed layout: 16 x 256 per program
    assert slab((13, 16, 512)) == (16, 512, 8)  # MLA
    assert slab((13, 2, 4, 6)) is None  # 6 is not a power of two: Triton cannot tile it


def test_pallas_rejects_what_it_cannot_do():
    odd = KVLayout(kind="packed", num_blocks=5, block_size=4, num_kv_heads=2, head_dim=3)
    with pytest.raises(ValueError, match="power-of-two"):
        _copy(odd, "pallas_interpret", [0], [1])
    with pytest.raises(ValueError, match="impl must be"):
        _copy(LAYOUTS["mla"], "triton", [0], [1])
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
    host = dev.with_memory_kind("pinned_host")
    layout = LAYOUTS["mla"]
    src = layout.random(LAYERS, jax.random.key(0), placement=dev)
    dst = layout.random(LAYERS, jax.random.key(1), placement=host)
    with pytest.raises(ValueError, match="only, not 'd2h'"):
        copy_blocks(src, dst, [0], [1], impl="pallas_interpret")
    assert not any(x.is_deleted() for x in jax.tree.leaves(dst))  # untouched on error


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["pallas", "mosaic"])
@pytest.mark.parametrize("kind", list(LOWERING))
def test_compiled_pallas_equals_xla_on_gpu(kind, impl):
    if jax.default_backend() != "gpu":
        pytest.skip("the compiled (Triton / Mosaic GPU) kernel needs a GPU")
    layout = LOWERING[kind]
    small = layout.num_blocks < 13
    ids = ([3, 0, 4], [1, 2, 0]) if small else (list(range(9)), list(range(12, 3, -1)))
    want = _copy(layout, "xla", *ids)
    got = _copy(layout, impl, *ids)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["pallas", "mosaic"])
def test_compiled_pallas_at_the_released_block_shape_on_gpu(impl):
    if jax.default_backend() != "gpu":
        pytest.skip("the compiled (Triton / Mosaic GPU) kernel needs a GPU")
    layout = KVLayout(kind="packed", num_blocks=4099, block_size=16, num_kv_heads=8, head_dim=128,
                      dtype=jnp.bfloat16)  # fmt: skip
    rng = np.random.default_rng(0)
    src_ids = rng.choice(4099, 700, replace=False)
    dst_ids = rng.choice(4099, 700, replace=False)
    want = _copy(layout, "xla", src_ids, dst_ids, seed=5)
    got = _copy(layout, impl, src_ids, dst_ids, seed=5)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert bool(jnp.array_equal(a, b))


def test_mosaic_view_keeps_tma_boxes_legal():
    from jaxsync.kv._mosaic import view

    assert view((8, 16, 256), 2) == (128, 256)  # released packed block: the natural view
    assert view((4, 16), 2) == (4, 16)  # rows of 32 bytes, 128-byte block
    assert view((16, 512), 2) == (32, 256)  # TMA boxes stop at 256 elements: re-viewed
    assert view((1, 1, 2), 4) is None  # 8-byte rows and block: under TMA's minimums
    assert view((2, 6), 2) is None  # not a power of two


@pytest.mark.parametrize("kind", list(LOWERING))
def test_mosaic_kernel_lowers_for_cuda(kind):
    # Cross-lowered on the CPU: impl="mosaic" must reach XLA as a Mosaic GPU call; its shared-
    # memory id copies and TMA boxes pass Mosaic's checks at every test layout.
    from jaxsync.kv import _pallas

    src = LOWERING[kind].random(LAYERS, jax.random.key(0))
    ids = jaxsync.upload_packed({"src": np.zeros(8, np.int32), "dst": np.arange(8, dtype=np.int32)})
    lowered = _pallas.copy_pallas.trace(src, src, ids, backend="mosaic").lower(
        lowering_platforms=("cuda",)
    )
    text = lowered.as_text()
    assert "mosaic_gpu" in text
    # In place: each kernel's output aliases its (donated) destination leaf, no cache copy.
    assert text.count("output_operand_alias<") == len(LAYERS) * (2 if kind == "separate" else 1)


def test_compiled_pallas_refusals_donate_nothing(monkeypatch):
    src = LAYOUTS["packed"].random(LAYERS, jax.random.key(0))
    dst = LAYOUTS["packed"].random(LAYERS, jax.random.key(1))
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="GPU kernel, not one for 'cpu'"):
            copy_blocks(src, dst, [0], [1], impl="pallas")
    monkeypatch.setattr(_pallas, "ALLOW_COMPILED", False)
    with pytest.raises(ValueError, match="switched off"):
        copy_blocks(src, dst, [0], [1], impl="pallas")
    assert all(not x.is_deleted() for x in jax.tree.leaves(dst))  # nothing was donated


def test_kernel_lowers_to_triton_for_cuda():
    # Cross-lowered on the CPU: the kernel must reach XLA as a Triton call (Pallas' default GPU
    # backend, Mosaic GPU, gives un-blocked refs other semantics).
    from jaxsync.kv._pallas import copy_leaf

    s = jnp.zeros((8, 16, 256), jnp.bfloat16)
    ids = jnp.zeros((4,), jnp.int32)

    def f(s, d, a, b):
        return copy_leaf(s, d, a, b, backend="triton")

    # quiet: jax >= 0.11 warns on every Triton lowering; abstract_gpu: the CUDA target, GPU-less
    with _pallas.quiet_triton_deprecation(), jaxsync.testing.abstract_gpu():
        text = jax.jit(f).trace(s, s, ids, ids).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


def test_auto_picks_pallas_for_power_of_two_blocks_on_gpu_per_shard(monkeypatch):
    from jaxsync.kv import _copy

    leaves = jax.tree.leaves(LAYOUTS["packed"].random(LAYERS, jax.random.key(0)))
    assert not _copy._pallas_fits(leaves) or jax.default_backend() == "gpu"  # CPU: XLA
    monkeypatch.setattr(_pallas, "platform", lambda leaf: "gpu")
    assert _copy._pallas_fits(leaves)
    odd = KVLayout(kind="packed", num_blocks=5, block_size=4, num_kv_heads=2, head_dim=3)
    assert not _copy._pallas_fits(jax.tree.leaves(odd.random(LAYERS, jax.random.key(0))))
    mesh = jaxsync.testing.device_mesh("h")
    heads = HEADS.random(LAYERS, jax.random.key(0), placement=NamedSharding(mesh, P(None, "h")))
    blocks = NamedSharding(mesh, P("h"))  # 8 blocks split over the mesh: XLA
    by_block = jax.device_put(jnp.zeros((8, 2, 4, 16), jnp.bfloat16), blocks)
    single, sharded = leaves[0], jax.tree.leaves(heads)[0]
    assert _copy._pallas_fits([sharded]) and not _copy._pallas_fits([by_block])
    assert not _copy._pallas_fits([single, sharded])  # src and dst placed differently: XLA
    traced = []  # the static scans trace the entry point: same choice as the concrete call
    jax.make_jaxpr(lambda *xs: traced.append([_copy._pallas_fits([x]) for x in xs]))(
        single, sharded, by_block
    )
    assert traced == [[True, True, False]]
    monkeypatch.setattr(_pallas, "ALLOW_COMPILED", False)
    assert not _copy._pallas_fits(leaves)


def test_sharded_mosaic_kernel_lowers_per_shard_for_cuda():
    mesh = jaxsync.testing.device_mesh("h")
    src = HEADS.random(LAYERS, jax.random.key(0), placement=NamedSharding(mesh, P(None, "h")))
    ids = jaxsync.upload_packed(
        {"src": np.zeros(8, np.int32), "dst": np.arange(8, dtype=np.int32)},
        placement=NamedSharding(mesh, P()),
    )
    plan = _pallas.plan(jax.tree.leaves(src) * 2)
    assert plan.mosaic and plan.mesh is not None  # [1, 4, 16] bf16 per device: 128 bytes
    text = (
        _pallas.copy_pallas.trace(src, src, ids, plan=plan, backend="mosaic")
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert "mosaic_gpu" in text and text.count("output_operand_alias<") == len(LAYERS)
    assert not [c for c in ("all_gather", "all_to_all", "collective_permute") if c in text]


def test_auto_takes_mosaic_on_hopper_when_jax_has_no_triton(monkeypatch):
    from jaxsync.kv import _copy

    leaves = jax.tree.leaves(LAYOUTS["packed"].random(LAYERS, jax.random.key(0)))
    monkeypatch.setattr(_pallas, "platform", lambda leaf: "gpu")
    assert _copy._auto_kernel(leaves)[0] == "pallas"
    assert _copy._auto_kernel(leaves, "h2d")[0] == "pallas"  # reads the pinned source directly
    assert _copy._auto_kernel(leaves, "d2h") == ("xla", None)  # the DMA loop, always
    monkeypatch.setattr(_pallas, "TRITON", False)
    monkeypatch.setattr(_copy, "_hopper", lambda leaf: True)
    assert _copy._auto_kernel(leaves)[0] == "mosaic"
    assert _copy._auto_kernel(leaves, "h2d")[0] == "xla"  # the Mosaic port copies d2d only
    tiny = KVLayout(kind="separate", num_blocks=8, block_size=1, num_kv_heads=1, head_dim=2)
    tiny_leaves = jax.tree.leaves(tiny.random(LAYERS, jax.random.key(3)))
    assert _copy._auto_kernel(tiny_leaves)[0] == "xla"  # 8-byte blocks: below Mosaic's minimum
    monkeypatch.setattr(_copy, "_hopper", lambda leaf: False)  # pre-Hopper: no TMA
    assert _copy._auto_kernel(leaves)[0] == "xla"
    assert not _copy._hopper(leaves[0])  # a CPU device has no compute capability
    src = LAYOUTS["packed"].random(LAYERS, jax.random.key(1))
    dst = LAYOUTS["packed"].random(LAYERS, jax.random.key(2))
    with pytest.raises(ValueError, match="Triton backend, which this jax lacks"):
        copy_blocks(src, dst, [0], [1], impl="pallas")
    monkeypatch.setattr(_pallas, "ALLOW_COMPILED", False)
    assert _copy._auto_kernel(leaves)[0] == "xla"
    with pytest.raises(ValueError, match="switched off"):
        copy_blocks(src, dst, [0], [1], impl="mosaic")
    assert not any(x.is_deleted() for x in jax.tree.leaves(dst))  # untouched on error


@pytest.mark.parametrize(
    "impl", ["pallas_interpret", pytest.param("pallas", marks=pytest.mark.gpu)]
)
@pytest.mark.parametrize("auto", [False, True], ids=["explicit", "auto"])
def test_sharded_pallas_runs_per_shard_without_collectives(impl, auto):
    # Caches split over kv heads: the kernel runs per shard under shard_map, every device
    # copying its slice of each block; the result equals XLA's and keeps the sharding.
    if impl == "pallas" and jax.default_backend() != "gpu":
        pytest.skip("the compiled (Triton) kernel needs GPUs")
    mesh = jaxsync.testing.device_mesh("h", auto=auto)
    shard = NamedSharding(mesh, P(None, "h"))
    src_ids, dst_ids = [3, 0, 12, 5], [7, 2, 0, 11]

    def run(impl):
        src = HEADS.random(LAYERS, jax.random.key(0), placement=shard)
        dst = HEADS.random(LAYERS, jax.random.key(1), placement=shard)
        return copy_blocks(src, dst, src_ids, dst_ids, impl=impl)

    got, want = run(impl), run("xla")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.sharding.is_equivalent_to(shard, a.ndim)
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    src = HEADS.random(LAYERS, jax.random.key(0), placement=shard)
    ids = jaxsync.upload_packed(
        {"src": np.zeros(8, np.int32), "dst": np.arange(8, dtype=np.int32)},
        placement=NamedSharding(mesh, P()),
    )
    plan = _pallas.plan(jax.tree.leaves(src) * 2)
    assert plan.spec == P(None, "h", None, None)
    traced = []  # inside jit, Auto axes hide the spec: explicit kernels refuse with a reason
    jax.make_jaxpr(lambda *xs: traced.append(_pallas.plan(list(xs))))(*jax.tree.leaves(src))
    assert isinstance(traced[0], _pallas.Plan) != auto
    assert auto == ("Auto axes" in str(traced[0]))
    with _pallas.quiet_triton_deprecation():  # lowering the Triton kernel warns (jax >= 0.11)
        hlo = (
            _pallas.copy_pallas.lower(
                src, src, ids, plan=plan, backend="triton" if impl == "pallas" else "interpret"
            )
            .compile()
            .as_text()
        )
    assert not [
        c for c in ("all-gather", "all-to-all", "collective-permute", "all-reduce") if c in hlo
    ]
    with pytest.raises(ValueError, match="block axis"):
        by_block = {n: jax.device_put(x, NamedSharding(mesh, P("h"))) for n, x in
                    HEADS.random(LAYERS, jax.random.key(2), placement=None).items()}  # fmt: skip
        copy_blocks(by_block, dict(by_block), [0], [1], impl="pallas_interpret")


@pytest.mark.gpu
def test_default_gpu_copy_is_the_pallas_kernel_and_passes_every_proof():
    if jax.default_backend() != "gpu":
        pytest.skip("the compiled (Triton) kernel needs a GPU")
    from jaxsync.kv import _copy
    from jaxsync.kv._layout import fresh_copy

    layout = LAYOUTS["packed"]
    src = layout.random(LAYERS, jax.random.key(0))
    master = layout.random(LAYERS, jax.random.key(1))
    assert _copy._pallas_fits(jax.tree.leaves(master))  # "auto" runs the kernel here

    def step(src, dst, src_ids, dst_ids):  # copy_blocks donates dst: a fresh copy per call
        return copy_blocks(src, fresh_copy(dst), src_ids, dst_ids)

    inputs = [(src, master, list(range(k)), list(range(12, 12 - k, -1))) for k in (2, 5, 8)]
    jaxsync.check.assert_sync_free(step, src, master, [0], [1], inputs=inputs)


@pytest.mark.parametrize("kind", list(LAYOUTS))
@pytest.mark.parametrize("ids", [([3, 0, 12], [7, 2, 0]), (list(range(9)), list(range(12, 3, -1)))])
def test_pallas_h2d_reads_the_pinned_source_like_the_dma_loop(kind, ids):
    # Pinned host -> device through the kernel ("auto" / "pallas" on a GPU): per-layer pinned
    # caches read directly, padded entries skipped. Equal to the DMA loop bit for bit.
    from jaxsync.kv._layout import fresh_copy

    layout = LAYOUTS[kind]
    host = fresh_copy(layout.random(LAYERS, jax.random.key(5)), "pinned_host")
    want = copy_blocks(host, layout.random(LAYERS, jax.random.key(6)), *ids, impl="xla")
    got = copy_blocks(host, layout.random(LAYERS, jax.random.key(6)), *ids, impl="pallas_interpret")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.sharding.memory_kind == "device"
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(ValueError, match="only, not 'h2d'"):  # Mosaic: device->device only
        copy_blocks(host, layout.random(LAYERS, jax.random.key(6)), *ids, impl="mosaic")


def test_pallas_h2d_runs_per_shard_and_lowers_to_triton_reading_the_host_source():
    from jaxsync.kv._layout import fresh_copy

    mesh = jaxsync.testing.device_mesh("h")
    shard = NamedSharding(mesh, P(None, "h"))
    host = fresh_copy(HEADS.random(LAYERS, jax.random.key(0), placement=shard), "pinned_host")
    src, dst = [3, 1, 4, 9, 0], [0, 5, 7, 11, 2]
    want = copy_blocks(host, HEADS.random(LAYERS, jax.random.key(1), placement=shard), src, dst,
                       impl="xla")  # fmt: skip
    got = copy_blocks(host, HEADS.random(LAYERS, jax.random.key(1), placement=shard), src, dst,
                      impl="pallas_interpret")  # fmt: skip
    for name in LAYERS:
        assert got[name].sharding.is_equivalent_to(shard, 4)
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]))
    one = fresh_copy(LAYOUTS["packed"].random(LAYERS, jax.random.key(2)), "pinned_host")
    dev = LAYOUTS["packed"].random(LAYERS, jax.random.key(3))
    ids = jaxsync.upload_packed({"src": np.zeros(8, np.int32), "dst": np.arange(8, dtype=np.int32)})
    with _pallas.quiet_triton_deprecation(), jaxsync.testing.abstract_gpu():
        traced = _pallas.copy_pallas.trace(one, dev, ids, backend="triton")
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == len(LAYERS)
    assert "annotate_device_placement" not in text  # no transfer of the pinned source


@pytest.mark.gpu
def test_compiled_pallas_h2d_equals_the_dma_loop_on_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("the compiled (Triton) kernel needs a GPU")
    from jaxsync.kv._layout import fresh_copy

    rng = np.random.default_rng(0)
    released = KVLayout(kind="packed", num_blocks=256, block_size=16, num_kv_heads=8,
                        head_dim=128, dtype=jnp.bfloat16)  # fmt: skip
    host = fresh_copy(released.random(LAYERS, jax.random.key(0)), "pinned_host")
    for n in (1, 37, 200):
        src, dst = rng.integers(0, 256, n), rng.permutation(256)[:n]
        want = copy_blocks(host, released.random(LAYERS, jax.random.key(1)), src, dst, impl="xla")
        for impl in ("pallas", "auto"):  # "auto" takes the kernel on a GPU
            got = copy_blocks(host, released.random(LAYERS, jax.random.key(1)), src, dst,
                              impl=impl)  # fmt: skip
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                same = np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
                assert same, (n, impl)
