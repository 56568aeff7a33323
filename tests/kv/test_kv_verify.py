"""The kv paths are registered for `jaxsync verify` / `jaxsync bench` and their parity holds."""

import jax
import numpy as np
import pytest

import jaxsync.harness.paths.kv  # noqa: F401  (registers)
from jaxsync.harness import registry
from jaxsync.testing import requires_torch


KV_PATHS = ["kv.copy_blocks", "kv.extract_kv", "kv.inject_kv", "kv.inject_kv_fp8", "kv.load_kv",
            "kv.swap_in", "kv.swap_in_pool", "kv.swap_out", "kv.swap_out_pool"]  # fmt: skip


def test_registered():
    assert sorted(n for n in registry._paths if n.startswith("kv.")) == KV_PATHS
    assert "kv" in registry._benches


@pytest.mark.parametrize("name", KV_PATHS)
@requires_torch  # its reference is torch
def test_parity_and_inputs(name):
    case = registry._paths[name].build(None)
    assert len(case.inputs) >= 2
    result = case.parity()
    assert result.ok, f"{name}: {result}"
    jax.block_until_ready(case.fn(*case.inputs[1]))


@requires_torch  # its reference is torch
def test_tiny_bench_cases_run():
    cases = registry._benches["kv"]("cpu", "tiny")
    assert {c.name.split()[1] for c in cases} == {"d2d", "d2h", "h2d"}
    assert sum(c.name.endswith("[pool]") for c in cases) == 4  # d2h and h2d at both counts
    for case in cases[:3]:
        jax.block_until_ready(case.jax_fn())
        for fn in case.torch_fns.values():
            fn()
        assert case.bytes_moved > 0


@requires_torch  # its reference is torch
def test_tiny_bench_layout_cases_run(monkeypatch):
    # d2d copies of the same blocks at each layer count, stacked next to per-layer, vLLM's
    # per-layer copy as baseline; the released size keeps its layer counts and block count
    from jaxsync.harness.bench._programs import jax_executions_per_call
    from jaxsync.harness.bench._timing import _Side, measure, same_args_floor
    from jaxsync.harness.paths.kv.bench import _FRESH, SIZES
    from jaxsync.kv import StackedCache

    assert SIZES["released"]["stacked"] == {"layers": (4, 32), "count": 512, "blocks": 1024}
    assert SIZES["released"]["layout"].num_blocks == 4096
    cases = [c for c in registry._benches["kv"]("cpu", "tiny") if " layers " in c.name]
    spec = SIZES["tiny"]["stacked"]
    blocks = spec.get("blocks", SIZES["tiny"]["layout"].num_blocks)
    want = {
        f"kv.copy_blocks d2d {spec['count']} of {blocks} blocks {n} layers {tag} (tiny)"
        for n in spec["layers"]
        for tag in ("per-layer", "stacked")
    }
    numpy_ids = {f"{name} [numpy ids]" for name in want if "stacked" in name}
    fresh_ids = {f"{name} [new numpy ids each call]" for name in want if "stacked" in name}
    assert {c.name for c in cases} == want | numpy_ids | fresh_ids
    by_name = {c.name: c for c in cases}
    for name in numpy_ids:  # the same copies as its list-ids row, on int32 id arrays
        lists, arrays = by_name[name.removesuffix(" [numpy ids]")], by_name[name]
        copied = np.asarray(lists.jax_fn().kv)  # both rows copy into one donated chain
        assert np.array_equal(np.asarray(arrays.jax_fn().kv), copied)
    from jaxsync.kv import _copy

    for name in fresh_ids:  # ids no call has seen: every call misses the content caches
        find, seen = _copy._KEPT.find_tree, []

        def counted(*args, find=find, seen=seen):
            found = find(*args)
            seen.append(found[0])
            return found

        monkeypatch.setattr(_copy._KEPT, "find_tree", counted)
        calls = _FRESH + 3  # past one whole rotation: a repeated set would hit by now
        for _ in range(calls):
            out = by_name[name].jax_fn()
        jax.block_until_ready(out)
        monkeypatch.undo()
        assert seen == [None] * calls
    cases = [c for c in cases if c.name in want]
    side = _Side("jax")
    for case in cases:  # as `jaxsync bench` measures a row, its jit-argument count included
        assert measure(case.jax_fn, side, repeat=2)["device_ms"] >= 0
        layers = int(case.name.split()[6])  # packed caches: source, destination and the ids
        want = 3 if "stacked" in case.name else 2 * layers + 1
        assert same_args_floor(case, side, {})["jit_args"] == want
        assert jax_executions_per_call(case.jax_fn) == 1  # every layer in one program
        out = jax.block_until_ready(case.jax_fn())  # the donated destination was replaced
        assert isinstance(out, StackedCache) == case.name.endswith("stacked (tiny)")
        assert set(case.torch_fns) == {"vllm_post_pr", "vllm_pre_pr"}
        for fn in case.torch_fns.values():
            fn()
    per_block = SIZES["tiny"]["layout"].block_nbytes
    assert [c.bytes_moved for c in cases] == [
        2 * spec["count"] * per_block * n for n in spec["layers"] for _ in range(2)
    ]


@requires_torch  # its reference is torch
def test_bench_timing_handles_a_donating_chain():
    # Each KV copy donates the previous output; the timing harness must wait only on the live one
    # (waiting on every output would fail on the donated ones).
    from jaxsync.harness.bench._timing import _Side, measure

    case = registry._benches["kv"]("cpu", "tiny")[0]
    row = measure(case.jax_fn, _Side("jax"), repeat=2)
    assert row["device_ms"] >= 0 and row["blocked_ms"] > 0
    assert row["stream_ms"] > 0  # per call of the back-to-back calls, the first (cold) dropped


def test_the_product_imports_neither_torch_nor_the_harness():
    import pathlib
    import re

    import jaxsync.kv

    for path in pathlib.Path(jaxsync.kv.__file__).parent.glob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*(import|from)\s+(torch|jaxsync\.paths)\b", text, re.M), path


@requires_torch  # its reference is torch
def test_bench_counts_a_donating_chain_without_tracing_it():
    # A case that stores its output must count its arguments through `jit_args`: tracing the
    # closure itself would store a tracer as the next call's cache (control: without it).
    from jaxsync.harness.bench._timing import _Side, same_args_floor

    case = next(c for c in registry._benches["kv"]("cpu", "tiny") if " layers " in c.name)
    assert case.jit_args is not None
    side = _Side("jax")
    same_args_floor(case, side, {})
    jax.block_until_ready(case.jax_fn())
    bare = registry.BenchCase(case.name, case.jax_fn)
    same_args_floor(bare, side, {})
    with pytest.raises(jax.errors.UnexpectedTracerError):
        case.jax_fn()
