"""`jaxsync verify`: per-path checks and parity, checkpoints, `--strict` and `--lower-for`."""

import json

import jax
import pytest

from jaxsync.harness import _cli, registry
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


def test_every_registered_path_builds_and_lists():
    specs = registry.paths()
    assert any(s.name == "core.table_gather" for s in specs)
    assert len({s.name for s in specs}) == len(specs)


def test_every_path_builds_without_torch(monkeypatch):
    # `jaxsync verify` on a torch-free install must still run every check (parity says skipped).
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "transformers", None)
    for spec in registry.paths():
        case = spec.build(None)
        assert len(case.inputs) >= 2, spec.name


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
