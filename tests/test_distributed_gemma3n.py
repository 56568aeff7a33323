"""Gemma 3n's audio tower loaded in 2 processes (`jaxsync.testing.run_distributed`, the global
("data", "model") mesh's "model" axis spanning both) under the family's `PARTITION_RULES`: each
process reads half of every split weight (`linear_start` through its GLU-pair reordering, read
by rows), the forward in a server jit over both processes equals one process's at fp32, and its
compiled program holds the Megatron pattern's collectives only: no all-gather, the all-reduces
of `models/gemma3n/_weights.py`'s table. Negative control: the embedder's projection split by
columns leaves the rows split over "model", and the program gathers them."""

import re

import numpy as np
import pytest

import jaxsync.testing
from jaxsync.models import gemma3n
from jaxsync.testing import assert_close


distributed = jaxsync.testing.distributed_fixture(scope="module", timeout=240)

# The tiny config with 4 heads of 6, conformer width 24 and text width 20: every split dimension
# divides by the 4-way "model" axis (as in tests/models/test_tensor_parallel.py).
VARIANT = {"audio": {"hidden_size": 24, "conf_num_attention_heads": 4}, "text": {"hidden_size": 20}}
CALLS = [([57, 40, 13], 57), ([23, 9, 1], 57)]  # (lengths, frames): one bucket, one program
ALL_REDUCES = 5  # per conformer layer (one scan body): two FFWs, attention.post, linear_end,
# conv_norm's sum of squares; none outside the scan
SPLIT_EMBEDDER = (r"embedding_projection\.kernel$", (None, "model"))
_COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "reduce-scatter", "all-to-all")


def collectives(hlo: str) -> dict[str, int]:
    """How many ops of each collective kind the compiled HLO text holds (async starts count)."""
    return {op: len(re.findall(rf"= [^=\n]*? {op}(?:-start)?\(", hlo)) for op in _COLLECTIVES}


def _step(tower):
    """The server form: forward over the state's flat leaves in one jit."""
    return jaxsync.testing.server_step(tower, gemma3n.forward)


def _inputs(cfg, feats, mask, placement=None):
    import jaxsync

    plan = gemma3n.plan(mask, cfg)
    host = np.zeros((plan.batch, plan.frame_bucket, feats.shape[-1]), np.float32)
    host[: feats.shape[0], : feats.shape[1]] = feats
    return jaxsync.async_h2d(host, placement=placement), jaxsync.upload_packed(
        plan, placement=placement
    )


def _worker(ctx, ckpt, cfg, calls):
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxsync.check import no_recompile, sync_guard
    from jaxsync.weights._loader import last_load_stats

    tower = gemma3n.load_model(ckpt, cfg, mesh=ctx.mesh)
    stats = last_load_stats()
    params = {}
    for path, var in nnx.to_flat_state(nnx.state(tower, nnx.Param)):
        leaf = var.get_value()
        params[".".join(map(str, path))] = (leaf.nbytes, leaf.sharding.is_fully_replicated)
    step, leaves = _step(tower)
    everywhere = NamedSharding(ctx.mesh, P())
    inputs = _inputs(cfg, *calls[0], everywhere)
    hlo = step.lower(leaves, *inputs).compile().as_text()
    first = step(leaves, *inputs)
    inputs = _inputs(cfg, *calls[1], everywhere)  # uploaded before the guard, as in
    with sync_guard(), no_recompile():  # tests/test_distributed.py
        again = step(leaves, *inputs)
    rules = (*gemma3n.PARTITION_RULES, SPLIT_EMBEDDER)
    bad = gemma3n.load_model(ckpt, cfg, mesh=ctx.mesh, partition_rules=rules)
    bad_step, bad_leaves = _step(bad)
    bad_hlo = bad_step.lower(bad_leaves, *inputs).compile().as_text()
    return dict(
        rows=[ctx.gather(first.rows), ctx.gather(again.rows)],
        finite=[ctx.gather(first.finite), ctx.gather(again.finite)],
        replicated=first.rows.sharding.is_fully_replicated,
        collectives=collectives(hlo),
        control=collectives(bad_hlo),
        bad_rows=ctx.gather(bad_step(bad_leaves, *inputs).rows),
        bytes_read=stats.bytes_read,
        selected_bytes=stats.selected_bytes,
        whole=stats.whole,
        sliced=stats.sliced,
        params=params,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory, distributed):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from jaxsync.harness.paths.gemma3n import reference as ref

    built = ref.build_reference(tmp_path_factory.mktemp("gemma3n"), variant=VARIANT)
    calls = [
        ref.mel_batch(lengths, frames, built.cfg.input_feat_size, seed=i)
        for i, (lengths, frames) in enumerate(CALLS)
    ]
    return built, calls, distributed(_worker, built.checkpoint, built.cfg, calls)


def test_the_forward_over_both_processes_equals_one_process(run):
    built, calls, results = run
    step, leaves = _step(gemma3n.load_model(built.checkpoint, built.cfg))  # one process, no mesh
    want = [step(leaves, *_inputs(built.cfg, *call)) for call in calls]
    for c, w in enumerate(want):
        assert np.abs(np.asarray(w.rows)).max() > 0
        for p, got in enumerate(results):
            # sharded matmuls sum in another order than one device's: equal to rounding
            assert_close(got["rows"][c], w.rows, rtol=1e-5, err_msg=f"call {c}, process {p}")
            np.testing.assert_array_equal(got["finite"][c], np.asarray(w.finite))
    for got in results:  # the control's placement is wrong, not its math
        assert_close(got["bad_rows"], want[1].rows, rtol=1e-5)


def test_the_program_gathers_no_activation_and_reduces_once_per_sub_block(run):
    for p, got in enumerate(results := run[2]):
        found = got["collectives"]
        assert found["all-gather"] == 0, (p, found)
        assert found["reduce-scatter"] == found["all-to-all"] == found["collective-permute"] == 0
        assert found["all-reduce"] == ALL_REDUCES, (p, found)  # sharded: every reduction is there
        assert got["replicated"]  # the server's rows, replicated without a gather
    # negative control: rows left split over "model" by the embedder are gathered for the server
    assert all(got["control"]["all-gather"] >= 1 for got in results), [
        got["control"] for got in results
    ]


def test_each_process_reads_half_of_every_split_weight_glu_pairs_included(run):
    results = run[2]
    params = results[0]["params"]
    glu = {p for p in params if p.endswith("lconv1d.linear_start.kernel")}
    split = {p for p, (_, rep) in params.items() if not rep}
    assert glu and split > glu, sorted(split)  # the GLU pairs and more are split
    halved = sum(params[p][0] for p in split)
    replicated = sum(n for n, rep in params.values() if rep)
    assert halved > 0.5 * (halved + replicated), params  # the count tells the split weights
    for p, got in enumerate(results):
        assert got["selected_bytes"] == halved + replicated
        # "model" has 4 shards, 2 on each process's devices: half of every split weight, every
        # byte of the replicated ones; the GLU pairs by the rows their channels take
        assert glu <= set(got["sliced"]), (p, got["sliced"])
        assert all(params[w][1] for w in got["whole"]), (p, got["whole"])
        assert got["bytes_read"] == replicated + halved // 2, (p, got["bytes_read"])
        assert got["bytes_read"] < got["selected_bytes"]
