"""No import cycle between the modules of the package, found on the source with `ast`.

A module imports another when it names it in an import statement, at the top or inside a function
(a function-local import is still a dependency; it only runs later). Importing `a.b.c` also runs the
`__init__` of `a.b`, so an import counts for every package above the imported module too, except the
importer's own packages (Python has started those before the importer) and the root package. Imports
under `if TYPE_CHECKING:` never run and are left out. `from a.b import c` names the module `a.b.c`
when that is a module, else the package `a.b`.
"""

from __future__ import annotations

import ast
import os

PACKAGE = "fastdeploy_r3"
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PACKAGE)


def module_files(root: str = ROOT) -> dict[str, str]:
    """Dotted module name -> file, for every .py under the package (a package is its __init__)."""
    out = {}
    base = os.path.dirname(root)
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                dotted = os.path.relpath(path, base)[: -len(".py")].replace(os.sep, ".")
                out[dotted.removesuffix(".__init__")] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, importer: str, is_package: bool) -> list[tuple[str, list[str]]]:
    """(module, names) of every import that runs, TYPE_CHECKING blocks skipped; relative ones resolved."""
    found: list[tuple[str, list[str]]] = []
    package = importer if is_package else importer.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.append((module, [alias.name for alias in node.names]))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(root: str = ROOT) -> dict[str, set[str]]:
    files = module_files(root)
    graph: dict[str, set[str]] = {}
    for importer, path in files.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        own = {importer.rsplit(".", n)[0] for n in range(importer.count(".") + 1)}
        edges: set[str] = set()
        for module, names in _imports(tree, importer, path.endswith("__init__.py")):
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in files] or [module]
            if len(targets) < len(names):  # some names are attributes of the module itself
                targets.append(module)
            for target in targets:
                parts = target.split(".")
                for i in range(2, len(parts) + 1):  # the module and every package above it but the root
                    name = ".".join(parts[:i])
                    if name in files and name not in own:
                        edges.add(name)
        graph[importer] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted, as cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return sorted(found)


def test_the_package_has_no_import_cycle() -> None:
    assert cycles(import_graph()) == []


def _write(root, rel: str, text: str = "") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_checker_sees_a_cycle_through_a_function_local_import(tmp_path) -> None:
    """a imports b at the top, b imports a inside a function: one cycle {a, b}."""
    _write(tmp_path, f"{PACKAGE}/__init__.py")
    _write(tmp_path, f"{PACKAGE}/a.py", "from fastdeploy_r3.b import f\n")
    _write(tmp_path, f"{PACKAGE}/b.py", "def f():\n    from . import a\n")
    assert cycles(import_graph(str(tmp_path / PACKAGE))) == [[f"{PACKAGE}.a", f"{PACKAGE}.b"]]


def test_the_checker_sees_a_cycle_through_a_package_that_re_exports(tmp_path) -> None:
    """conf/__init__ re-exports conf.engine, which imports r3.cfg, which imports conf.errors: importing
    conf.errors runs conf/__init__, so r3.cfg -> conf -> conf.engine -> r3.cfg is a cycle (the one that
    keeps ConfigError out of config/)."""
    _write(tmp_path, f"{PACKAGE}/__init__.py")
    _write(tmp_path, f"{PACKAGE}/conf/__init__.py", "from fastdeploy_r3.conf.engine import Engine\n")
    _write(tmp_path, f"{PACKAGE}/conf/errors.py")
    _write(tmp_path, f"{PACKAGE}/conf/engine.py", "from fastdeploy_r3.r3.cfg import R3\n")
    _write(tmp_path, f"{PACKAGE}/r3/__init__.py")
    _write(tmp_path, f"{PACKAGE}/r3/cfg.py", "from fastdeploy_r3.conf.errors import E\n")
    assert cycles(import_graph(str(tmp_path / PACKAGE))) == [
        [f"{PACKAGE}.conf", f"{PACKAGE}.conf.engine", f"{PACKAGE}.r3.cfg"]
    ]


def test_the_checker_lets_a_package_load_its_own_modules_and_skips_type_checking(tmp_path) -> None:
    """stores/__init__ imports stores.base and, lazily, stores.extra, which import stores.base (their own
    package is started before them: no edge back); a TYPE_CHECKING import back is never run."""
    _write(tmp_path, f"{PACKAGE}/__init__.py")
    _write(tmp_path, f"{PACKAGE}/stores/__init__.py",
           "from .base import Base\ndef make():\n    from fastdeploy_r3.stores.extra import Extra\n")
    _write(tmp_path, f"{PACKAGE}/stores/base.py",
           "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fastdeploy_r3.user import U\n")
    _write(tmp_path, f"{PACKAGE}/stores/extra.py", "from fastdeploy_r3.stores.base import Base\n")
    _write(tmp_path, f"{PACKAGE}/user.py", "from fastdeploy_r3.stores import make\n")
    graph = import_graph(str(tmp_path / PACKAGE))
    assert graph[f"{PACKAGE}.stores.extra"] == {f"{PACKAGE}.stores.base"}
    assert graph[f"{PACKAGE}.stores.base"] == set()
    assert graph[f"{PACKAGE}.user"] == {f"{PACKAGE}.stores"}
    assert cycles(graph) == []
