"""A wheel built from the repository installs jaxsync, jaxsync.models.* and jaxsync.kv."""

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]


def _site_env(target: Path) -> dict[str, str]:
    """An environment whose PYTHONPATH is `target` then this interpreter's site-packages folders
    (a virtual environment's and, with system site packages, the base interpreter's)."""
    sites = [p for p in sys.path if p.endswith("site-packages")] or [
        sysconfig.get_paths()["purelib"]
    ]
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), *sites]))


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
    assert "jaxsync/py.typed" in names  # PEP 561 marker


def test_wheel_install_imports_without_the_checkout(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target, wheel],
        check=True,
        capture_output=True,
        timeout=300,
    )
    # -S skips site (and so the editable install's path hook); dependencies come from PYTHONPATH.
    env = _site_env(target)
    code = (
        "import jaxsync, jaxsync.kv, jaxsync.models.chameleon, jaxsync.check; "
        "print(jaxsync.__file__, jaxsync.kv.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert str(target) in out.stdout and str(ROOT) not in out.stdout


FAMILIES = ("chameleon", "gemma3n", "glm4v", "qwen3_omni", "voxtral")


def _torch_importers(target: Path, modules: list[str]) -> subprocess.CompletedProcess:
    """Imports `modules` one by one from the installed wheel; prints the first that loads torch."""
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "    if 'torch' in sys.modules or 'transformers' in sys.modules:\n"
        "        print('torch imported by', m); break\n"
        "print(sys.modules['jaxsync'].__file__)"
    )
    return subprocess.run(
        [sys.executable, "-S", "-c", code],
        env=_site_env(target),
        capture_output=True,
        text=True,
        cwd=target.parent,
    )


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    target = tmp_path_factory.mktemp("installed") / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target, wheel],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return target


def test_installed_wheel_imports_no_torch(installed):
    # The library (core, kv, every model family) never imports torch: only jaxsync.harness.paths
    # does, inside the functions that build references.
    modules = ["jaxsync", "jaxsync.kv", *(f"jaxsync.models.{f}" for f in FAMILIES)]
    out = _torch_importers(installed, modules)
    assert out.returncode == 0, out.stderr
    assert "torch imported by" not in out.stdout, out.stdout
    assert str(installed) in out.stdout


def test_torch_import_detector_fires(installed):
    # Negative control: a module list that imports torch is reported.
    pytest.importorskip("torch")
    out = _torch_importers(installed, ["jaxsync", "torch"])
    assert "torch imported by torch" in out.stdout, out.stderr
