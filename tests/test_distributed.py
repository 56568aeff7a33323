"""Two processes under `jax.distributed`, 4 CPU devices each, one global ("data", "model") mesh
whose "model" axis spans both: a family loaded from a sharded checkpoint (each process reads only
its own blocks), its forward in a jit over the global mesh equal to the one-process result, and a
KV cache sharded over kv heads across the processes.

The workers are module-level functions: each process imports this module and calls them with a
`jaxsync.testing.DistributedContext`. They start no jax backend at import time."""

import dataclasses

import numpy as np
import pytest

import jaxsync.testing
from jaxsync.harness.paths.qwen3_omni import reference as ref
from jaxsync.testing import assert_close


distributed = jaxsync.testing.distributed_fixture(scope="module", timeout=240)

# TINY's shapes with every sharded dimension divisible by the 4-way "model" axis, so q/k/v, fc1,
# out_proj and fc2 are split between the processes instead of replicated.
CFG = dataclasses.replace(ref.TINY, encoder_attention_heads=4, encoder_ffn_dim=64, d_model=48)
LENS, LENS2 = [150, 37], [120, 60]  # one frame bucket: the second call reuses the program


# ---------------------------------------------------------------- workers (run in each process)


def _inputs(features, lens, placement=None):
    import jaxsync
    from jaxsync.models import qwen3_omni as q3

    x = jaxsync.async_h2d(q3.pad_features(features, lens), placement=placement)
    return x, jaxsync.upload_packed(q3.plan(lens, CFG), placement=placement)


def _encode_worker(ctx, ckpt, calls):
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxsync.check import no_recompile, sync_guard
    from jaxsync.models import qwen3_omni as q3
    from jaxsync.weights._loader import last_load_stats

    tower = q3.load_model(ckpt, CFG, mesh=ctx.mesh)
    stats = last_load_stats()
    params = {}
    for path, var in nnx.to_flat_state(nnx.state(tower, nnx.Param)):
        leaf = var.get_value()
        params[".".join(map(str, path))] = (leaf.nbytes, leaf.sharding.is_fully_replicated)
    step, leaves = jaxsync.testing.server_step(tower, q3.forward)
    everywhere = NamedSharding(ctx.mesh, P())
    first = step(leaves, *_inputs(*calls[0], everywhere))  # compiles
    # Uploaded before the guard: jax checks host data placed over several processes for
    # equality across them, a read (see test_uploads_over_processes_do_not_sync).
    inputs = _inputs(*calls[1], everywhere)
    with sync_guard(), no_recompile():  # the repeated call: dispatch only
        again = step(leaves, *inputs)
    return dict(
        rows=[ctx.gather(first.rows), ctx.gather(again.rows)],
        finite=[ctx.gather(first.finite), ctx.gather(again.finite)],
        bytes_read=stats.bytes_read,
        selected_bytes=stats.selected_bytes,
        whole=stats.whole,
        params=params,
    )


# ---------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("torch")
    model = ref.build_hf_encoder(CFG)
    path = tmp_path_factory.mktemp("dist") / "model.safetensors"
    ckpt = ref.save_hf_encoder(model, path, "thinker.audio_tower.")
    calls = [(ref.random_features(CFG, lens, seed=i), lens) for i, lens in enumerate((LENS, LENS2))]
    return ckpt, calls


@pytest.fixture(scope="module")
def encoded(checkpoint, distributed):
    ckpt, calls = checkpoint
    return distributed(_encode_worker, ckpt, calls)


def test_the_forward_over_both_processes_equals_one_process(checkpoint, encoded):
    from jaxsync.models import qwen3_omni as q3

    ckpt, calls = checkpoint
    # this process alone, no mesh
    step, leaves = jaxsync.testing.server_step(q3.load_model(ckpt, CFG), q3.forward)
    for c, (features, lens) in enumerate(calls):
        want = step(leaves, *_inputs(features, lens))
        for p, got in enumerate(encoded):
            # Sharded matmuls sum in another order than one device's: equal to rounding.
            assert_close(got["rows"][c], want.rows, rtol=1e-5, err_msg=f"call {c}, process {p}")
            np.testing.assert_array_equal(got["finite"][c], np.asarray(want.finite))
        assert np.abs(np.asarray(want.rows)).max() > 0


def test_each_process_reads_only_its_half_of_the_sharded_weights(encoded):
    params = encoded[0]["params"]
    sharded = sum(n for n, replicated in params.values() if not replicated)
    replicated = sum(n for n, rep in params.values() if rep)
    # The test means something only if the split weights are a large part of the checkpoint.
    assert sharded > 0.5 * (sharded + replicated), params
    for p, got in enumerate(encoded):
        assert got["selected_bytes"] == sharded + replicated
        # "model" has 4 shards, 2 on each process's devices: half of every split weight, and
        # every byte of the replicated ones (a whole-tensor loader reads selected_bytes).
        assert got["bytes_read"] == replicated + sharded // 2, (p, got["bytes_read"])
        # conv_out's transform (a reshape) maps no index; it is replicated, so read whole anyway.
        assert got["whole"] == ["conv_out.kernel"]


# ---------------------------------------------------------------- the runner itself


def _fail_in_one(ctx):
    import time

    if ctx.process_id == 1:
        raise ValueError("process 1 gives up")
    time.sleep(600)  # process 0 alone would wait for ever: the runner must stop it


def _sleep(ctx):
    import time

    time.sleep(600)


def _children() -> list[int]:
    """Live processes this test process started that run the runner's children."""
    import os
    from pathlib import Path

    found = []
    for proc in Path("/proc").iterdir():
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (proc / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"jaxsync._distributed" in cmd:
            found.append(int(proc.name))
    return found


def test_a_failing_process_stops_the_others_and_reports_both():
    import time

    start = time.monotonic()
    with pytest.raises(jaxsync.testing.DistributedError) as e:
        jaxsync.testing.run_distributed(_fail_in_one, timeout=200)
    assert time.monotonic() - start < 90  # not the timeout: process 0 was killed at once
    message = str(e.value)
    assert "process 1 gives up" in message and "--- process 1: exit 1" in message
    assert "--- process 0: exit -9" in message  # killed by the runner
    assert not _children()


def test_a_run_past_its_timeout_is_stopped():
    import time

    start = time.monotonic()
    with pytest.raises(jaxsync.testing.DistributedError, match="timed out after 30 s"):
        jaxsync.testing.run_distributed(_sleep, timeout=30)
    assert time.monotonic() - start < 60
    assert not _children()


def test_an_unpicklable_function_is_refused_before_any_process_starts():
    with pytest.raises(jaxsync.testing.DistributedError, match="picklable"):
        jaxsync.testing.run_distributed(lambda ctx: 0)
