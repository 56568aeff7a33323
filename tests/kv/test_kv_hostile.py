"""Hostile input to every public kv entry point: each call either raises a documented error
(TypeError / ValueError / OSError) naming the problem, before anything is uploaded or compiled,
with every input bit-identical, or returns the numpy reference's result."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from jaxsync.kv import (
    HostPool,
    KVLayout,
    copy_blocks,
    extract_kv,
    host_pool,
    inject_kv,
    kv_folder,
    load_kv,
    save_kv,
    slot_mapping_for,
    swap_in,
    swap_out,
)
from jaxsync.testing import count_dispatch, fresh_copy


LAYERS = ("a", "b")
LAYOUT = KVLayout(kind="packed", num_blocks=7, block_size=2, num_kv_heads=1, head_dim=3,
                  dtype=jnp.float32)  # fmt: skip  # odd sizes
P, S = LAYOUT.num_blocks, LAYOUT.block_size
MASTER = LAYOUT.random(LAYERS, jax.random.key(0))
OTHER = LAYOUT.random(LAYERS, jax.random.key(1))
SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip

# Id lists: mostly well-formed, often not (floats, bools, nesting, strings, None, dtypes).
ELEMENT = st.one_of(
    st.integers(-2, 16),
    st.floats(-2, 16),
    st.booleans(),
    st.none(),
    st.text(max_size=1),
    st.lists(st.integers(0, 3), max_size=2),
    st.sampled_from([np.int32(1), np.float32(2), np.bool_(True), np.uint8(3)]),
)
IDS = st.one_of(
    st.lists(st.integers(0, 15), max_size=9),
    st.lists(ELEMENT, max_size=5),
    st.lists(st.integers(-2, 16), max_size=6).map(np.array),
    st.lists(st.integers(0, 6), max_size=6).map(lambda x: np.array(x, np.float64)),
    st.lists(st.booleans(), min_size=1, max_size=4).map(np.array),
    st.sampled_from(["01", b"\x00", None, 3, 2.0, {1: 2}, {1, 2}, np.zeros((2, 2), np.int32)]),
)


def valid_ids(ids, limit: int | None, padding: bool = False) -> np.ndarray | None:
    """The oracle: ids as an int array when well-formed and inside [0, limit) (or -1, vLLM's
    padding slot, with `padding`; any value with no limit), else None."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            return None
        arr = ids.astype(np.int64)
    elif isinstance(ids, list):
        if any(isinstance(x, bool | np.bool_) or not isinstance(x, int | np.integer) for x in ids):
            return None
        arr = np.array(ids, np.int64).reshape(-1)
    else:
        return None
    if limit is None:
        return arr
    ok = (arr >= 0) & (arr < limit)
    if padding:
        ok |= arr == -1
    return arr if np.all(ok) else None


def host(tree):
    return [np.asarray(x).copy() for x in jax.tree.leaves(tree)]


def refused(fn, *args, keep, **kwargs):
    """Calls fn expecting a documented refusal; checks nothing was dispatched or changed."""
    before = host(keep)
    with count_dispatch() as seen:
        with pytest.raises((TypeError, ValueError, OSError)) as info:
            fn(*args, **kwargs)
    assert str(info.value), "the error must name the problem"
    assert (seen.uploads, seen.compiles) == (0, 0), (info.value, seen.uploads, seen.compiles)
    assert not any(x.is_deleted() for x in jax.tree.leaves(keep))
    for a, b in zip(host(keep), before, strict=True):
        np.testing.assert_array_equal(a, b)


@SETTINGS
@given(src_ids=IDS, dst_ids=IDS)
def test_copy_blocks(src_ids, dst_ids):
    s, d = valid_ids(src_ids, P), valid_ids(dst_ids, P)
    ok = s is not None and d is not None and s.size == d.size and np.unique(d).size == d.size
    dst = fresh_copy(OTHER)
    if not ok:
        return refused(copy_blocks, MASTER, dst, src_ids, dst_ids, keep=(MASTER, dst))
    out = copy_blocks(MASTER, dst, src_ids, dst_ids)
    for got, src, was in zip(host(out), host(MASTER), host(OTHER), strict=True):
        was[d] = src[s]
        np.testing.assert_array_equal(got, was)


@SETTINGS
@given(src_ids=IDS, dst_ids=IDS)
def test_swaps(src_ids, dst_ids):
    pool = host_pool(MASTER, 5)
    s, d = valid_ids(src_ids, P), valid_ids(dst_ids, 5)
    ok = s is not None and d is not None and s.size == d.size and np.unique(d).size == d.size
    if not ok:
        return refused(swap_out, MASTER, pool, src_ids, dst_ids, keep=(MASTER, pool.blocks))
    pool = swap_out(MASTER, pool, src_ids, dst_ids)
    back = (
        swap_in(pool, fresh_copy(OTHER), dst_ids, src_ids) if np.unique(s).size == s.size else None
    )
    for i, (src, was) in enumerate(zip(host(MASTER), host(OTHER), strict=True)):
        np.testing.assert_array_equal(np.asarray(pool.blocks)[d, i], src[s])
        if back is not None:
            was[s] = src[s]
            np.testing.assert_array_equal(host(back)[i], was)


@SETTINGS
@given(slots=IDS)
def test_extract_and_inject(slots):
    t = valid_ids(slots, P * S, padding=True)
    if t is None:
        refused(extract_kv, MASTER, slots, keep=(MASTER,))
        return
    rows = extract_kv(MASTER, slots)
    real = t >= 0  # -1 is a padded token: it reads zeros and writes nothing
    for got, leaf in zip(host(rows), host(MASTER), strict=True):
        np.testing.assert_array_equal(got[: t.size][real], leaf[t[real] // S, :, t[real] % S])
        assert not got[: t.size][~real].any()
    dst = fresh_copy(OTHER)
    if np.unique(t[real]).size != t[real].size:
        return refused(inject_kv, dst, rows, slots, keep=(dst, rows))
    out = inject_kv(dst, rows, slots)
    r = t[real]
    for got, src, was in zip(host(out), host(MASTER), host(OTHER), strict=True):
        was[r // S, :, r % S] = src[r // S, :, r % S]
        np.testing.assert_array_equal(got, was)


INTS = st.one_of(st.integers(-2, 9), st.floats(-2, 9), st.booleans(), st.none(), st.just("4"),
                 st.sampled_from([np.int64(4), np.float64(4), np.bool_(True)]))  # fmt: skip


@SETTINGS
@given(block_ids=IDS, block_size=INTS, num_tokens=INTS)
@example(block_ids=np.array([-1]), block_size=1, num_tokens=0)  # padding, no block kept
@example(block_ids=[-1, 3], block_size=2, num_tokens=5)  # a padded block's slots are -1
@example(block_ids=[-2, 3], block_size=2, num_tokens=5)  # -2 is no padding: refused
def test_slot_mapping_for(block_ids, block_size, num_tokens):
    def is_int(x):
        return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)

    # -1 is a padded entry of the block table (documented): accepted, its slots are -1
    limit = np.iinfo(np.int32).max // max(2, int(block_size) if is_int(block_size) else 2)
    ids = valid_ids(block_ids, limit, padding=True)
    ok = is_int(block_size) and block_size > 0 and is_int(num_tokens) and num_tokens >= 0
    kept = (num_tokens - 1) // block_size if ok and num_tokens else 0
    if not ok or ids is None or ids.size < kept:
        with pytest.raises((TypeError, ValueError)) as info:
            slot_mapping_for(block_ids, block_size, num_tokens)
        assert str(info.value)
        return
    slots = ids[:kept, None] * block_size + np.arange(block_size)
    want = np.where(ids[:kept, None] == -1, -1, slots).reshape(-1)
    np.testing.assert_array_equal(slot_mapping_for(block_ids, block_size, num_tokens), want)


HASHES = st.one_of(
    st.lists(st.text(max_size=3), max_size=3),
    st.text(max_size=3),
    st.lists(st.one_of(st.integers(), st.binary(max_size=2)), min_size=1, max_size=2),
    st.none(),
)


@SETTINGS
@given(tokens=IDS, hashes=HASHES)
def test_kv_folder(tokens, hashes):
    ok_tokens = valid_ids(tokens, 2**62) is not None or (isinstance(tokens, list) and not tokens)
    ok_hashes = isinstance(hashes, list) and all(
        isinstance(h, str) and h and "-" not in h and "\0" not in h for h in hashes
    )
    if isinstance(tokens, list) and any(isinstance(x, int) and x < 0 for x in tokens):
        ok_tokens = all(isinstance(x, int) and not isinstance(x, bool) for x in tokens)
    if (
        isinstance(tokens, np.ndarray)
        and tokens.ndim == 1
        and np.issubdtype(tokens.dtype, np.integer)
    ):
        ok_tokens = True  # any int64 token bytes key as upstream's
    if ok_tokens and ok_hashes:
        assert os.path.dirname(kv_folder("/r", tokens, hashes)) == "/r"
    else:
        with pytest.raises((TypeError, ValueError)) as info:
            kv_folder("/r", tokens, hashes)
        assert str(info.value)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv")
    save_kv(root, MASTER, list(range(9)), [3, 5, 1, 0])
    return root


def distinct_blocks(blocks: np.ndarray) -> bool:
    """No block id repeats, padding (-1) aside."""
    real = blocks[blocks >= 0]
    return np.unique(real).size == real.size


@SETTINGS
@given(tokens=IDS, block_ids=IDS)
@example(tokens=[], block_ids=np.array([-1]))  # no whole block, padding only: nothing to do
@example(tokens=list(range(9)), block_ids=[-1, 4, -1, 2])  # padding skipped, the rest loads
@example(tokens=list(range(9)), block_ids=[2, 2, 1, 0])  # a repeated block: refused
@example(tokens=np.array([-1]), block_ids=[])  # a token id only keys the folder: any int
def test_load_kv(saved, tokens, block_ids):
    # Only the saved request loads; every other input is refused before any upload.
    dst = fresh_copy(OTHER)
    # -1 in a block table is padding: nothing is loaded there, and it may repeat. Token ids
    # only key the request's folder (int64 bytes, as `kv_folder`): any int value is one.
    tok, blocks = valid_ids(tokens, None), valid_ids(block_ids, P, padding=True)
    match = tok is not None and tok.size == 9 and np.array_equal(tok, np.arange(9))
    if match and blocks is not None and blocks.size >= 4 and distinct_blocks(blocks[:4]):
        out = load_kv(saved, dst, tokens, block_ids)
        real = blocks[:4] >= 0
        for got, src in zip(host(out), host(MASTER), strict=True):
            np.testing.assert_array_equal(got[blocks[:4][real]], src[[3, 5, 1, 0]][real])
        return
    keep = (dst,)
    if tok is not None and blocks is not None and tok.size > S and blocks.size * S >= tok.size - 1:
        kept = (tok.size - 1) // S
        if distinct_blocks(blocks[:kept]):
            with pytest.raises(FileNotFoundError):  # another request: nothing saved
                load_kv(saved, dst, tokens, block_ids)
            return
    if tok is not None and tok.size <= S and blocks is not None:
        assert load_kv(saved, dst, tokens, block_ids) is dst  # no whole block: nothing to do
        return
    refused(load_kv, saved, dst, tokens, block_ids, keep=keep)


BAD_CACHES = {
    "list": [MASTER["a"], MASTER["b"]],
    "numpy leaves": {"a": np.zeros(LAYOUT.leaf_shape, np.float32)},
    "empty": {},
    "1-D leaf": {"a": jnp.zeros((7,))},
    "layers disagree on P": {"a": MASTER["a"], "b": jnp.zeros((5, 1, 2, 6))},
    "other dtype": {"a": OTHER["a"].astype(jnp.bfloat16), "b": OTHER["b"]},
    "other layers": {"a": OTHER["a"], "c": OTHER["b"]},
}


@pytest.mark.parametrize("name", list(BAD_CACHES))
def test_malformed_caches(name, tmp_path):
    bad = BAD_CACHES[name]
    keep = (MASTER,)
    refused(copy_blocks, MASTER, bad, [0], [1], keep=keep)
    refused(copy_blocks, bad, fresh_copy(OTHER), [0], [1], keep=keep)
    if name not in ("other dtype", "other layers"):  # a well-formed cache of its own
        refused(extract_kv, bad, [0], keep=keep)
        refused(host_pool, bad, 4, keep=keep)
        refused(save_kv, tmp_path, bad, list(range(5)), [0, 1], keep=keep)
    pool = host_pool(MASTER, 4)
    refused(swap_in, pool, bad, [0], [1], keep=(pool.blocks,))
    refused(swap_out, bad, pool, [0], [1], keep=(pool.blocks,))


def test_malformed_pools_and_rows():
    pool = host_pool(MASTER, 4)
    refused(swap_in, pool.blocks, fresh_copy(OTHER), [0], [1], keep=(pool.blocks,))
    on_device = HostPool(jnp.zeros(pool.blocks.shape), pool.treedef)
    refused(swap_in, on_device, fresh_copy(OTHER), [0], [1], keep=(MASTER,))
    dst = fresh_copy(OTHER)
    rows = extract_kv(MASTER, [0, 1])
    refused(inject_kv, dst, {"a": rows["a"]}, [0, 1], keep=(dst,))  # layers missing
    refused(inject_kv, dst, jax.tree.map(lambda x: x[:4], rows), [0, 1], keep=(dst,))  # bucket
    refused(inject_kv, dst, jax.tree.map(np.asarray, rows), [0, 1], keep=(dst,))  # host rows
    refused(host_pool, MASTER, 0, keep=(MASTER,))
    with pytest.raises(ValueError, match="kind"):
        KVLayout(kind="dense", num_blocks=1, block_size=1, num_kv_heads=1, head_dim=1)


def test_impl_and_direction_values():
    dst = fresh_copy(OTHER)
    for kwargs in (
        dict(impl="pallas"),
        dict(impl=None),
        dict(direction="d2x"),
        dict(direction="h2d"),
    ):
        refused(copy_blocks, MASTER, dst, [0], [1], keep=(MASTER, dst), **kwargs)
    refused(swap_in, host_pool(MASTER, 4), dst, [0], [1], impl="mosaic", keep=(dst,))


def test_placements_stale_buffers_and_files(tmp_path):
    pinned = fresh_copy(MASTER, "pinned_host")
    refused(extract_kv, pinned, [0], keep=(MASTER,))  # slot paths need device memory
    refused(copy_blocks, pinned, fresh_copy(pinned_to_device(pinned)), [0], [1], direction="d2d",
            keep=(MASTER,))  # fmt: skip
    refused(swap_out, pinned, host_pool(MASTER, 4), [0], [1], keep=(MASTER,))
    stale = fresh_copy(OTHER)
    copy_blocks(MASTER, stale, [0], [1])  # donates `stale`
    folder = save_kv(tmp_path, MASTER, list(range(5)), [1, 2])
    refused(save_kv, tmp_path, stale, list(range(5)), [1, 2], keep=(MASTER,))
    refused(load_kv, tmp_path, stale, list(range(5)), [1, 2], keep=(MASTER,))
    dst = fresh_copy(OTHER)
    os.remove(os.path.join(folder, "b.safetensors"))
    with count_dispatch() as seen, pytest.raises(FileNotFoundError, match="layer 'b'"):
        load_kv(tmp_path, dst, list(range(5)), [1, 2])
    assert (seen.uploads, seen.compiles) == (0, 0) and not dst["a"].is_deleted()


def pinned_to_device(tree):
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind("device")), tree)


def test_torch_cpu_ids_are_host_data():
    # upstream's block tables are torch CPU tensors: taken like the same ids as a list; float
    # and bool tensors are refused like float and bool lists, before anything is dispatched
    torch = pytest.importorskip("torch")
    s, d = [4, 0, 6], [1, 5, 2]
    want = host(copy_blocks(MASTER, fresh_copy(OTHER), s, d))
    got = host(copy_blocks(MASTER, fresh_copy(OTHER), torch.tensor(s), torch.tensor(d)))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    for bad in (torch.tensor([4.0, 0.0, 6.0]), torch.tensor([True, False, True])):
        dst = fresh_copy(OTHER)
        refused(copy_blocks, MASTER, dst, bad, d, keep=(MASTER, dst))
