"""`jaxsync bench`: refusal on CPU, the markdown report, jit-argument floors, dispatch counts."""

import subprocess
import sys

import pytest

from jaxsync.harness import _cli, registry
from jaxsync.testing import torch_available


def test_bench_refuses_without_accelerator(capsys):
    import jax

    if jax.default_backend() != "cpu":
        pytest.skip("an accelerator is present")
    assert _cli.main(["bench"]) == 2
    reason = "numbers would mean nothing" if torch_available() else "torch is not importable"
    assert reason in capsys.readouterr().out


def test_bench_markdown_and_chart(tmp_path):
    from jaxsync.harness.bench._render import markdown, render

    m = {"device_ms": 1.0, "blocked_ms": 0.01, "first_call_ms": 100.0}
    result = {
        "environment": {
            "date": "d",
            "device": "X",
            "jax": "j",
            "torch": "t",
            "transformers": "h",
            "python": "3",
        },
        "copy_ceiling_gbps": {"jax": 4000.0, "torch": 4100.0},
        "rows": [
            {
                "family": "kv",
                "size": "tiny",
                "name": "copy 64",
                "bytes_moved": 10,
                "jaxsync": dict(
                    m,
                    gbps=3500.0,
                    jit_args=2,
                    floor_same_args_ms=0.04,
                    stream_ms=0.02,
                    floor_stream_ms=0.015,
                ),
                "vllm_post_pr": dict(m, device_ms=4.0, kernels=3),
            },
            {
                "family": "kv",
                "size": "tiny",
                "name": "swap 64 [pool]",
                "bytes_moved": 10,
                "jaxsync": dict(m, gbps=40.0),
                "torch_pinned_ceiling": dict(m, gbps=50.0),
            },
            {
                "family": "voxtral",
                "size": "tiny",
                "name": "encoder",
                "flops": 4e11,
                "jaxsync": dict(m, tflops=400.0),
            },
        ],
    }
    result["environment"]["matmul_tflops"] = 800.0
    result["dispatch_floor_ms"] = {"1": 0.031, "2": 0.04}  # as read back from bench.json
    text = markdown(result)
    want = (
        "| copy 64 | jaxsync | 1.000 | 0.010 | 0.020 | 100 |  | 3500 (88%) | 2 | 0.040 / 0.015 |  |"
    )
    assert want in text
    assert "| copy 64 | vllm_post_pr | 4.000 | 0.010 |  | 100 | 3 |  |  |  |  |" in text
    # a host<->device row is measured against its own pinned transfer, not the device copy
    assert "| swap 64 [pool] | jaxsync | 1.000 | 0.010 |  | 100 |  | 40 (80%) |  |  |  |" in text
    # a matmul-bound row: TFLOP/s against the matmul measured in the same run
    assert "| encoder | jaxsync | 1.000 | 0.010 |  | 100 |  |  |  |  | 400 (50%) |" in text
    assert "bf16 matmul ceiling (8192³): 800 TFLOP/s" in text
    assert "do-nothing jit host time: 1 args 0.031, 2 args 0.040 ms" in text
    render(result, tmp_path)
    assert (tmp_path / "bench.md").exists()


def test_bench_floor_with_the_main_programs_argument_count():
    # Each bench case reports its main program's jit argument count and a do-nothing jit of as
    # many arguments timed in the same run: counted by tracing the closure, or by `jit_args`.
    import jax
    import jax.numpy as jnp

    from jaxsync.harness.bench._programs import main_program_args
    from jaxsync.harness.bench._timing import _Side, same_args_floor

    xs = [jnp.ones(8) + i for i in range(5)]
    small = jax.jit(lambda a: a + 1)
    main = jax.jit(lambda *a: sum(jnp.sin(x) @ jnp.cos(x) for x in a))
    assert main_program_args(lambda: small(main(*xs))) == 5  # the bigger program, not the last
    assert main_program_args(lambda: small(xs[0])) == 1
    assert main_program_args(lambda: None) is None  # dispatches nothing

    side, floors = _Side("jax"), {1: 0.5}
    case = registry.BenchCase("five", lambda: main(*xs))
    got = same_args_floor(case, side, floors)
    assert got["jit_args"] == 5 and got["floor_same_args_ms"] == floors[5] > 0
    assert sorted(floors) == [1, 5]  # measured once, kept for the next case
    chain = {"x": xs[0]}

    def stateful():  # stores its output: must not be traced, its count comes from jit_args
        chain["x"] = small(chain["x"])
        return chain["x"]

    case = registry.BenchCase("chain", stateful, jit_args=lambda: 1)
    assert same_args_floor(case, side, floors) == {"jit_args": 1, "floor_same_args_ms": 0.5}
    assert isinstance(chain["x"], jax.Array)
    broken = registry.BenchCase("broken", lambda: 1 / 0)
    assert same_args_floor(broken, side, floors) == {"jit_args": None, "floor_same_args_ms": None}
    # the stream floor: per call of a burst of do-nothing calls, measured once per count
    stream = {}
    got = same_args_floor(case, side, floors, stream)
    assert got["floor_stream_ms"] == stream[1] > 0 and sorted(stream) == [1]
    assert same_args_floor(broken, side, floors, stream)["floor_stream_ms"] is None


def test_jax_dispatch_count_from_profiler_trace():
    import jax
    import jax.numpy as jnp

    from jaxsync.harness.bench._programs import jax_executions_per_call

    f = jax.jit(lambda v: v * 2)
    g = jax.jit(lambda v: v + 1)
    x = jnp.ones(8)
    assert jax_executions_per_call(lambda: f(x)) == 1
    assert jax_executions_per_call(lambda: g(f(x))) == 2


def test_execution_count_takes_one_nesting_level():
    from jaxsync.harness.bench._programs import count_executions

    def ev(name):
        return {"ph": "X", "name": name}

    nested = ["PjRtCApiLoadedExecutable::Execute", "PjRtStreamExecutorLoadedExecutable::Execute",
              "PjRtStreamExecutorLoadedExecutable::ExecuteHelper"]  # fmt: skip
    assert count_executions([ev(n) for n in nested * 2]) == 2  # two programs, three events each
    inner = "CommonPjRtLoadedExecutable::ExecuteHelperOnSingleDevice"  # XLA:CPU's one level
    assert count_executions([ev(inner), ev(inner), ev("ThunkExecutor::Execute")]) == 2
    assert count_executions([ev("something else"), {"ph": "i", "name": nested[0]}]) is None


def test_bench_modules_have_no_import_cycle():
    code = (
        "import sys, jaxsync.harness.bench._render as r; "
        "assert 'jaxsync.harness.bench._cli' not in sys.modules; "
        "import jaxsync.harness.bench._cli as c; assert c.REFERENCE_LABELS is r.REFERENCE_LABELS"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
