"""The TPU block copy (Pallas, Mosaic TPU DMA kernel): bit-exact with XLA in Pallas' TPU
interpreter on CPU, chosen by "auto" on TPUs only for device->device copies (never a GPU kernel
there), and exportable for TPUs from this host as one Mosaic custom call per leaf."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxsync
import jaxsync.testing
from jaxsync.kv import KVLayout, _pallas, copy_blocks, host_pool, swap_in


LAYERS = ("l0", "l1", "l2")
LAYOUTS = {  # odd sizes: the DMA kernel takes any block shape
    "packed": KVLayout(kind="packed", num_blocks=13, block_size=4, num_kv_heads=2, head_dim=3,
                       dtype=jnp.bfloat16),
    "separate": KVLayout(kind="separate", num_blocks=13, block_size=5, num_kv_heads=3, head_dim=4,
                         dtype=jnp.float32),
    "mla": KVLayout(kind="mla", num_blocks=13, block_size=4, latent_dim=7, dtype=jnp.float16),
    "stacked": KVLayout(kind="packed", num_blocks=13, block_size=4, num_kv_heads=2, head_dim=8,
                        dtype=jnp.int8, stacked=True),
}  # fmt: skip


def bits(tree):
    return [np.asarray(x).view(np.uint8) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("kind", list(LAYOUTS))
@pytest.mark.parametrize("ids", [([3, 0, 12], [7, 2, 0]), (list(range(9)), list(range(12, 3, -1)))])
def test_tpu_kernel_equals_xla_in_the_tpu_interpreter(kind, ids):
    layout = LAYOUTS[kind]
    src = layout.random(LAYERS, jax.random.key(0))
    want = copy_blocks(src, layout.random(LAYERS, jax.random.key(1)), *ids, impl="xla")
    dst = layout.random(LAYERS, jax.random.key(1))
    with _pallas.interpreted("tpu"):
        assert _pallas.auto_plan(jax.tree.leaves(src) * 2, tpu=True).backend == "tpu_interpret"
        got = copy_blocks(src, dst, *ids)
    for a, b in zip(bits(got), bits(want), strict=True):
        np.testing.assert_array_equal(a, b)


def test_auto_on_tpu_takes_the_tpu_kernel_and_never_a_gpu_kernel(monkeypatch):
    leaves = jax.tree.leaves(LAYOUTS["packed"].random(LAYERS, jax.random.key(0)))
    pow2 = jax.tree.leaves(KVLayout(kind="packed", num_blocks=8, block_size=4, num_kv_heads=2,
                                    head_dim=8).random(LAYERS, jax.random.key(0)))  # fmt: skip
    assert _pallas.auto_plan(leaves, tpu=True) is None or jax.default_backend() == "tpu"
    monkeypatch.setattr(_pallas, "platform", lambda leaf: "tpu")
    monkeypatch.setattr(_pallas, "TRITON", True)
    for xs in (leaves, pow2):
        assert _pallas.auto_plan(xs, tpu=True).backend == "tpu"  # device->device copies
        assert _pallas.auto_plan(xs) is None  # swap_in / h2d: XLA, not Triton, on a TPU
    mesh = jaxsync.testing.device_mesh("h")
    heads = KVLayout(kind="packed", num_blocks=8, block_size=4, num_kv_heads=8, head_dim=3)
    sharded = heads.random(LAYERS, jax.random.key(0), placement=NamedSharding(mesh, P(None, "h")))
    plan = _pallas.auto_plan(jax.tree.leaves(sharded), tpu=True)
    assert plan.backend == "tpu" and plan.mesh is not None  # per shard, under shard_map
    monkeypatch.setattr(_pallas, "ALLOW_COMPILED", False)
    assert _pallas.auto_plan(leaves, tpu=True) is None


def test_swap_in_on_tpu_runs_xla(monkeypatch):
    cache = LAYOUTS["packed"].random(LAYERS, jax.random.key(0))
    pool = host_pool(cache, 4)
    monkeypatch.setattr(_pallas, "platform", lambda leaf: "tpu")
    out = swap_in(pool, cache, [0], [1])  # on this CPU host: would fail if a GPU kernel ran
    assert set(out) == set(LAYERS)


@pytest.mark.parametrize("kind", ["packed", "separate", "stacked"])
def test_tpu_copy_exports_for_tpu_as_mosaic_calls(kind):
    layout = LAYOUTS[kind]
    src = layout.random(LAYERS, jax.random.key(0))
    ids = jaxsync.upload_packed({"src": np.zeros(8, np.int32), "dst": np.arange(8, dtype=np.int32)})
    exported = jax.export.export(_pallas._copy_pallas, platforms=["tpu"])(
        src, src, ids, _pallas.Plan(backend="tpu")
    )
    text = exported.mlir_module()
    assert exported.platforms == ("tpu",)
    assert text.count("tpu_custom_call") == len(jax.tree.leaves(src))  # one kernel per leaf
    assert "f64" not in text and "callback" not in text


def test_tpu_kernel_per_shard_equals_xla():
    mesh = jaxsync.testing.device_mesh("h")
    heads = KVLayout(kind="packed", num_blocks=12, block_size=4, num_kv_heads=8, head_dim=3,
                     dtype=jnp.float32)  # fmt: skip
    shard = NamedSharding(mesh, P(None, "h"))
    src = heads.random(LAYERS, jax.random.key(0), placement=shard)
    want = copy_blocks(src, heads.random(LAYERS, jax.random.key(1), placement=shard), [3, 0, 11],
                       [7, 2, 0], impl="xla")  # fmt: skip
    dst = heads.random(LAYERS, jax.random.key(1), placement=shard)
    with _pallas.interpreted("tpu"):
        got = copy_blocks(src, dst, [3, 0, 11], [7, 2, 0])
    for name in LAYERS:
        assert got[name].sharding.is_equivalent_to(shard, 4)
    for a, b in zip(bits(got), bits(want), strict=True):
        np.testing.assert_array_equal(a, b)
