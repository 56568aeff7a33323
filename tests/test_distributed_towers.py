"""gemma3n's, voxtral's and chameleon's towers loaded in 2 processes
(`jaxsync.testing.run_distributed`, the global ("data", "model") mesh's "model" axis spanning
both) under their families' `PARTITION_RULES`, from the tiny checkpoints and inputs of
tests/models/test_tensor_parallel.py: each process reads half of every split weight, by blocks
(gemma3n's `linear_start` through its GLU-pair reordering, by rows), the forward in a server jit
over both processes equals one process's at fp32, and its compiled program holds the Megatron
pattern's collectives only: no all-gather, the all-reduces of the family's `_weights.py` table.
Negative control per family: a rule that splits the weight producing the rows by its output
columns leaves the rows split over "model", and the program gathers them.

glm4v and qwen3_omni have their own 2-process tests (tests/test_distributed_glm4v.py,
tests/test_distributed.py). One family's run: `pytest -k gemma3n`."""

import importlib
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

import jaxsync.testing
from jaxsync.harness.bench._mesh import collectives
from jaxsync.testing import assert_close


distributed = jaxsync.testing.distributed_fixture(scope="module", timeout=240)

# A rule put first that splits the weight producing the rows by output columns (negative control).
SPLIT_ROWS = {
    "gemma3n": (r"embedding_projection\.kernel$", (None, "model")),
    "voxtral": (r"multi_modal_projector\.linear_2\.kernel", (None, "model")),
    "chameleon": (r"^embed_tokens\.embedding$", (None, "model")),
}


def _tensor_parallel():
    """tests/models/test_tensor_parallel.py, for its tiny cases (checkpoints, inputs, counts)."""
    name = "tensor_parallel_cases"
    if name not in sys.modules:  # registered first: its dataclass looks its module up
        path = Path(__file__).resolve().parent / "models" / "test_tensor_parallel.py"
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def _uploads(host, plan, placement=None):
    import jaxsync

    return jaxsync.async_h2d(host, placement=placement), jaxsync.upload_packed(
        plan, placement=placement
    )


def _worker(ctx, load, forward, calls, control_rules):
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxsync.check import no_recompile, sync_guard
    from jaxsync.weights._loader import last_load_stats

    tower = load(mesh=ctx.mesh)
    stats = last_load_stats()
    params = {}
    for path, var in nnx.to_flat_state(nnx.state(tower, nnx.Param)):
        leaf = var.get_value()
        params[".".join(map(str, path))] = (leaf.nbytes, leaf.sharding.is_fully_replicated)
    step, leaves = jaxsync.testing.server_step(tower, forward)
    everywhere = NamedSharding(ctx.mesh, P())
    inputs = _uploads(*calls[0], everywhere)
    hlo = step.lower(leaves, *inputs).compile().as_text()
    first = step(leaves, *inputs)
    inputs = _uploads(*calls[1], everywhere)  # uploaded before the guard, as in
    with sync_guard(), no_recompile():  # tests/test_distributed.py
        again = step(leaves, *inputs)
    bad_step, bad_leaves = jaxsync.testing.server_step(
        load(mesh=ctx.mesh, partition_rules=control_rules), forward
    )
    return dict(
        rows=[ctx.gather(first.rows), ctx.gather(again.rows)],
        finite=[ctx.gather(first.finite), ctx.gather(again.finite)],
        replicated=first.rows.sharding.is_fully_replicated,
        collectives=collectives(hlo),
        control=collectives(bad_step.lower(bad_leaves, *inputs).compile().as_text()),
        bad_rows=ctx.gather(bad_step(bad_leaves, *inputs).rows),
        bytes_read=stats.bytes_read,
        selected_bytes=stats.selected_bytes,
        whole=stats.whole,
        sliced=stats.sliced,
        params=params,
    )


@pytest.fixture(scope="module", params=sorted(SPLIT_ROWS))
def run(request, tmp_path_factory, distributed):
    pytest.importorskip("torch")  # here, not at import: each process imports this module
    pytest.importorskip("transformers")
    family = request.param
    case = _tensor_parallel().FAMILIES[family](tmp_path_factory.mktemp(family))
    host, plan = case.inputs(case.load())
    calls = [(host, plan), (host * 0.5, plan)]  # the second call: other values, one program
    rules = importlib.import_module(f"jaxsync.models.{family}").PARTITION_RULES
    results = distributed(_worker, case.load, case.forward, calls, (SPLIT_ROWS[family], *rules))
    return family, case, calls, results


def test_the_forward_over_both_processes_equals_one_process(run):
    _, case, calls, results = run
    step, leaves = jaxsync.testing.server_step(case.load(), case.forward)  # one process, no mesh
    want = [step(leaves, *_uploads(*call)) for call in calls]
    for c, w in enumerate(want):
        assert np.abs(np.asarray(w.rows)).max() > 0
        for p, got in enumerate(results):
            # sharded matmuls sum in another order than one device's: equal to rounding
            assert_close(got["rows"][c], w.rows, rtol=1e-5, err_msg=f"call {c}, process {p}")
            np.testing.assert_array_equal(got["finite"][c], np.asarray(w.finite))
    for got in results:  # the control's placement is wrong, not its math
        assert_close(got["bad_rows"], want[1].rows, rtol=1e-5)


def test_the_program_gathers_no_activation_and_reduces_once_per_sub_block(run):
    _, case, _, results = run
    for p, got in enumerate(results):
        found = got["collectives"]
        assert found["all-gather"] == 0, (p, found)
        assert found["reduce-scatter"] == found["all-to-all"] == found["collective-permute"] == 0
        assert found["all-reduce"] == case.all_reduces, (p, found)  # every reduction is there
        assert got["replicated"]  # the server's rows, replicated without a gather
    # negative control: rows left split over "model" are gathered for the server
    assert all(got["control"]["all-gather"] >= 1 for got in results), [
        got["control"] for got in results
    ]


def test_each_process_reads_half_of_every_split_weight_by_blocks(run):
    results = run[3]
    params = results[0]["params"]
    split = {p for p, (_, rep) in params.items() if not rep}
    assert split, sorted(params)
    halved = sum(params[p][0] for p in split)
    replicated = sum(n for n, rep in params.values() if rep)
    for p, got in enumerate(results):
        assert got["selected_bytes"] == halved + replicated
        # "model" has 4 shards, 2 on each process's devices: half of every split weight, every
        # byte of the replicated ones; every split weight is built from this process's blocks
        assert split <= set(got["sliced"]), (p, got["sliced"])
        assert all(params[w][1] for w in got["whole"]), (p, got["whole"])
        assert got["bytes_read"] == replicated + halved // 2, (p, got["bytes_read"])
        assert got["bytes_read"] < got["selected_bytes"]


def test_gemma3n_reads_its_glu_pairs_by_rows(run):
    family, _, _, results = run
    if family != "gemma3n":
        pytest.skip("gemma3n's GLU-pair reordering")
    params = results[0]["params"]
    glu = {p for p in params if p.endswith("lconv1d.linear_start.kernel")}
    assert glu and not any(params[p][1] for p in glu)  # split, so read by blocks
    halved = sum(params[p][0] for p, (_, rep) in params.items() if not rep)
    assert halved > 0.5 * sum(n for n, _ in params.values())  # the split weights dominate
    for got in results:
        assert glu <= set(got["sliced"])
