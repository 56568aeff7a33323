"""A paged KV cache sharded over kv heads across 2 processes (`jaxsync.testing.run_distributed`,
4 CPU devices each, the "model" axis spanning both: process p holds kv heads 4p .. 4p + 3):
block copies and slot writes / reads keep each process on its own heads and equal the
one-process result; what cannot run across processes yet is a strict xfail naming why.

One run of the worker serves every test: each step's outcome ("ok" or the error) comes back."""

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


def _kv_worker(ctx, root):
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
    mine = str(ctx.workdir / f"process{ctx.process_id}")
    _attempt(out, "save_kv", lambda: kv.save_kv(mine, src, TOKENS, BLOCKS))
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
def outcomes(distributed, saved):
    return distributed(_kv_worker, saved)


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


_SPANS = "spans non-addressable"


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="save_kv fetches the cache with one jax.device_get, which jax refuses for an array "
    "spanning other processes' devices; it must write each process's addressable shards (its kv "
    "heads, from x.addressable_shards) and load_kv read back the same per-process files",
)
def test_save_kv_writes_each_process_shard(outcomes):
    for o in outcomes:
        _known(o["save_kv"], _SPANS)


_SYNC = "host sync inside a jaxsync sync_guard"


def test_uploads_over_processes_do_not_sync(outcomes):
    for o in outcomes:
        _known(o["upload_guarded"], _SYNC)
        _known(o["copy_blocks_guarded"], _SYNC)
