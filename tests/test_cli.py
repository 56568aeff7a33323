"""`jaxsync verify`, the registry, doctests of the public core, and the pytest plugin."""

import doctest
import importlib
import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxsync import _cli, registry
from jaxsync.testing import torch_available


def test_verify_demo_path_json(capsys):
    rc = _cli.main(["verify", "--paths", "core.table_gather", "--json"])
    out = json.loads(capsys.readouterr().out)
    (row,) = out["paths"]
    assert rc == 0 and row["ok"], row
    assert row["parity"]["status"] == ("pass" if torch_available() else "skipped")
    assert row["host_ms"] > 0  # median host time of the steady guarded calls
    assert {c["check"]: c["ok"] for c in row["checks"]} == {
        "jaxpr: no host callback": True,
        "hlo: no host transfer": True,
        "runtime: sync_guard": True,
        "no recompile": True,
        "dispatch probe": True,
    }


def test_verify_fails_on_a_bad_path(capsys):
    import jax

    @jax.jit
    def f(x):
        return x + 1

    def reads(x):
        return f(x) * float(x[0])

    import jax.numpy as jnp

    @registry.register_path("test.reads_back", "negative control")
    def _build(checkpoint):
        return registry.PathCase(reads, [(jnp.ones(3),), (jnp.zeros(3),)])

    try:
        rc = _cli.main(["verify", "--paths", "test.reads_back", "--no-probe"])
        out = capsys.readouterr().out
        assert rc == 1 and "FAILED" in out and "device->host read" in out
    finally:
        registry._paths.pop("test.reads_back")


def test_unknown_path_and_usage(capsys):
    with pytest.raises(ValueError, match="unknown path"):
        registry.paths(["nope"])
    assert _cli.main([]) == 2


def test_every_registered_path_builds_and_lists():
    specs = registry.paths()
    assert any(s.name == "core.table_gather" for s in specs)
    assert len({s.name for s in specs}) == len(specs)


PUBLIC_MODULES = [
    "jaxsync._device_cache",
    "jaxsync._transfer",
    "jaxsync._jit",
    "jaxsync.check._static",
    "jaxsync.check._guard",
    "jaxsync.check._recompile",
    "jaxsync.check._probe",
    "jaxsync.check._report",
    "jaxsync.testing",
    "jaxsync.hfconfig",
    "jaxsync._placement",
    "jaxsync._packing",
    "jaxsync.kv._slots",
    "jaxsync.kv._storage",
]


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE | doctest.IGNORE_EXCEPTION_DETAIL
    result = doctest.testmod(module, optionflags=flags)
    assert result.failed == 0


PLUGIN_TEST = """
import jax, jax.numpy as jnp, pytest

f = jax.jit(lambda x: x * 2)
x = jnp.ones(4)
f(x)

@pytest.mark.sync_free
def test_clean():
    f(x)

@pytest.mark.sync_free
def test_reads():
    int(f(x)[0])

@pytest.mark.sync_free
def test_recompiles():
    f(jnp.ones(5))

def test_fixture(sync_free):
    with sync_free():
        f(x)

@pytest.mark.gpu
def test_needs_gpu():  # skipped on a CPU-only machine, run (and passing) on a GPU/TPU
    assert jax.default_backend() != "cpu"
"""


def test_pytest_plugin(tmp_path):
    (tmp_path / "test_user.py").write_text(PLUGIN_TEST)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    out = proc.stdout
    want = (
        "2 failed, 2 passed, 1 skipped" if jax.default_backend() == "cpu" else "2 failed, 3 passed"
    )
    assert want in out, out
    assert "test_reads" in out and "test_recompiles" in out


def test_precompile_then_mixed_stream_does_not_recompile(capsys):
    import jaxsync
    from jaxsync.check import no_recompile
    from jaxsync.paths.demo import table_gather

    done = jaxsync.precompile(["core.table_gather"], buckets=[8, 16, 32, 64])
    assert [c.bucket for c in done] == [8, 16, 32, 64]
    assert "precompile [" in capsys.readouterr().err
    rng = np.random.default_rng(0)
    with no_recompile():
        for n in rng.integers(1, 64, size=40):
            table_gather(rng.integers(0, 97, size=int(n)).tolist())


def test_without_precompile_a_new_bucket_recompiles():
    from jaxsync.check import RecompileError, no_recompile
    from jaxsync.paths.demo import table_gather

    with pytest.raises(RecompileError), no_recompile():
        table_gather(list(range(90)))  # bucket 128 was never compiled


def test_bench_refuses_without_accelerator(capsys):
    import jax

    if jax.default_backend() != "cpu":
        pytest.skip("an accelerator is present")
    assert _cli.main(["bench"]) == 2
    reason = "numbers would mean nothing" if torch_available() else "torch is not importable"
    assert reason in capsys.readouterr().out


def test_bench_markdown_and_chart(tmp_path):
    from jaxsync.bench._render import markdown, render

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

    from jaxsync.bench._programs import main_program_args
    from jaxsync.bench._timing import _Side, same_args_floor

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


def test_every_path_builds_without_torch(monkeypatch):
    # `jaxsync verify` on a torch-free install must still run every check (parity says skipped).
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "transformers", None)
    for spec in registry.paths():
        case = spec.build(None)
        assert len(case.inputs) >= 2, spec.name


def test_jax_dispatch_count_from_profiler_trace():
    import jax
    import jax.numpy as jnp

    from jaxsync.bench._programs import jax_executions_per_call

    f = jax.jit(lambda v: v * 2)
    g = jax.jit(lambda v: v + 1)
    x = jnp.ones(8)
    assert jax_executions_per_call(lambda: f(x)) == 1
    assert jax_executions_per_call(lambda: g(f(x))) == 2


def test_execution_count_takes_one_nesting_level():
    from jaxsync.bench._programs import count_executions

    def ev(name):
        return {"ph": "X", "name": name}

    nested = ["PjRtCApiLoadedExecutable::Execute", "PjRtStreamExecutorLoadedExecutable::Execute",
              "PjRtStreamExecutorLoadedExecutable::ExecuteHelper"]  # fmt: skip
    assert count_executions([ev(n) for n in nested * 2]) == 2  # two programs, three events each
    inner = "CommonPjRtLoadedExecutable::ExecuteHelperOnSingleDevice"  # XLA:CPU's one level
    assert count_executions([ev(inner), ev(inner), ev("ThunkExecutor::Execute")]) == 2
    assert count_executions([ev("something else"), {"ph": "i", "name": nested[0]}]) is None


def test_precompile_a_servers_own_instance():
    # Compiled programs belong to the instance: precompile the PathCase of the object you serve.
    import jaxsync
    from jaxsync.check import no_recompile

    (spec,) = registry.paths(["glm4v.vision_tower"])
    case = spec.build(None)
    enc = case.fn
    done = jaxsync.precompile([jaxsync.Target("tower", case)], buckets=[24, 32, 48], progress=False)
    assert [(c.path, c.bucket) for c in done] == [("tower", 24), ("tower", 32), ("tower", 48)]
    from jaxsync.paths.glm4v import reference as ref

    grids = [[[1, 6, 14]], [[1, 8, 12]], [[1, 10, 14]], [[1, 4, 20]], [[2, 6, 8]], [[1, 8, 24]]]
    inputs = [(ref.pixels(g, enc.cfg, seed=i), g) for i, g in enumerate(grids)]  # 21..48 tokens
    with no_recompile():
        for px, g in inputs:
            enc(px, g)


@pytest.fixture
def temp_path():
    """Registers test paths for one test: `temp_path(name, build, **register_kwargs)`."""
    added = []

    def register(name, build, **kwargs):
        registry.register_path(name, "test path", **kwargs)(build)
        added.append(name)

    yield register
    for name in added:
        registry._paths.pop(name, None)


def _doubling_case(parity):
    import jax.numpy as jnp

    f = jax.jit(lambda x: x * 2)
    return registry.PathCase(f, [(jnp.ones(3),), (jnp.zeros(3),)], parity)


def test_help_exits_zero_and_lists_the_commands(capsys):
    assert _cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(c in out for c in ("verify", "precompile", "bench"))


def test_python_dash_m_jaxsync():
    proc = subprocess.run(
        [sys.executable, "-m", "jaxsync", "--help"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "usage: jaxsync" in proc.stdout, proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "jaxsync"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2 and "COMMAND" in proc.stderr


def test_verify_help_lists_paths_and_families(capsys):
    assert _cli.main(["verify", "--help"]) == 0
    out = capsys.readouterr().out
    for spec in registry.paths():
        assert spec.name in out
    assert "families: " in out and "core" in out.split("families: ")[1]
    assert "core.table_gather" in out and "[no checkpoint]" in out


def test_verify_unknown_path_is_a_usage_error_listing_valid_names(capsys):
    assert _cli.main(["verify", "--paths", "nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "unknown path(s) nonexistent" in err and "core.table_gather" in err
    assert "Traceback" not in err


def test_verify_paths_without_a_value_is_a_usage_error(capsys):
    assert _cli.main(["verify", "--paths"]) == 2
    assert "expected at least one argument" in capsys.readouterr().err


def test_checkpoint_refused_for_a_path_that_takes_none(capsys, tmp_path):
    assert _cli.main(["verify", "--paths", "core.table_gather", "--checkpoint", str(tmp_path)]) == 2
    assert "core.table_gather take(s) no checkpoint" in capsys.readouterr().err


def test_checkpoint_that_does_not_exist_is_refused(capsys, temp_path, tmp_path):
    seen = []
    temp_path("test.weights", lambda ckpt: seen.append(ckpt) or _doubling_case(None))
    missing = str(tmp_path / "nope")
    assert _cli.main(["verify", "--paths", "test.weights", "--checkpoint", missing]) == 2
    assert "no such file or directory" in capsys.readouterr().err and seen == []
    # Control: an existing folder reaches the path's build.
    assert (
        _cli.main(
            ["verify", "--paths", "test.weights", "--checkpoint", str(tmp_path), "--no-probe"]
        )
        == 0
    )
    assert seen == [str(tmp_path)]


def _no_torch_parity():
    raise ImportError("No module named 'torch'")


def test_skipped_parity_is_not_verified_and_strict_fails(capsys, temp_path):
    temp_path("test.no_torch", lambda ckpt: _doubling_case(_no_torch_parity))
    assert _cli.main(["verify", "--paths", "test.no_torch"]) == 0
    out = capsys.readouterr().out
    assert "skipped" in out and "0 of 1 paths verified; 1 passed with checks skipped" in out
    assert _cli.main(["verify", "--paths", "test.no_torch", "--strict"]) == 1


def test_strict_passes_a_fully_verified_path(capsys, temp_path):
    # Negative control for the test above: with parity run and the probe on, strict passes.
    temp_path("test.full", lambda ckpt: _doubling_case(lambda: registry.Parity(0.0, 0.0)))
    assert _cli.main(["verify", "--paths", "test.full", "--strict"]) == 0
    out = capsys.readouterr().out
    assert "1 of 1 paths verified" in out and "skipped" not in out.split("\n")[-2]
    assert _cli.main(["verify", "--paths", "test.full", "--strict", "--no-probe"]) == 1


def test_lower_for_tpu_passes_the_demo_path(capsys):
    assert _cli.main(["verify", "--lower-for", "tpu", "--paths", "core.table_gather"]) == 0
    out = capsys.readouterr().out
    assert "core.table_gather  ok" in out and "1 of 1 paths lower for tpu" in out


def test_lower_for_tpu_fails_float64_and_host_callbacks(capsys, temp_path):
    import jax.numpy as jnp

    def wide(x):
        with jax.enable_x64(True):
            return (x.astype(jnp.float64) * 2).astype(jnp.float32)

    def calls_back(x):
        return jax.pure_callback(lambda v: v, jax.ShapeDtypeStruct((3,), jnp.float32), x)

    temp_path("test.float64", lambda ckpt: registry.PathCase(wide, [(jnp.ones(3),)] * 2))
    temp_path("test.callback", lambda ckpt: registry.PathCase(calls_back, [(jnp.ones(3),)] * 2))
    rc = _cli.main(["verify", "--lower-for", "tpu", "--paths", "test.float64", "test.callback"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "float64 value" in out and "pure_callback" in out
    assert "0 of 2 paths lower for tpu" in out


def test_gpu_only_custom_calls_are_reported():
    from jaxsync.check._export import custom_call_findings

    text = "\n".join(
        [
            "%0 = stablehlo.custom_call @__gpu$xla.gpu.triton(%a)",
            "%1 = stablehlo.custom_call @tpu_custom_call(%a)",
            "%2 = stablehlo.custom_call @cudnn$conv(%a)",
            "%3 = stablehlo.custom_call @my_op(%a)",
        ]
    )
    whats = [f.what for f in custom_call_findings(text, "tpu")]
    assert whats == [
        "GPU-only custom call __gpu$xla.gpu.triton",
        "GPU-only custom call cudnn$conv",
        "custom call my_op not known to lower on tpu",
    ]


def test_precompile_command(capsys):
    assert _cli.main(["precompile", "--paths", "core.table_gather", "--buckets", "8", "16"]) == 0
    assert "2 program(s) compiled" in capsys.readouterr().out
    assert _cli.main(["precompile", "--paths", "nope"]) == 2


def test_bench_modules_have_no_import_cycle():
    code = (
        "import sys, jaxsync.bench._render as r; "
        "assert 'jaxsync.bench._cli' not in sys.modules; "
        "import jaxsync.bench._cli as c; assert c.REFERENCE_LABELS is r.REFERENCE_LABELS"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
