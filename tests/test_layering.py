"""The runtime never imports the harness, and the model and KV packages never import torch.

The runtime is what a server imports: the core (`jaxsync/_*.py`), `jaxsync.check`,
`jaxsync.weights`, `jaxsync.models` (`models/`) and `jaxsync.kv` (`kv/`). Each of their sources
is parsed and every import in it is read, at module level or inside a function alike:
`import x`, `from x import y`, `from jaxsync import harness` and `importlib.import_module("x")`
with a constant name. A torch or transformers import under `models/` or `kv/` is allowed only
where it is optional: inside a `try` whose handler catches `ImportError` and falls back.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
# `jaxsync/__main__.py` is the `jaxsync` command (`python -m jaxsync`), the harness's.
RUNTIME = [
    *sorted(p for p in (ROOT / "jaxsync").glob("_*.py") if p.name != "__main__.py"),
    *sorted((ROOT / "jaxsync" / "check").rglob("*.py")),
    *sorted((ROOT / "jaxsync" / "weights").rglob("*.py")),
    *sorted((ROOT / "models").rglob("*.py")),
    *sorted((ROOT / "kv").rglob("*.py")),
]
HARNESS = "jaxsync.harness"
TORCH = ("torch", "transformers")


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = []
    if handler.type is not None:
        types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        names = [t.id for t in types if isinstance(t, ast.Name)]
    return handler.type is None or bool({"ImportError", "ModuleNotFoundError"} & set(names))


def _imports(tree: ast.AST) -> list[tuple[int, str, bool]]:
    """(line, module, optional) of every import in `tree`; `optional`: inside a `try` whose
    handler catches ImportError."""
    found: list[tuple[int, str, bool]] = []

    def visit(node: ast.AST, optional: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name, optional) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module, optional))
            # `from jaxsync import harness`: the sub-module is named as an imported name
            found.extend((node.lineno, f"{node.module}.{a.name}", optional) for a in node.names)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value, optional))
        if isinstance(node, ast.Try):
            guarded = optional or any(_catches_import_error(h) for h in node.handlers)
            for child in node.body:
                visit(child, guarded)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child, optional)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, optional)

    visit(tree, False)
    return found


def forbidden_imports(source: str, *, no_torch: bool) -> list[str]:
    """The imports of `source` the runtime may not make: any of `jaxsync.harness`, and with
    `no_torch` a required (not optional) torch or transformers."""
    bad = []
    for line, module, optional in _imports(ast.parse(source)):
        if _within(module, HARNESS):
            bad.append(f"line {line}: {module}")
        elif no_torch and not optional and any(_within(module, t) for t in TORCH):
            bad.append(f"line {line}: {module}")
    return bad


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_the_runtime_sources_are_found():
    names = {_rel(p) for p in RUNTIME}
    assert {"jaxsync/_precompile.py", "jaxsync/_tower.py", "kv/_copy.py"} <= names
    assert any(n.startswith("models/glm4v/") for n in names)
    assert any(n.startswith("jaxsync/check/") for n in names)
    assert any(n.startswith("jaxsync/weights/") for n in names)
    assert not any(n.startswith("jaxsync/harness/") for n in names)
    assert "jaxsync/__init__.py" in names and "jaxsync/__main__.py" not in names


@pytest.mark.parametrize("path", RUNTIME, ids=_rel)
def test_runtime_imports_no_harness(path):
    no_torch = _rel(path).startswith(("models/", "kv/"))
    assert forbidden_imports(path.read_text(), no_torch=no_torch) == []


@pytest.mark.parametrize(
    "source",
    [
        "import jaxsync.harness.paths\n",
        "from jaxsync.harness import registry\n",
        "from jaxsync import harness\n",
        "from jaxsync.harness.paths.glm4v import reference as ref\n",
        "def f():\n    from jaxsync.harness._cli import main\n    return main\n",
        "import importlib\n\ndef f():\n"
        "    return importlib.import_module('jaxsync.harness.registry')\n",
        "class A:\n    def m(self):\n        try:\n            import jaxsync.harness\n"
        "        except ImportError:\n            pass\n",
        "def f():\n    import torch\n    return torch\n",
        "from transformers import AutoConfig\n",
        "try:\n    import torch\nexcept RuntimeError:\n    torch = None\n",
    ],
)
def test_scanner_flags_a_forbidden_import(source):
    # Negative control: each of these sources imports what the runtime may not.
    assert forbidden_imports(source, no_torch=True)


@pytest.mark.parametrize(
    "source",
    [
        "import jaxsync\nfrom jaxsync import check, kv\nfrom jaxsync._tower import TowerProgram\n",
        "import jaxsync.harnessed\n",  # a name that merely starts alike
        "from . import harness\n",  # a relative import of some other package's module
        "try:\n    from transformers import AutoConfig\n"
        "except ImportError:\n    AutoConfig = None\n",
    ],
)
def test_scanner_passes_allowed_imports(source):
    assert forbidden_imports(source, no_torch=True) == []
