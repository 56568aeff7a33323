"""Copies within one cache, one program per bucket whatever made the cache, stale buffers, the
storage key, and errors host data can catch before anything is uploaded or compiled."""

import hashlib
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxsync.testing
from jaxsync.check import no_recompile
from jaxsync.kv import (
    KVLayout,
    copy_blocks,
    extract_kv,
    host_pool,
    inject_kv,
    kv_folder,
    load_kv,
    plan_copy,
    save_kv,
    slot_mapping_for,
    swap_in,
    swap_out,
)
from jaxsync.testing import assert_refused, fresh_copy, kv_call


LAYERS = ("l0", "l1", "l2")
LAYOUT = KVLayout(kind="packed", num_blocks=13, block_size=4, num_kv_heads=2, head_dim=4,
                  dtype=jnp.float32)  # fmt: skip
HEADS = KVLayout(kind="packed", num_blocks=11, block_size=4, num_kv_heads=8, head_dim=4,
                 dtype=jnp.float32)  # fmt: skip  # one kv head per simulated device


def bits(tree):
    return [np.asarray(x).copy() for x in jax.tree.leaves(tree)]


# --- copy within one cache -------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["auto", "xla", "kernel"])
def test_copy_within_one_cache_reads_every_source_before_writing(impl):
    cache = LAYOUT.random(LAYERS, jax.random.key(0))
    old = bits(cache)
    src, dst = [0, 1, 2, 7], [1, 2, 3, 0]  # 1 and 2 are sources and destinations; 0 <-> 7
    out = kv_call(copy_blocks, cache, cache, src, dst, impl=impl)
    assert all(x.is_deleted() for x in jax.tree.leaves(cache))  # donated once
    for got, was in zip(bits(out), old, strict=True):
        want = was.copy()
        want[dst] = was[src]  # vLLM's semantics: every source read before any write
        np.testing.assert_array_equal(got, want)
    with no_recompile():  # one program per bucket, within a cache too
        kv_call(copy_blocks, out, out, [4, 5], [6, 4], impl=impl)


def test_partly_shared_or_repeated_destination_is_refused_before_dispatch():
    src = LAYOUT.random(LAYERS, jax.random.key(0))
    other = LAYOUT.random(LAYERS, jax.random.key(1))
    partly = {"l0": src["l0"], "l1": other["l1"], "l2": other["l2"]}
    keep = (src, other)
    assert_refused(ValueError, "share some but not all", copy_blocks, src, partly, [0], [1],
                   keep=keep)  # fmt: skip
    twice = {"l0": other["l0"], "l1": other["l0"], "l2": other["l2"]}
    assert_refused(ValueError, "same array twice", copy_blocks, src, twice, [0], [1], keep=keep)


# --- one program per bucket, whatever made the cache -----------------------------------------


def _zeros(layout):
    return {n: jnp.zeros(layout.leaf_shape, layout.dtype) for n in LAYERS}


def _caches(how):
    if how == "random":
        return LAYOUT, LAYOUT.random(LAYERS, jax.random.key(0))
    if how == "zeros":
        return LAYOUT, _zeros(LAYOUT)
    mesh = jaxsync.testing.device_mesh("h")
    return HEADS, HEADS.random(
        LAYERS, jax.random.key(0), placement=NamedSharding(mesh, P(None, "h"))
    )


@pytest.mark.parametrize("how", ["random", "zeros", "sharded"])
def test_second_call_of_a_bucket_never_compiles(how):
    layout, src = _caches(how)
    _, dst = _caches(how)
    dst = copy_blocks(src, dst, [0, 1], [2, 3])  # warm up: exactly one call each
    with no_recompile():
        dst = copy_blocks(src, dst, [4], [5])
    with no_recompile():  # a copy within one cache made by the same constructor
        _, own = _caches(how)
    own = copy_blocks(own, own, [0], [1])
    with no_recompile():
        own = copy_blocks(own, own, [2], [3])
    _, fresh = _caches(how)
    rows = extract_kv(fresh, [0, 1, 2])
    with no_recompile():
        rows = extract_kv(fresh, [3, 4])
    _, target = _caches(how)
    target = inject_kv(target, rows, [5, 6, 7])
    with no_recompile():
        target = inject_kv(target, rows, [8, 9])
    _, cache = _caches(how)
    pool = swap_out(cache, host_pool(cache, 6), [0, 1], [0, 1])
    with no_recompile():
        pool = swap_out(cache, pool, [2], [3])
    _, back = _caches(how)
    back = swap_in(pool, back, [0, 1], [4, 5])
    with no_recompile():
        swap_in(pool, back, [3], [6])
    _, target = _caches(how)
    root = tempfile.mkdtemp()
    save_kv(root, src, list(range(9)), [1, 2])
    target = load_kv(root, target, list(range(9)), [3, 4])
    with no_recompile():
        load_kv(root, target, list(range(9)), [5, 6])


# --- stale (donated) buffers -----------------------------------------------------------------


def test_donated_pools_and_caches_are_refused_on_the_host():
    cache = LAYOUT.random(LAYERS, jax.random.key(0))
    stale_pool = host_pool(cache, 6)
    pool = swap_out(cache, stale_pool, [0], [0])  # stale_pool is consumed
    target = LAYOUT.random(LAYERS, jax.random.key(1))
    assert_refused(ValueError, "pool was donated", swap_in, stale_pool, target, [0], [1],
                   keep=(cache, target))  # fmt: skip
    assert_refused(ValueError, "pool was donated", swap_out, cache, stale_pool, [0], [1],
                   keep=(cache, target))  # fmt: skip
    stale = LAYOUT.random(LAYERS, jax.random.key(2))
    copy_blocks(cache, stale, [0], [1])
    rows = extract_kv(cache, [0])
    calls = [
        (copy_blocks, (cache, stale, [0], [1])),
        (copy_blocks, (stale, target, [0], [1])),
        (swap_in, (pool, stale, [0], [1])),
        (swap_out, (stale, pool, [0], [1])),
        (extract_kv, (stale, [0])),
        (inject_kv, (stale, rows, [0])),
    ]
    for fn, args in calls:
        assert_refused(ValueError, "deleted", fn, *args, keep=(cache, target))


# --- the storage key -------------------------------------------------------------------------


def _upstream_key(tokens, hashes):
    data = np.asarray(tokens, np.int64).tobytes() + "-".join(hashes).encode()
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def test_folder_key_matches_upstream_for_valid_input():
    for tokens, hashes in [([1, 2, 3], []), ([7, 0, 151_000], ["ab12", "ff"]), ([5], ["x" * 64])]:
        assert os.path.basename(kv_folder("/r", tokens, hashes)) == _upstream_key(tokens, hashes)
    assert kv_folder("/r", [1], ["a", "b"]) != kv_folder("/r", [1], ["ab"])


@pytest.mark.parametrize(
    "tokens, hashes, error",
    [
        ([1.0, 2.0], [], TypeError),  # would truncate onto another request's tokens
        ([True, 2], [], TypeError),
        (np.array([1.5]), [], TypeError),
        ([[1, 2], [3]], [], ValueError),
        ([1], "ab", TypeError),  # "-".join("ab") == "a-b" == "-".join(["a", "b"])
        ([1], ["a-b"], ValueError),
        ([1], ["a", ""], ValueError),
        ([1], ["a\0"], ValueError),
        ([1], [b"ab"], TypeError),
        ([1], [3], TypeError),
    ],
)
def test_folder_key_refuses_what_upstream_would_mis_key(tokens, hashes, error):
    with pytest.raises(error):
        kv_folder("/r", tokens, hashes)


BAD_INTS = [dict(block_size=True), dict(block_size=16.0), dict(num_tokens=8.0),
            dict(num_tokens=np.float32(8))]  # fmt: skip


@pytest.mark.parametrize("kwargs", BAD_INTS)
def test_slot_mapping_needs_ints(kwargs):
    args = dict(block_ids=[0, 1], block_size=4, num_tokens=8) | kwargs
    with pytest.raises(TypeError, match="must be an int"):
        slot_mapping_for(**args)


def test_ids_of_mixed_integer_types_are_taken_at_their_values():
    # numpy promotes a uint64 and an int64 scalar to float64: such ids were refused as floats.
    cache = LAYOUT.random(LAYERS, jax.random.key(0))
    src, dst = [np.uint64(1), np.int64(2), 3], [np.int8(4), np.uint32(5), np.int64(6)]
    want = bits(cache)
    for w in want:
        w[[4, 5, 6]] = w[[1, 2, 3]]
    for a, b in zip(bits(copy_blocks(cache, cache, src, dst)), want, strict=True):
        np.testing.assert_array_equal(a, b)
    other = LAYOUT.random(LAYERS, jax.random.key(1))
    for ids in (
        [2**63],
        [np.uint64(2**63 + 1), 3],
        np.array([2**64 - 1], np.uint64),
        [-(2**63) - 1],
    ):
        assert_refused(ValueError, "int64 range", copy_blocks, other, other, ids, [0], keep=other)


def test_plan_copy_needs_two_distinct_field_names():
    cache = LAYOUT.random(LAYERS, jax.random.key(0))
    for keys in (("ids", "ids"), ("src",), ("src", 1), ("d.geometry", "d")):
        with pytest.raises(ValueError, match="two distinct field names"):
            plan_copy(cache, [0], [1], keys=keys)  # a repeated name silently dropped the sources
    assert sorted(plan_copy(cache, [0], [1], keys=("s", "d"))) == ["d", "d.geometry", "s"]


# --- late errors host data can catch ---------------------------------------------------------


def _on(device_index, tree):
    return jax.device_put(tree, jax.devices()[device_index])


def test_caches_on_different_devices_are_refused_before_dispatch():
    a = _on(0, LAYOUT.random(LAYERS, jax.random.key(0)))
    b = _on(1, LAYOUT.random(LAYERS, jax.random.key(1)))
    keep = (a, b)
    assert_refused(ValueError, "different devices", copy_blocks, a, b, [0], [1], keep=keep)
    pool = host_pool(b, 4)
    assert_refused(ValueError, "different devices", swap_out, a, pool, [0], [1], keep=keep)
    assert_refused(ValueError, "different devices", swap_in, pool, a, [0], [1], keep=keep)
    rows = extract_kv(b, [0, 1])
    assert_refused(ValueError, "different devices", inject_kv, a, rows, [0, 1], keep=keep)


def test_storage_errors_come_before_gathers_and_uploads(tmp_path):
    cache = LAYOUT.random(LAYERS, jax.random.key(0))
    tokens, blocks = list(range(9)), [3, 5]
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert_refused(OSError, "file", save_kv, a_file, cache, tokens, blocks, keep=(cache,))
    folder = save_kv(tmp_path, cache, tokens, blocks)
    target = LAYOUT.random(LAYERS, jax.random.key(1))
    for bad_blocks in ([3, 13], [3, -2], [3, 3]):  # -1 alone is padding
        assert_refused(ValueError, "block_ids", load_kv, tmp_path, target, tokens, bad_blocks,
                       keep=(target,))  # fmt: skip
    layer = os.path.join(folder, "l1.safetensors")
    with open(layer, "rb") as f:
        data = f.read()
    with open(layer, "wb") as f:
        f.write(data[: len(data) // 2])  # truncated
    assert_refused(ValueError, "not a readable safetensors", load_kv, tmp_path, target, tokens,
                   blocks, keep=(target,))  # fmt: skip
    with open(layer, "wb") as f:
        f.write(b"\xff" * 64)  # corrupt header
    assert_refused(ValueError, "not a readable safetensors", load_kv, tmp_path, target, tokens,
                   blocks, keep=(target,))  # fmt: skip
    assert_refused(TypeError, "token_ids must hold ints", load_kv, tmp_path, target,
                   [float(t) for t in tokens], blocks, keep=(target,))  # fmt: skip


def test_fresh_copy_is_public_and_keeps_the_master():
    cache = LAYOUT.random(LAYERS, jax.random.key(0))
    copied = fresh_copy(cache)
    copy_blocks(cache, copied, [0], [1])
    assert not any(x.is_deleted() for x in jax.tree.leaves(cache))


def test_negative_control_uncommitted_caches_would_recompile(monkeypatch):
    # Without committing caches before dispatch, a jnp.zeros cache compiles its bucket twice.
    from jaxsync.check import RecompileError
    from jaxsync.kv import _copy

    monkeypatch.setattr(_copy, "committed", lambda tree: tree)
    src, dst = _zeros(LAYOUT), _zeros(LAYOUT)
    dst = copy_blocks(src, dst, [0, 1], [2, 3])
    with pytest.raises(RecompileError), no_recompile():
        copy_blocks(src, dst, [4], [5])
