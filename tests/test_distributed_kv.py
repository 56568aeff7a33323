"""A paged KV cache sharded over kv heads across 2 processes (`jaxsync.testing.run_distributed`,
4 CPU devices each, the "model" axis spanning both: process p holds kv heads 4p .. 4p + 3):
block copies, slot writes / reads and KV files keep each process on its own heads and equal the
one-process result: `save_kv` writes each block of heads from the process holding it, and
`load_kv` puts each process's blocks back from the files of its own heads.

One run of the worker serves every test: each step's outcome ("ok" or the error) comes back."""

import dataclasses
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsync.testing
from jaxsync.kv import KVLayout


distributed = jaxsync.testing.distributed_fixture(scope="module", timeout=240)

LAYERS = ("a", "b")
LAYOUT = KVLayout(kind="packed", num_blocks=9, block_size=4, num_kv_heads=8, head_dim=4,
                  dtype=jnp.float32)  # fmt: skip  # 2 kv heads per device of the "model" axis
SRC, DST = [0, 1, 8], [3, 4, 0]
SLOTS = [1, 6, 13, 35]  # block * 4 + offset
TOKENS, BLOCKS = list(range(9)), [5, 2, 7]  # a request of 9 tokens keeps 2 blocks
VARIANTS = [  # name, layout, format
    ("separate", dataclasses.replace(LAYOUT, kind="separate"), "vllm"),  # [2, T, k*H] per block
    ("stacked", dataclasses.replace(LAYOUT, stacked=True), "jaxsync"),
]
SAVE_BLOCKS = [1, 8, 3]  # the blocks the processes save from (as the one-process `saved`)


def _rows(seed):
    """[8, K, 2H] rows per layer: one per slot, then zeros to the slot bucket (8)."""
    rng = np.random.default_rng(seed)
    rows = {n: np.zeros((8, 8, 8), np.float32) for n in LAYERS}
    for r in rows.values():
        r[: len(SLOTS)] = rng.standard_normal((len(SLOTS), 8, 8))
    return rows


def _attempt(out, name, fn):
    """Runs one step; records "ok" or the error (the same step fails alike in every process)."""
    try:
        value = fn()
    except Exception as e:  # the outcome is the test's subject
        out[name] = f"{type(e).__name__}: {e}"
        return None
    out[name] = "ok"
    return value


def _kv_worker(ctx, root, shared):
    import os
    import shutil

    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxsync
    from jaxsync import kv
    from jaxsync.check import no_recompile, sync_guard

    heads = NamedSharding(ctx.mesh, P(None, "model"))
    everywhere = NamedSharding(ctx.mesh, P())
    src = LAYOUT.random(LAYERS, jax.random.key(0), placement=heads)
    dst = LAYOUT.random(LAYERS, jax.random.key(1), placement=heads)
    out = {"heads": sorted({s.index[1].indices(8)[:2] for s in src["a"].addressable_shards})}

    copied = _attempt(out, "copy_blocks", lambda: kv.copy_blocks(src, dst, SRC, DST))
    if copied is not None:
        out["copied"] = {n: ctx.gather(x) for n, x in copied.items()}
        out["copied_sharding"] = copied["a"].sharding == heads
        again = LAYOUT.random(LAYERS, jax.random.key(1), placement=heads)

        def guarded():  # the repeated call of one bucket: no read, no compile
            with sync_guard(), no_recompile():
                return kv.copy_blocks(src, again, DST, SRC)

        _attempt(out, "copy_blocks_guarded", guarded)

    rows = {n: jax.device_put(r, heads) for n, r in _rows(3).items()}
    plan = jaxsync.upload_packed(kv.plan_slots(src, SLOTS, write=True), placement=everywhere)
    written = _attempt(out, "write_slots", lambda: jax.jit(kv.write_slots)(src, rows, plan))
    if written is not None:
        read = jax.jit(kv.read_slots)(written, plan)
        out["written"] = {n: ctx.gather(x) for n, x in written.items()}
        out["read"] = {n: ctx.gather(x) for n, x in read.items()}

    def upload_guarded():
        with sync_guard():
            return jaxsync.async_h2d(np.arange(4, dtype=np.int32), placement=everywhere)

    _attempt(out, "upload_guarded", upload_guarded)

    fresh = LAYOUT.random(LAYERS, jax.random.key(1), placement=heads)  # dst was donated
    loaded = _attempt(out, "load_kv", lambda: kv.load_kv(root, fresh, TOKENS, BLOCKS))
    if loaded is not None:
        out["loaded"] = {n: ctx.gather(x) for n, x in loaded.items()}
    from jax.experimental import multihost_utils

    saved = _attempt(out, "save_kv", lambda: kv.save_kv(shared, src, TOKENS, SAVE_BLOCKS))
    multihost_utils.sync_global_devices("saved")  # every process's files are written
    if saved is not None:
        out["saved"] = saved
        target = LAYOUT.random(LAYERS, jax.random.key(1), placement=heads)
        back = _attempt(out, "load_shards", lambda: kv.load_kv(shared, target, TOKENS, BLOCKS))
        if back is not None:
            out["own_shards"] = _own_shards(back)
        # a folder with only this process's own files loads alike: no other process's file is read
        own = os.path.join(str(ctx.workdir), f"own{ctx.process_id}", os.path.basename(saved))
        os.makedirs(own)
        for name in os.listdir(saved):
            lo = int(name.split(".shard-")[1].split("-")[0])
            if lo // 4 == ctx.process_id:  # heads 4p .. 4p + 3
                shutil.copy(os.path.join(saved, name), own)
        target = LAYOUT.random(LAYERS, jax.random.key(1), placement=heads)
        alone = _attempt(
            out, "load_own", lambda: kv.load_kv(os.path.dirname(own), target, TOKENS, BLOCKS)
        )
        if alone is not None:
            out["own_alone"] = _own_shards(alone)
        # control: this process's files alone do not cover the other process's heads
        everywhere_cache = LAYOUT.random(LAYERS, jax.random.key(1), placement=everywhere)
        _attempt(
            out,
            "load_own_replicated",
            lambda: kv.load_kv(os.path.dirname(own), everywhere_cache, TOKENS, BLOCKS),
        )
    for variant in VARIANTS:  # a (k, v) pair and a stacked cache, saved by shards
        _save_and_load(ctx, out, heads, *variant)
    k, v = VARIANTS[0][1].random(["a"], jax.random.key(2), placement=heads)["a"]
    mixed = {"a": (k, jax.device_put(v, everywhere))}  # k split over heads, v whole everywhere
    mixed_root = str(ctx.workdir / "mixed")
    _attempt(out, "save_mixed", lambda: kv.save_kv(mixed_root, mixed, TOKENS, SAVE_BLOCKS))
    out["mixed_written"] = os.path.exists(mixed_root)
    return out


def _save_and_load(ctx, out, heads, name, layout, format):
    from jax.experimental import multihost_utils

    from jaxsync import kv

    cache = layout.random(LAYERS, jax.random.key(0), placement=heads)
    root = str(ctx.workdir / name)
    save = lambda: kv.save_kv(root, cache, TOKENS, SAVE_BLOCKS, format=format)  # noqa: E731
    _attempt(out, f"save_{name}", save)
    multihost_utils.sync_global_devices(f"saved {name}")
    target = layout.random(LAYERS, jax.random.key(1), placement=heads)
    load = lambda: kv.load_kv(root, target, TOKENS, BLOCKS, format=format)  # noqa: E731
    back = _attempt(out, f"load_{name}", load)
    if back is not None:
        out[f"blocks_{name}"] = _own_blocks(back)


def _own_blocks(cache):
    """Per cache leaf, `[(index: (start, stop) per axis, host block)]` of this process's devices."""
    out = []
    for x in jax.tree.leaves(cache):
        blocks = {
            tuple(s.indices(n)[:2] for s, n in zip(sh.index, x.shape, strict=True)): np.asarray(
                sh.data
            )
            for sh in x.addressable_shards
        }
        out.append(sorted(blocks.items()))
    return out


def _own_shards(cache):
    """`{layer: [(heads (start, stop), host bytes of the block)]}` of this process's devices."""
    out = {}
    for n, x in cache.items():
        blocks = {s.index[1].indices(8)[:2]: np.asarray(s.data) for s in x.addressable_shards}
        out[n] = sorted(blocks.items())
    return out


# ---------------------------------------------------------------- tests


def _host(cache):
    return {n: np.array(x) for n, x in cache.items()}  # writable copies


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A request's KV saved by this one process, from the cache the workers' `src` equals."""
    from jaxsync import kv

    root = tmp_path_factory.mktemp("kv")
    kv.save_kv(str(root), LAYOUT.random(LAYERS, jax.random.key(0)), TOKENS, [1, 8, 3])
    return str(root)


@pytest.fixture(scope="module")
def shared_root(tmp_path_factory):
    """Where the 2 processes save the cache they share (kept for this process to read)."""
    return str(tmp_path_factory.mktemp("kv_shards"))


@pytest.fixture(scope="module")
def outcomes(distributed, saved, shared_root):
    return distributed(_kv_worker, saved, shared_root)


def test_each_process_holds_only_its_heads(outcomes):
    assert [o["heads"] for o in outcomes] == [[(0, 2), (2, 4)], [(4, 6), (6, 8)]]


def test_copy_blocks_across_processes_equals_one_process(outcomes):
    src = _host(LAYOUT.random(LAYERS, jax.random.key(0)))
    want = _host(LAYOUT.random(LAYERS, jax.random.key(1)))
    for n in LAYERS:
        want[n][DST] = src[n][SRC]
    for o in outcomes:
        assert o["copy_blocks"] == "ok", o["copy_blocks"]
        assert o["copied_sharding"]
        for n in LAYERS:
            np.testing.assert_array_equal(o["copied"][n], want[n])


def test_write_then_read_slots_across_processes(outcomes):
    want = _host(LAYOUT.random(LAYERS, jax.random.key(0)))
    rows = _rows(3)
    blocks, offsets = np.divmod(SLOTS, LAYOUT.block_size)
    for n in LAYERS:  # packed [P, K, S, 2H]: slot s is block s // S, offset s % S
        want[n][blocks, :, offsets] = rows[n][: len(SLOTS)]
    for o in outcomes:
        assert o["write_slots"] == "ok", o["write_slots"]
        for n in LAYERS:
            np.testing.assert_array_equal(o["written"][n], want[n])
            np.testing.assert_array_equal(o["read"][n], rows[n])  # padding slots read zeros


def test_load_kv_fills_each_process_heads_from_one_process_files(outcomes):
    src = _host(LAYOUT.random(LAYERS, jax.random.key(0)))
    want = _host(LAYOUT.random(LAYERS, jax.random.key(1)))
    for n in LAYERS:  # saved from blocks [1, 8], loaded into [5, 2] (the third is not kept)
        want[n][[5, 2]] = src[n][[1, 8]]
    for o in outcomes:
        assert o["load_kv"] == "ok", o["load_kv"]
        for n in LAYERS:
            np.testing.assert_array_equal(o["loaded"][n], want[n])


def _known(outcome: str, cause: str) -> None:
    """Fails (the xfail's AssertionError) only for the known cause; anything else is an error."""
    if outcome != "ok":
        if cause in outcome:
            raise AssertionError(outcome)
        raise RuntimeError(f"not the known cause: {outcome}")


def _src_rows(blocks):
    """The one-process rows `{layer: [T, K, 2H]}` of the kept tokens of `blocks` in `src`."""
    src = _host(LAYOUT.random(LAYERS, jax.random.key(0)))
    slots = np.asarray([b * 4 + o for b in blocks[:2] for o in range(4)])
    return {n: src[n][slots // 4, :, slots % 4] for n in LAYERS}


def test_save_kv_writes_each_block_once_from_its_own_process(outcomes, shared_root):
    from safetensors import safe_open

    folder = outcomes[0]["save_kv"] == "ok" and outcomes[0]["saved"]
    for o in outcomes:
        assert o["save_kv"] == "ok", o["save_kv"]
        assert o["saved"] == folder and folder.startswith(shared_root)
    want = _src_rows(SAVE_BLOCKS)
    names = sorted(os.listdir(folder))
    blocks = [(0, 2), (2, 4), (4, 6), (6, 8)]  # the "model" axis' 4 blocks of 2 heads
    assert names == sorted(f"{n}.shard-{a}-{b}_0-8.safetensors" for n in LAYERS for a, b in blocks)
    for n in LAYERS:
        for a, b in blocks:
            with safe_open(
                os.path.join(folder, f"{n}.shard-{a}-{b}_0-8.safetensors"), "numpy"
            ) as f:
                stored = f.get_tensor("kv_cache")  # vLLM's packed layout, of the block's heads
            assert stored.tobytes() == np.ascontiguousarray(want[n][:, a:b]).tobytes()


def test_load_kv_puts_each_process_blocks_back_byte_equal(outcomes):
    src = _src_rows(SAVE_BLOCKS)
    want = _host(LAYOUT.random(LAYERS, jax.random.key(1)))
    for n in LAYERS:  # packed [P, K, S, 2H]: the 8 kept rows into blocks [5, 2]
        want[n][[5, 2]] = src[n].reshape(2, 4, 8, 8).transpose(0, 2, 1, 3)
    for p, o in enumerate(outcomes):
        for step, key in (("load_shards", "own_shards"), ("load_own", "own_alone")):
            assert o[step] == "ok", o[step]
            for n in LAYERS:
                got = o[key][n]
                assert [h for h, _ in got] == [(4 * p, 4 * p + 2), (4 * p + 2, 4 * p + 4)]
                for (a, b), block in got:
                    assert block.tobytes() == np.ascontiguousarray(want[n][:, a:b]).tobytes()


def test_load_kv_refuses_blocks_no_saved_file_covers(outcomes):
    for p, o in enumerate(outcomes):  # a replicated cache needs every head; one process's files
        assert o["load_own_replicated"].startswith("ValueError: no saved KV of layer 'a' covers")
        assert f"saved blocks [(({4 * p}, {4 * p + 2}), (0, 8))" in o["load_own_replicated"]


def test_a_save_across_processes_loads_in_one_process(outcomes):
    from jaxsync import kv

    folder = outcomes[0]["saved"]
    src = _src_rows(SAVE_BLOCKS)
    for placement in (None, _one_process_heads()):
        cache = LAYOUT.random(LAYERS, jax.random.key(1), placement=placement)
        got = _host(kv.load_kv(os.path.dirname(folder), cache, TOKENS, BLOCKS))
        want = _host(LAYOUT.random(LAYERS, jax.random.key(1)))
        for n in LAYERS:
            want[n][[5, 2]] = src[n].reshape(2, 4, 8, 8).transpose(0, 2, 1, 3)
            assert got[n].tobytes() == want[n].tobytes()


@pytest.mark.parametrize("name, layout, format", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_pairs_and_stacked_caches_round_trip_by_shards(outcomes, tmp_path, name, layout, format):
    """Each process's blocks after a save and load by shards equal one process's whole-file
    save and load of the same cache."""
    from jaxsync import kv

    kv.save_kv(
        tmp_path, layout.random(LAYERS, jax.random.key(0)), TOKENS, SAVE_BLOCKS, format=format
    )
    target = layout.random(LAYERS, jax.random.key(1))
    want = [
        np.asarray(x)
        for x in jax.tree.leaves(kv.load_kv(tmp_path, target, TOKENS, BLOCKS, format=format))
    ]
    fresh = [np.asarray(x) for x in jax.tree.leaves(layout.random(LAYERS, jax.random.key(1)))]
    assert not any(
        np.array_equal(w, f) for w, f in zip(want, fresh, strict=True)
    )  # the load changed each leaf
    for p, o in enumerate(outcomes):
        assert o[f"save_{name}"] == "ok", o[f"save_{name}"]
        assert o[f"load_{name}"] == "ok", o[f"load_{name}"]
        assert len(o[f"blocks_{name}"]) == len(want)
        for leaf, blocks in zip(want, o[f"blocks_{name}"], strict=True):
            heads = {key[2 if name == "stacked" else 1] for key, _ in blocks}
            assert heads == {(4 * p, 4 * p + 2), (4 * p + 2, 4 * p + 4)}
            for key, block in blocks:
                assert block.tobytes() == leaf[tuple(slice(a, b) for a, b in key)].tobytes()


def test_save_kv_refuses_k_and_v_sharded_differently_before_writing(outcomes):
    for o in outcomes:
        assert (
            o["save_mixed"] == "ValueError: layer 'a': k and v are sharded differently; cannot save"
        )
        assert not o["mixed_written"]


def _one_process_heads():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    return NamedSharding(Mesh(np.array(jax.devices()[:4]), ("model",)), P(None, "model"))


def _copy_of(folder, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(folder, root / os.path.basename(folder))
    return root, root / os.path.basename(folder)


def test_a_damaged_or_misnamed_shard_file_is_refused(outcomes, tmp_path):
    from jaxsync import kv

    folder = outcomes[0]["saved"]
    cache = LAYOUT.random(LAYERS, jax.random.key(1))
    before = _host(cache)
    root, copy = _copy_of(folder, tmp_path)
    (copy / "a.shard-2-4_0-8.safetensors").write_bytes(b"\x10" * 40)  # truncated, corrupt
    with pytest.raises(ValueError, match="a.shard-2-4_0-8.safetensors is not a readable"):
        kv.load_kv(root, cache, TOKENS, BLOCKS)
    # a block's file under another block's name: its metadata records the block it holds
    os.replace(copy / "b.shard-4-6_0-8.safetensors", copy / "a.shard-2-4_0-8.safetensors")
    with pytest.raises(ValueError, match=r"records layer 'b' block \(\(4, 6\), \(0, 8\)\)"):
        kv.load_kv(root, cache, TOKENS, BLOCKS)
    os.remove(copy / "a.shard-2-4_0-8.safetensors")  # a missing block
    with pytest.raises(ValueError, match=r"covers its block \(\(0, 8\), \(0, 8\)\)"):
        kv.load_kv(root, cache, TOKENS, BLOCKS)
    for n in LAYERS:  # refused before any upload: the cache was not donated
        np.testing.assert_array_equal(np.asarray(cache[n]), before[n])


def test_a_shard_file_of_another_cache_is_refused(outcomes):
    from jaxsync import kv

    folder = outcomes[0]["saved"]
    other = KVLayout(kind="packed", num_blocks=9, block_size=4, num_kv_heads=16, head_dim=4,
                     dtype=jnp.float32)  # fmt: skip
    cache = other.random(LAYERS, jax.random.key(1))
    with pytest.raises(ValueError, match=r"rows shaped \(8, 8\), this cache's layer 'a' has"):
        kv.load_kv(os.path.dirname(folder), cache, TOKENS, BLOCKS)


_SYNC = "host sync inside a jaxsync sync_guard"


def test_uploads_over_processes_do_not_sync(outcomes):
    for o in outcomes:
        _known(o["upload_guarded"], _SYNC)
        _known(o["copy_blocks_guarded"], _SYNC)
