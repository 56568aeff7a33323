"""The `jaxsync` command line: top-level help, `python -m jaxsync`, and usage errors."""

import subprocess
import sys

import pytest

from jaxsync.harness import _cli, registry


def test_unknown_path_and_usage(capsys):
    with pytest.raises(ValueError, match="unknown path"):
        registry.paths(["nope"])
    assert _cli.main([]) == 2


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
