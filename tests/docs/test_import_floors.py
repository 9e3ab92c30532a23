"""The folder tree is the data flow (docs/design.md §3): each top-level package sits on a floor and imports only from
its own floor or the ones below, lazy imports inside functions included. kernels/ (device math) is the ground;
model/ and ops/ (the model and the ops it runs) above it; services/ (the processes) above them; the tools that drive
the services (bench/, deploy/) on top."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLOORS = {"kernels": 0, "model": 1, "ops": 1, "twinspark": 1, "services": 2, "bench": 3, "deploy": 3}


def _imported_packages(tree: ast.AST) -> set[str]:
    """The top-level packages of the repository a module imports (absolute imports; relative ones stay inside)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & FLOORS.keys()


def upward_imports(root: Path = ROOT) -> list[str]:
    """Every `file: imports package` where the package sits on a higher floor than the file's own."""
    found = []
    for package, floor in FLOORS.items():
        folder = root / ("protos/twinspark" if package == "twinspark" else package)
        for path in sorted(folder.rglob("*.py")):
            for name in sorted(_imported_packages(ast.parse(path.read_text(encoding="utf-8")))):
                if FLOORS[name] > floor:
                    found.append(f"{path.relative_to(root)}: imports {name} (floor {FLOORS[name]} > {floor})")
    return found


def test_no_package_imports_from_a_higher_floor():
    assert upward_imports() == []


def test_an_upward_import_is_found(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "a.py").write_text("def f():\n    from services.common import flags\n")
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "b.py").write_text("import torch\nfrom kernels.quant import x\n")
    assert upward_imports(tmp_path) == ["model/a.py: imports services (floor 2 > 1)"]
