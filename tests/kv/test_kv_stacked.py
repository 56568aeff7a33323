"""Stacked caches (`KVLayout(stacked=True)`, block-major `[P, L, ...]`): one program per entry
point with a jit argument count independent of the layer count, bit-exact with the per-layer
layout for every entry point, sharded over kv heads too."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxsync
import jaxsync.testing
from jaxsync._calls import CallCache
from jaxsync.check import no_recompile
from jaxsync.kv import (
    KVLayout,
    StackedCache,
    _copy,
    _pool,
    _slots,
    copy_blocks,
    extract_kv,
    host_pool,
    inject_kv,
    load_kv,
    save_kv,
    stack_layers,
    swap_in,
    swap_out,
    unstack_layers,
)
from jaxsync.testing import fresh_copy, kv_call, main_arg_count


DEV = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
HOST = DEV.with_memory_kind("pinned_host")
KINDS = {
    "packed": dict(kind="packed", num_kv_heads=2, head_dim=3, dtype=jnp.bfloat16),
    "separate": dict(kind="separate", num_kv_heads=2, head_dim=4, dtype=jnp.float32),
    "mla": dict(kind="mla", latent_dim=5, dtype=jnp.float16),
}
LAYERS = ("l0", "l1", "l2")


def layout(kind, stacked, num_blocks=11):
    return KVLayout(num_blocks=num_blocks, block_size=4, stacked=stacked, **KINDS[kind])


def pair(kind, seed, num_blocks=11, placement=None):
    """The same random cache in both layouts."""
    stacked = layout(kind, True, num_blocks).random(
        LAYERS, jax.random.key(seed), placement=placement
    )
    return stacked, unstack_layers(stacked)


def bits(tree):
    return [np.asarray(x).view(np.uint8) for x in jax.tree.leaves(tree)]


def assert_same(stacked, per_layer):
    """A stacked result equals the per-layer one bit for bit."""
    if isinstance(stacked, StackedCache):
        stacked = unstack_layers(stacked)
    for a, b in zip(bits(stacked), bits(per_layer), strict=True):
        np.testing.assert_array_equal(a, b)


def stacked_rows_as_layers(rows: StackedCache) -> dict:
    """Rows `[N, L, ...]` of a stacked cache as per-layer rows `[N, ...]`."""
    return {n: jax.tree.map(lambda x, i=i: x[:, i], rows.kv) for i, n in enumerate(rows.layers)}


def test_layout_and_stack_round_trip():
    stacked, per_layer = pair("separate", 0)
    assert isinstance(stacked, StackedCache) and stacked.layers == LAYERS
    assert stacked.kv[0].shape == (11, 3, 2, 4, 4)  # [P, L, K, S, H]
    assert_same(stack_layers(per_layer), per_layer)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("direction", ["d2d", "d2h", "h2d", "within"])
@pytest.mark.parametrize("impl", ["auto", "xla", "kernel"])
def test_copy_blocks_parity(kind, direction, impl):
    src_ids, dst_ids = [3, 0, 10, 4], [7, 2, 0, 3]
    s_st, s_pl = pair(kind, 0)
    d_st, d_pl = pair(kind, 1)
    if direction == "within":
        s_st, s_pl, d_st, d_pl = d_st, d_pl, d_st, d_pl
    if direction == "d2h":
        d_st, d_pl = fresh_copy(d_st, "pinned_host"), fresh_copy(d_pl, "pinned_host")
    if direction == "h2d":
        s_st, s_pl = fresh_copy(s_st, "pinned_host"), fresh_copy(s_pl, "pinned_host")
    want = copy_blocks(s_pl, d_pl, src_ids, dst_ids, impl="xla")
    got = kv_call(copy_blocks, s_st, d_st, src_ids, dst_ids, impl=impl)
    if direction == "d2h":
        got, want = fresh_copy_to_device(got), fresh_copy_to_device(want)
    assert_same(got, want)


def fresh_copy_to_device(tree):
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind("device")), tree)


@pytest.mark.parametrize("kind", list(KINDS))
def test_slot_paths_and_storage_parity(kind, tmp_path):
    s_st, s_pl = pair(kind, 0)
    slots = [5, 0, 17, 43, 12, 9, 2]
    rows_st, rows_pl = extract_kv(s_st, slots), extract_kv(s_pl, slots)
    assert_same(stacked_rows_as_layers(rows_st), rows_pl)
    d_st, d_pl = pair(kind, 1)
    assert_same(inject_kv(d_st, rows_st, slots), inject_kv(d_pl, rows_pl, slots))
    tokens, blocks = list(range(13)), [6, 2, 9, 4]
    folder_st = save_kv(tmp_path / "st", s_st, tokens, blocks)
    folder_pl = save_kv(tmp_path / "pl", s_pl, tokens, blocks)
    for layer in LAYERS:  # the same files: a stacked cache saves what per-layer ones do
        a = (tmp_path / "st" / folder_st.split("/")[-1] / f"{layer}.safetensors").read_bytes()
        b = (tmp_path / "pl" / folder_pl.split("/")[-1] / f"{layer}.safetensors").read_bytes()
        assert a == b
    d_st, d_pl = pair(kind, 2)
    loaded_st = load_kv(tmp_path / "pl", d_st, tokens, [1, 8, 3, 0])  # files of per-layer caches
    loaded_pl = load_kv(tmp_path / "pl", d_pl, tokens, [1, 8, 3, 0])
    assert_same(loaded_st, loaded_pl)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("impl", ["auto", "kernel"])
def test_pool_swaps_parity(kind, impl):
    s_st, s_pl = pair(kind, 0)
    pool_st = swap_out(s_st, host_pool(s_st, 6), [3, 0, 10], [5, 1, 2])
    pool_pl = swap_out(s_pl, host_pool(s_pl, 6), [3, 0, 10], [5, 1, 2])
    d_st, d_pl = pair(kind, 1)
    got = kv_call(swap_in, pool_st, d_st, [5, 1, 2], [4, 9, 0], impl=impl)
    assert_same(got, swap_in(pool_pl, d_pl, [5, 1, 2], [4, 9, 0], impl="xla"))


def _copy_args(num_layers: int, stacked: bool, kind="packed") -> int:
    names = tuple(f"layer{i:02d}" for i in range(num_layers))
    cache = layout(kind, stacked, 16).random(names, jax.random.key(0))
    ids = jaxsync.upload_packed({"src": np.zeros(8, np.int32), "dst": np.arange(8, dtype=np.int32)})
    return main_arg_count(_copy._copy_same_memory.trace(cache, fresh_copy(cache), ids).lower())


def test_jit_argument_count_does_not_grow_with_layers():
    counts = {(n, s): _copy_args(n, s) for n in (4, 32) for s in (False, True)}
    assert counts[(32, True)] == counts[(4, True)] <= 6, counts  # src, dst, ids
    assert counts[(32, False)] > counts[(4, False)], counts  # negative control: per-layer grows
    assert _copy_args(32, True, "separate") <= 6  # (k, v): 2 + 2 + ids


def test_every_stacked_entry_point_is_one_program_of_few_arguments():
    names = tuple(f"layer{i:02d}" for i in range(32))
    cache = layout("packed", True, 16).random(names, jax.random.key(0))
    ids = jaxsync.upload_packed({"src": np.zeros(8, np.int32), "dst": np.arange(8, dtype=np.int32)})
    slots = jaxsync.upload_packed({"slots": np.arange(8, dtype=np.int32)})
    pool = host_pool(cache, 4)
    rows = extract_kv(cache, [0, 1])
    programs = {
        "copy": _copy._copy_same_memory.trace(cache, fresh_copy(cache), ids),
        "within": _copy._copy_within.trace(cache, ids),
        "extract": _slots._extract.trace(cache, slots),
        "inject": _slots._inject.trace(cache, rows, slots),
        "swap_out": _pool._swap_out.trace(jax.tree.leaves(cache), pool.blocks, ids),
        "swap_in": _pool._swap_in.trace(pool.blocks, jax.tree.leaves(cache), ids),
    }
    for name, traced in programs.items():
        assert main_arg_count(traced.lower()) <= 6, name


@pytest.mark.parametrize("impl", ["auto", "kernel"])
def test_stacked_caches_sharded_over_kv_heads(impl):
    mesh = jaxsync.testing.device_mesh("h")
    heads = KVLayout(kind="packed", num_blocks=12, block_size=4, num_kv_heads=8, head_dim=4,
                     dtype=jnp.float32, stacked=True)  # fmt: skip
    shard = NamedSharding(mesh, P(None, "h"))  # per layer: [P, K, S, X] split over kv heads
    src = heads.random(LAYERS, jax.random.key(0), placement=shard)
    dst = heads.random(LAYERS, jax.random.key(1), placement=shard)
    assert src.kv.sharding.spec[2] == "h"  # [P, L, K, S, X]: still split over kv heads
    want = copy_blocks(unstack_layers(src), unstack_layers(dst), [3, 0, 11], [7, 2, 0], impl="xla")
    got = kv_call(copy_blocks, src, dst, [3, 0, 11], [7, 2, 0], impl=impl)
    assert got.kv.sharding.is_equivalent_to(src.kv.sharding, 5)
    assert_same(got, want)
    rows = extract_kv(got, [1, 2, 3])
    got = inject_kv(got, rows, [40, 41, 42])
    with no_recompile():
        got = inject_kv(got, rows, [44, 45])
        extract_kv(got, [5])


def _kept_pair(layers=3, blocks=16):
    layout = KVLayout(kind="packed", num_blocks=blocks, block_size=2, num_kv_heads=2, head_dim=4)
    names = [f"l{i}" for i in range(layers)]
    src = stack_layers(layout.random(names, jax.random.key(0)))
    dst = stack_layers(layout.random(names, jax.random.key(1)))
    return src, dst


def _blocks(cache, ids):
    return np.asarray(cache.kv)[ids]


def test_repeated_copy_is_kept_and_copies_the_same(monkeypatch):
    src, dst = _kept_pair()
    hits = []
    find = _copy._KEPT.find_tree

    def watched(*args):
        found = find(*args)
        hits.append(found[0])
        return found

    monkeypatch.setattr(_copy._KEPT, "find_tree", watched)
    want_src = np.asarray(src.kv)
    for _ in range(3):  # the first call checks and keeps, the others hit
        dst = copy_blocks(src, dst, [1, 5, 7], [2, 3, 11])
        np.testing.assert_array_equal(_blocks(dst, [2, 3, 11]), want_src[[1, 5, 7]])
    assert [h is not None for h in hits] == [False, True, True]
    np.testing.assert_array_equal(np.asarray(src.kv), want_src)  # the source is never written


def test_kept_copy_still_refuses_what_its_key_cannot_see():
    src, dst = _kept_pair()
    ids = [1, 5]
    dst = copy_blocks(src, dst, ids, [2, 3])
    dst = copy_blocks(src, dst, ids, [2, 3])  # kept
    ids[1] = 99  # mutated in place: a new key, checked, refused
    with pytest.raises(ValueError, match=r"must lie in \[0, 16\)"):
        copy_blocks(src, dst, ids, [2, 3])
    old = dst
    dst = copy_blocks(src, dst, [1, 5], [2, 3])  # donates `old`
    with pytest.raises(ValueError, match="deleted"):
        copy_blocks(src, old, [1, 5], [2, 3])  # same signature, a deleted (donated) cache
    before = np.asarray(dst.kv)
    with pytest.raises(ValueError, match="deleted"):
        copy_blocks(old, dst, [1, 5], [2, 3])  # a deleted source: dst is not consumed
    np.testing.assert_array_equal(np.asarray(dst.kv), before)
    within = copy_blocks(dst, dst, [1, 5], [2, 3])  # one cache: another program, same shapes
    np.testing.assert_array_equal(_blocks(within, [2, 3]), before[[1, 5]])


def test_new_ids_on_known_caches_check_only_the_ids(monkeypatch):
    """A server's every step: new ids on the same caches. The cache checks run once per cache
    signature; the ids are checked every call, and a donated cache is still refused."""
    src, dst = _kept_pair()
    # as in a fresh process
    monkeypatch.setattr(_copy, "_PROGRAMS", jaxsync.PlanCache(maxsize=256))
    monkeypatch.setattr(_copy, "_KEPT", CallCache(256, checks=_copy._KEPT_CHECKS))
    checks = []
    program = _copy._program
    monkeypatch.setattr(_copy, "_program", lambda *a: checks.append(1) or program(*a))
    want = np.asarray(src.kv)
    for s_ids, d_ids in (([1, 5], [2, 3]), ([7, 0, 4], [9, 10, 12]), ([3], [15])):
        dst = copy_blocks(src, dst, s_ids, d_ids)
        np.testing.assert_array_equal(_blocks(dst, d_ids), want[s_ids])
    assert checks == [1]  # one program choice for three id contents
    with pytest.raises(ValueError, match=r"must lie in \[0, 16\)"):
        copy_blocks(src, dst, [1, 2], [3, 16])  # new ids: checked
    with pytest.raises(ValueError, match="must be unique"):
        copy_blocks(src, dst, [1, 2], [3, 3])
    old = dst
    dst = copy_blocks(src, dst, [2], [4])  # donates `old`
    with pytest.raises(ValueError, match="deleted"):
        copy_blocks(src, old, [6], [8])  # same signature, new ids, a donated cache
    assert checks == [1, 1]  # control: the refusal came from the full checks
    np.testing.assert_array_equal(_blocks(dst, [4]), want[[2]])


def test_kept_copy_follows_the_kernel_switches(monkeypatch):
    from jaxsync.kv import _pallas

    src, dst = _kept_pair()
    dst = copy_blocks(src, dst, [1, 5], [2, 3])  # XLA on CPU, kept
    chosen = []
    plan = _pallas.auto_plan
    monkeypatch.setattr(_pallas, "auto_plan", lambda *a, **k: chosen.append(1) or plan(*a, **k))
    with _pallas.interpreted("gpu"):  # another kernel choice: not served the kept XLA call
        dst = copy_blocks(src, dst, [1, 5], [2, 3])
    assert chosen == [1]
    np.testing.assert_array_equal(_blocks(dst, [2, 3]), np.asarray(src.kv)[[1, 5]])


def test_copy_traced_with_concrete_caches_keeps_nothing_traced(monkeypatch):
    # Traced with concrete caches closed over, the id upload is a traced value: it must not be
    # kept for the real calls that follow (they would run on a leaked tracer).
    src, dst = _kept_pair()
    jax.make_jaxpr(lambda: copy_blocks(src, dst, [1, 5], [2, 3]))()
    dst = copy_blocks(src, dst, [1, 5], [2, 3])
    dst = copy_blocks(src, dst, [1, 5], [2, 3])  # the repeat, kept now
    np.testing.assert_array_equal(_blocks(dst, [2, 3]), np.asarray(src.kv)[[1, 5]])
    # control: keeping during the trace is what leaks
    src, dst = _kept_pair()
    monkeypatch.setattr(jaxsync._compat, "tracing", lambda: False)
    jax.make_jaxpr(lambda: copy_blocks(src, dst, [4, 6], [7, 8]))()
    with pytest.raises(jax.errors.UnexpectedTracerError):
        jax.block_until_ready(copy_blocks(src, dst, [4, 6], [7, 8]))
