"""GLM-4.1V's vision tower loaded in 2 processes (`jaxsync.testing.run_distributed`, the global
("data", "model") mesh's "model" axis spanning both): its fused qkv goes through a head-major
reordering (reshape, transpose, reshape), a gather of rows, so each process reads just the q, k
and v rows of its own heads; with the linear weights split over "model", every split weight is
read by halves. The forward in a jit over both processes equals one process's."""

import numpy as np
import pytest

import jaxsync.testing
from jaxsync.harness.paths.glm4v import reference as ref
from jaxsync.models import glm4v
from jaxsync.testing import assert_close, server_step


distributed = jaxsync.testing.distributed_fixture(scope="module", timeout=240)

# 4 heads: a whole head of q, k and v per "model" shard; MLP 40, divisible by 4: split too.
TINY = {**ref.TINY, "num_heads": 4, "intermediate_size": 40}
CFG = glm4v.Glm4vVisionConfig(**TINY)
GRID = [[1, 6, 6], [2, 4, 4]]  # an image and a two-frame video


def _inputs(pixels, placement=None):
    import jaxsync

    plan = glm4v.plan(GRID, CFG)
    host = np.zeros((plan.padded_patches, CFG.patch_dim), np.float32)
    host[: pixels.shape[0]] = pixels
    return jaxsync.async_h2d(host, placement=placement), jaxsync.upload_packed(
        plan, placement=placement
    )


def _worker(ctx, ckpt, pixels):
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxsync.check import no_recompile, sync_guard
    from jaxsync.weights._loader import last_load_stats

    tower = glm4v.load_model(ckpt, CFG, mesh=ctx.mesh)
    stats = last_load_stats()
    params = {}
    for path, var in nnx.to_flat_state(nnx.state(tower, nnx.Param)):
        leaf = var.get_value()
        params[".".join(map(str, path))] = (leaf.nbytes, leaf.sharding.is_fully_replicated)
    step, leaves = server_step(tower, glm4v.forward)
    everywhere = NamedSharding(ctx.mesh, P())
    first = step(leaves, *_inputs(pixels, everywhere))
    inputs = _inputs(pixels[::-1].copy(), everywhere)  # uploaded before the guard, as in
    with sync_guard(), no_recompile():  # tests/test_distributed.py
        again = step(leaves, *inputs)
    return dict(
        rows=[ctx.gather(first.rows), ctx.gather(again.rows)],
        bytes_read=stats.bytes_read,
        selected_bytes=stats.selected_bytes,
        whole=stats.whole,
        sliced=stats.sliced,
        params=params,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory, distributed):
    pytest.importorskip("torch")
    model = ref.build_reference(ref.hf_config(**TINY))
    ckpt = ref.save_checkpoint(model, tmp_path_factory.mktemp("glm4v") / "model.safetensors")
    pixels = ref.pixels(GRID, CFG, seed=1)
    return ckpt, pixels, distributed(_worker, ckpt, pixels)


def test_the_forward_over_both_processes_equals_one_process(run):
    ckpt, pixels, results = run
    step, leaves = server_step(glm4v.load_model(ckpt, CFG), glm4v.forward)
    for c, px in enumerate((pixels, pixels[::-1].copy())):
        want = np.asarray(step(leaves, *_inputs(px)).rows)
        assert np.abs(want).max() > 0
        for p, got in enumerate(results):
            assert_close(got["rows"][c], want, rtol=1e-5, err_msg=f"call {c}, process {p}")


def test_each_process_reads_half_of_every_split_weight_qkv_included(run):
    _, _, results = run
    params = results[0]["params"]
    qkv = {"blocks.layer.attn.qkv.kernel", "blocks.layer.attn.qkv.bias"}
    split = {p for p, (_, rep) in params.items() if not rep}
    assert split > qkv  # qkv and more are split
    halved = sum(params[p][0] for p in split)
    replicated = sum(n for n, rep in params.values() if rep)
    assert sum(params[p][0] for p in qkv) > 0.1 * (halved + replicated)  # the count tells qkv
    for got in results:
        # the head-major qkv by the rows its heads take; only replicated weights whose
        # transforms reshape are read whole (every process holds them whole either way)
        assert qkv <= set(got["sliced"])
        assert all(params[p][1] for p in got["whole"])
        assert got["bytes_read"] == replicated + halved // 2
        assert got["bytes_read"] < got["selected_bytes"]
