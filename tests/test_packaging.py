"""A wheel built from the repository installs jaxsync, jaxsync.models.* and jaxsync.kv."""

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            out,
            ROOT,
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (whl,) = out.glob("jaxsync-*.whl")
    return whl


def test_wheel_contains_mapped_packages(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for pkg in ("jaxsync", "jaxsync/check", "jaxsync/weights", "jaxsync/kv", "jaxsync/models"):
        assert f"{pkg}/__init__.py" in names, pkg
    for family in ("chameleon", "gemma3n", "glm4v", "qwen3_omni", "voxtral"):
        assert f"jaxsync/models/{family}/__init__.py" in names, family
    assert not any(n.startswith(("models/", "kv/", "tests/")) for n in names)


def test_wheel_install_imports_without_the_checkout(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target, wheel],
        check=True,
        capture_output=True,
        timeout=300,
    )
    # -S skips site (and so the editable install's path hook); dependencies come from PYTHONPATH.
    env = dict(os.environ, PYTHONPATH=f"{target}{os.pathsep}{sysconfig.get_paths()['purelib']}")
    code = (
        "import jaxsync, jaxsync.kv, jaxsync.models.chameleon, jaxsync.check; "
        "print(jaxsync.__file__, jaxsync.kv.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert str(target) in out.stdout and str(ROOT) not in out.stdout
