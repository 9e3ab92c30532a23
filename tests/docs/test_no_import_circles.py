"""model/ and ops/ import each other without a circle, file by file (docs/design.md §4): the blocks (model/) call the
ops through the `model.forward.Forward` Protocol and hand them parameter records (model/params.py), so no op module
needs a block module, even for a type. Every import counts here: module-level, under TYPE_CHECKING and inside
functions, since a type-only circle is still one the reader has to follow around.

An import names one file: `from pkg import sub` the submodule's file when there is one, else the package's
__init__.py; `import a.b` the file of a.b. A parent package's __init__.py, which Python runs first, is not an edge:
it would tie every package to whatever its __init__ imports lazily."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("model", "ops")
# Blocks by name, besides every model/ class with a method that takes a `Forward` (found below): a record stands in
# for each of these in an op's parameters.
BLOCKS = {"DecoderLayer", "HyperConnection", "Moe", "DenseMlp", "KdaAttention", "MlaAttention", "Indexer", "MtpBlock"}


def _module_file(root: Path, dotted: str) -> str | None:
    """The repository file of a dotted module name, or None when it is not one of ours."""
    base = root.joinpath(*dotted.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path.relative_to(root).as_posix()
    return None


def _package_of(rel: str) -> list[str]:
    """The dotted parts of the package a file belongs to (the package itself for an __init__.py)."""
    return rel.removesuffix(".py").split("/")[:-1]


def _targets(root: Path, rel: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.Import):
        return {f for a in node.names if (f := _module_file(root, a.name))}
    package = _package_of(rel)
    base = package[: len(package) - node.level + 1] if node.level else []
    module = ".".join(base + (node.module.split(".") if node.module else []))
    found = set()
    for a in node.names:
        f = _module_file(root, f"{module}.{a.name}") if module else _module_file(root, a.name)
        f = f or (_module_file(root, module) if module else None)
        if f:
            found.add(f)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """file -> the model/ and ops/ files it imports, every import statement of the file included."""
    files = sorted(p.relative_to(root).as_posix() for pkg in PACKAGES for p in (root / pkg).rglob("*.py"))
    graph = {}
    for rel in files:
        tree = ast.parse((root / rel).read_text(encoding="utf-8"))
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _targets(root, rel, node)
        graph[rel] = {f for f in edges if f.split("/")[0] in PACKAGES and f != rel}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle as [a, b, ..., a], or [] when there is none (depth-first, files in sorted order)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return []


def _names_in(annotation: ast.expr | None) -> set[str]:
    """The names an annotation mentions, quoted annotations parsed too."""
    names: set[str] = set()
    for node in ast.walk(annotation) if annotation is not None else ():
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                names |= _names_in(ast.parse(node.value, mode="eval").body)
            except SyntaxError:
                pass
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
    return names


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
    a = fn.args
    return [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x is not None)]


def block_classes(root: Path = ROOT) -> set[str]:
    """BLOCKS and every class of model/ with a method that takes a `Forward` (a block: it calls the ops)."""
    found = set(BLOCKS)
    for path in (root / "model").rglob("*.py"):
        for cls in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(cls, ast.ClassDef) and any(
                    "Forward" in _names_in(arg.annotation) for fn in cls.body
                    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) for arg in _parameters(fn)):
                found.add(cls.name)
    return found


def ops_taking_blocks(root: Path = ROOT) -> list[str]:
    """Every `file:line function(parameter: Block)` in ops/ whose parameter is annotated with a block class."""
    blocks = block_classes(root)
    found = []
    for path in sorted((root / "ops").rglob("*.py")):
        fns = [n for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
               if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for fn in sorted(fns, key=lambda n: n.lineno):
            for arg in _parameters(fn):
                if hit := sorted(_names_in(arg.annotation) & blocks):
                    found.append(f"{path.relative_to(root)}:{fn.lineno} {fn.name}({arg.arg}: {', '.join(hit)})")
    return found


def test_model_and_ops_import_without_a_circle():
    cycle = find_cycle(import_graph())
    assert not cycle, "import circle: " + " -> ".join(cycle)


def test_no_op_takes_a_block():
    assert ops_taking_blocks() == []


def test_a_circle_and_a_block_parameter_are_found(tmp_path):
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "model" / "block.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ops import Forward\n"
        "class Attn:\n    def forward(self, x, fwd: 'Forward'):\n        return fwd.op(self, x)\n")
    (tmp_path / "ops" / "__init__.py").write_text("def begin():\n    from ops.impl import Forward\n")
    (tmp_path / "ops" / "impl.py").write_text("from . import helper\nclass Forward:\n"
                                              "    def op(self, a: 'model.block.Attn', x): ...\n")
    (tmp_path / "ops" / "helper.py").write_text("def f():\n    import model.block\n")
    graph = import_graph(tmp_path)
    assert graph["ops/impl.py"] == {"ops/helper.py"}
    assert find_cycle(graph) == ["model/block.py", "ops/__init__.py", "ops/impl.py", "ops/helper.py",
                                 "model/block.py"]
    assert block_classes(tmp_path) >= {"Attn"}
    assert ops_taking_blocks(tmp_path) == ["ops/impl.py:3 op(a: Attn)"]
