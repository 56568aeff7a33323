"""`jaxsync` command-line failures: one clear line and exit status 2, never a traceback; family
names wherever path names go; a fast `--help` / `--version`."""

import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxsync import weights
from jaxsync.harness import _cli, registry


@pytest.fixture
def temp_path(monkeypatch):
    """Registers test paths for one test: `temp_path(name, build, checkpoints=True)`."""
    registry.load_all()

    def register(name, build, checkpoints=True):
        spec = registry.PathSpec(name, "test path", build, checkpoints)
        monkeypatch.setitem(registry._paths, name, spec)  # removed again after the test

    return register


def _loading_case(checkpoint):
    """A path that reads its checkpoint's tensor names (the loader's own checks), then doubles."""
    if checkpoint is not None:
        weights.checkpoint_keys(checkpoint)
    f = jax.jit(lambda x: x * 2)
    return registry.PathCase(f, [(jnp.ones(3),), (jnp.zeros(3),)])


def _broken_checkpoints(root: Path) -> dict[str, Path]:
    (root / "empty").mkdir()
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text("{not json")
    (root / "bin").mkdir()
    (root / "bin" / "config.json").write_text("{}")
    (root / "bin" / "pytorch_model.bin").write_bytes(b"\x80\x02not safetensors")
    (root / "junk.safetensors").write_bytes(b"not a safetensors header")
    return {
        "folder without config.json": root / "empty",
        "broken config.json": root / "broken",
        "non-safetensors file": root / "bin" / "pytorch_model.bin",
        "corrupt safetensors": root / "junk.safetensors",
    }


def _assert_one_line_usage_error(rc, err):
    # What a terminal shows: the progress bar redraws one line with \r and is erased at the end.
    lines = [line.split("\r")[-1] for line in err.split("\n")]
    lines = [line for line in lines if line.strip()]
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("jaxsync verify: error: --checkpoint"), err
    assert "Traceback" not in err


@pytest.mark.parametrize("what", ["non-safetensors file", "corrupt safetensors", "empty"])
def test_a_checkpoint_the_loader_refuses_is_one_line_and_exit_2(what, temp_path, tmp_path, capsys):
    temp_path("test.loads", _loading_case)
    ckpt = _broken_checkpoints(tmp_path).get(what, tmp_path / "empty")
    rc = _cli.main(["verify", "--paths", "test.loads", "--checkpoint", str(ckpt), "--no-probe"])
    _assert_one_line_usage_error(rc, capsys.readouterr().err)


@pytest.mark.parametrize(
    "what", ["folder without config.json", "broken config.json", "non-safetensors file"]
)
@pytest.mark.parametrize("json_out", [False, True])
def test_a_family_checkpoint_that_fails_is_one_line_and_exit_2(what, json_out, tmp_path, capsys):
    ckpt = _broken_checkpoints(tmp_path)[what]
    argv = ["verify", "--paths", "glm4v", "--checkpoint", str(ckpt), "--no-probe"]
    rc = _cli.main(argv + (["--json"] if json_out else []))
    captured = capsys.readouterr()
    _assert_one_line_usage_error(rc, captured.err)
    assert "KeyError" not in captured.err
    if json_out:
        assert captured.out == ""  # nothing half-written on stdout


def test_lower_for_with_a_failing_checkpoint_is_one_line_and_exit_2(tmp_path, capsys):
    ckpt = _broken_checkpoints(tmp_path)["folder without config.json"]
    rc = _cli.main(["verify", "--lower-for", "tpu", "--paths", "glm4v", "--checkpoint", str(ckpt)])
    _assert_one_line_usage_error(rc, capsys.readouterr().err)


def test_a_path_whose_own_build_fails_is_a_failed_row(temp_path, capsys):
    # Without --checkpoint a failing build is the path's fault: a FAILED row and exit 1.
    def broken(checkpoint):
        raise RuntimeError("no such table")

    temp_path("test.broken", broken)
    assert _cli.main(["verify", "--paths", "test.broken", "--json"]) == 1
    (row,) = json.loads(capsys.readouterr().out)["paths"]
    assert row["status"] == "failed" and "no such table" in row["error"]


def test_a_good_checkpoint_reaches_the_build(temp_path, tmp_path, capsys):
    # Control for the refusals above: a real safetensors file passes the loader's checks.
    import numpy as np
    from safetensors.numpy import save_file

    temp_path("test.loads", _loading_case)
    save_file({"w": np.ones(2, np.float32)}, str(tmp_path / "model.safetensors"))
    argv = ["verify", "--paths", "test.loads", "--checkpoint", str(tmp_path), "--no-probe"]
    assert _cli.main(argv) == 0, capsys.readouterr()


def test_a_family_name_selects_its_checkpointable_paths(temp_path, tmp_path, capsys):
    seen = []
    temp_path("fam.loads", lambda ckpt: seen.append(ckpt) or _loading_case(None))
    temp_path("fam.plain", lambda ckpt: _loading_case(None), checkpoints=False)
    argv = ["verify", "--paths", "fam", "--checkpoint", str(tmp_path), "--no-probe", "--json"]
    assert _cli.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["paths"]
    assert [r["path"] for r in rows] == ["fam.loads"] and seen == [str(tmp_path)]
    # A path named explicitly that takes no checkpoint is still refused.
    assert _cli.main(["verify", "--paths", "fam.plain", "--checkpoint", str(tmp_path)]) == 2


def test_a_checkpoint_for_paths_of_two_families_is_refused(temp_path, tmp_path, capsys):
    temp_path("fa.x", _loading_case)
    temp_path("fb.x", _loading_case)
    assert _cli.main(["verify", "--paths", "fa", "fb", "--checkpoint", str(tmp_path)]) == 2
    assert "one family" in capsys.readouterr().err


@pytest.mark.parametrize("buckets", [["0"], ["-3"], ["8", "0"]])
def test_precompile_refuses_non_positive_buckets(buckets, capsys):
    argv = ["precompile", "--paths", "core.table_gather", "--buckets", *buckets]
    assert _cli.main(argv) == 2
    captured = capsys.readouterr()
    assert "--buckets must be positive" in captured.err and "compiled" not in captured.out


def test_version(capsys):
    assert _cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("jaxsync ")


_STUB = """
import sys, time, types
from pathlib import Path
# The CLI's own modules, loaded without the package's __init__ (which imports jax).
pkg = types.ModuleType("jaxsync")
pkg.__path__ = [str(Path({root!r}) / "jaxsync")]
sys.modules["jaxsync"] = pkg
t0 = time.perf_counter()
from jaxsync.harness import _cli
for argv in (["--help"], ["--version"], ["bench", "--help"]):
    try:
        _cli.main(argv)
    except SystemExit:
        pass
print("SECONDS", time.perf_counter() - t0, "JAX", "jax" in sys.modules)
"""


def test_cli_help_and_version_import_no_jax():
    root = str(Path(_cli.__file__).parents[2])
    code = _STUB.format(root=root)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    last = proc.stdout.strip().splitlines()[-1].split()
    assert proc.returncode == 0 and last[0] == "SECONDS", proc.stderr
    assert last[3] == "False", "the CLI imported jax for --help / --version / bench --help"
    assert float(last[1]) < 1.0, last


def _console_help_time() -> tuple[float, bool]:
    code = "import sys, time; t=time.perf_counter(); from jaxsync.harness._cli import main\n"
    code += "main(['--help']); print(time.perf_counter()-t, 'jax' in sys.modules)"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    wall = time.perf_counter() - t0
    return wall, proc.stdout.strip().splitlines()[-1].endswith("True")


def test_console_help_answers_within_a_second_without_jax():
    wall, jax_imported = _console_help_time()
    assert not jax_imported and wall < 2.0, (wall, jax_imported)
