"""A repeated `copy_blocks` (its kept call: checks, program and ids decided by the first call)
refuses a cache donated elsewhere with the entry's own ValueError before anything is launched:
no XLA INVALID_ARGUMENT, no error line in the log, nothing uploaded or compiled, the live
cache untouched."""

import logging

import jax
import jax.numpy as jnp
import pytest

from jaxsync._calls import CallCache
from jaxsync.kv import KVLayout, _copy, copy_blocks
from jaxsync.testing import assert_refused


LAYERS = ("l0", "l1")
LAYOUT = KVLayout(kind="packed", num_blocks=9, block_size=4, num_kv_heads=2, head_dim=4,
                  dtype=jnp.float32)  # fmt: skip
IDS = ([0, 2], [1, 3])


def cache(seed, memory="device"):
    out = LAYOUT.random(LAYERS, jax.random.key(seed))
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(memory)), out)


@pytest.fixture
def kept_runs(monkeypatch):
    """The (program, ids) of every call that took the kept path."""
    runs = []
    run_kept = _copy._run_kept

    def watched(program, ids, src, dst, **options):
        runs.append((program, ids))
        return run_kept(program, ids, src, dst, **options)

    monkeypatch.setattr(_copy, "_run_kept", watched)
    # kept calls bind `_run_kept` when kept: none kept before the watch
    monkeypatch.setattr(_copy, "_KEPT", CallCache(256, checks=_copy._KEPT_CHECKS))
    return runs


def assert_quiet_refusal(capfd, caplog, kept_runs, *args, keep):
    """Refused on the kept path, with nothing in the log."""
    capfd.readouterr()
    before = len(kept_runs)
    with caplog.at_level(logging.DEBUG):
        assert_refused(ValueError, "deleted", copy_blocks, *args, *IDS, keep=keep)
    assert len(kept_runs) == before + 1  # the kept path was taken
    err = capfd.readouterr().err
    assert "INVALID_ARGUMENT" not in err and "Invalid buffer" not in err, err
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records


@pytest.mark.parametrize(
    "memories", [("device", "device"), ("device", "pinned_host"), ("pinned_host", "device")]
)
def test_a_kept_copy_refuses_a_donated_destination_before_any_launch(
    memories, kept_runs, capfd, caplog
):
    src, stale = cache(0, memories[0]), cache(1, memories[1])
    out = copy_blocks(src, stale, *IDS)  # keeps the call; consumes `stale`
    for _ in range(2):  # every call, not only the first
        assert_quiet_refusal(capfd, caplog, kept_runs, src, stale, keep=(src, out))
    before = len(kept_runs)
    copy_blocks(src, out, *IDS)  # control: the live cache copies on the kept path
    assert len(kept_runs) == before + 1


def test_a_kept_copy_refuses_a_donated_source_and_a_stale_cache_within(kept_runs, capfd, caplog):
    src, dst = cache(0), cache(1)
    dst = copy_blocks(src, dst, *IDS)
    copy_blocks(cache(2), src, [0], [0])  # src donated by a copy elsewhere
    assert_quiet_refusal(capfd, caplog, kept_runs, src, dst, keep=dst)
    within = copy_blocks(dst, dst, *IDS)  # a copy within one cache, kept too
    assert_quiet_refusal(capfd, caplog, kept_runs, dst, dst, keep=within)


def test_control_the_launch_itself_fails_in_xla(kept_runs, capfd):
    """What the check prevents: launched, the kept program fails inside JAX with JAX's own
    error, never the entry's message, and some jax versions also log XLA's INVALID_ARGUMENT."""
    src, stale = cache(0), cache(1)
    out = copy_blocks(src, stale, *IDS)
    copy_blocks(src, out, *IDS)
    program, ids = kept_runs[-1]
    capfd.readouterr()
    with pytest.raises(Exception, match="(?i)delete|invalid") as raised:
        _copy._dispatch(program, src, stale, ids, compiled=True)
    assert str(raised.value) != _copy._DELETED, raised.value
    err = capfd.readouterr().err
    assert not err or "INVALID_ARGUMENT" in err or "Invalid buffer" in err, err
