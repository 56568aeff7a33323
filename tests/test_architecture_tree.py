"""docs/ARCHITECTURE.md's tree is the real tree.

Every path its tree names exists, and every module of the core (`jaxsync/*.py`), of `kv/` and
the modules every family shares (`models/*.py`), and each family's five files, is named there.
The tree's first column (`NAME_WIDTH` characters) holds names, indented two spaces per level
under their folder; the rest of a line, and lines with an empty first column, describe them.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
NAME_WIDTH = 25
FAMILY_FILES = ("_config.py", "_modules.py", "_plan.py", "_entry.py", "_weights.py")
# Folders whose every module must be named in the tree (what a newcomer looks for first).
COMPLETE = ("jaxsync", "kv", "models")


def tree_block(text: str) -> str:
    section = text.split("\n## The tree\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```\n(.*?)```", section, re.S).group(1)


def tree_paths(block: str, families: list[str]) -> set[str]:
    """The paths the tree names, `<family>` expanded to every family."""
    paths: set[str] = set()
    folders: list[tuple[int, str]] = []  # (indent, folder) of the enclosing folders
    for line in block.splitlines():
        column = line[:NAME_WIDTH]
        if not column.strip():
            continue  # a description's continuation
        indent = len(column) - len(column.lstrip(" "))
        while folders and folders[-1][0] >= indent:
            folders.pop()
        base = folders[-1][1] if folders else ""
        names = column.split()
        for name in names:
            paths.add(base + name)
        if len(names) == 1 and names[0].endswith("/"):
            folders.append((indent, base + names[0]))
    expanded = set()
    for path in paths:
        if "<family>" in path:
            expanded |= {path.replace("<family>", f) for f in families}
        else:
            expanded.add(path)
    return expanded


def missing(paths: set[str], root: Path) -> list[str]:
    return sorted(p for p in paths if not (root / p.rstrip("/")).exists())


def _families() -> list[str]:
    return sorted(p.parent.name for p in (ROOT / "models").glob("*/__init__.py"))


def _tracked() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", *COMPLETE], cwd=ROOT, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return out.stdout.split()


def _named() -> set[str]:
    return tree_paths(tree_block((ROOT / "docs" / "ARCHITECTURE.md").read_text()), _families())


def test_every_path_the_tree_names_exists():
    named = _named()
    assert {"jaxsync/_entry.py", "kv/_copy.py", "models/glm4v/_plan.py"} <= named
    assert missing(named, ROOT) == []


def test_every_module_of_the_core_kv_and_the_families_is_named():
    named = _named()
    modules = [
        p
        for p in _tracked()
        if p.endswith(".py")
        and not p.endswith("__init__.py")
        and Path(p).parent.as_posix() in COMPLETE
    ]
    assert modules
    assert sorted(set(modules) - named) == []
    five = {f"models/{f}/{name}" for f in _families() for name in FAMILY_FILES}
    assert sorted(five - named) == []


def test_the_tree_reader_flags_a_missing_path(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "real.py").write_text("")
    block = (
        "pkg/                     a package\n"
        "  real.py gone.py        two modules on one line\n"
        "                         a continuation, ignored\n"
        "top.py                   back at the top\n"
    )
    assert tree_paths(block, []) == {"pkg/", "pkg/real.py", "pkg/gone.py", "top.py"}
    assert missing(tree_paths(block, []), tmp_path) == ["pkg/gone.py", "top.py"]


def test_the_tree_reader_expands_families():
    block = "models/<family>/         each family\n  _plan.py               its planner\n"
    assert tree_paths(block, ["a", "b"]) == {
        "models/a/",
        "models/b/",
        "models/a/_plan.py",
        "models/b/_plan.py",
    }
