"""Import rules between the rooms of the package, checked on the source with `ast` (every import
counts: top level, inside functions, and under TYPE_CHECKING).

    model_executor/  imports neither cache_manager/ nor engine/
    worker/          does not import engine/
    cache_manager/   imports neither engine/ nor entrypoints/
"""

from __future__ import annotations

import ast
import os

PACKAGE = "fastdeploy_r3"
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PACKAGE)

FORBIDDEN = {
    "model_executor": ("cache_manager", "engine"),
    "worker": ("engine",),
    "cache_manager": ("engine", "entrypoints"),
}

# Known breaks that the other half of issue 8 removes; the lead deletes each line at merge, and
# the test then holds the rule for them too.
ALLOWED: set[tuple[str, str]] = set()  # (file, room) pairs exempted, each with a reason; none today


def imported_modules(path: str, root: str = ROOT) -> list[str]:
    """Absolute module names imported by one file (relative imports resolved against its package)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    rel = os.path.relpath(path, os.path.dirname(root))
    package_parts = rel[: -len(".py")].split(os.sep)[:-1]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                names.append(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                names.append(node.module)
    return names


def violations(root: str = ROOT) -> list[str]:
    found = []
    for room, forbidden in FORBIDDEN.items():
        for dirpath, _, files in os.walk(os.path.join(root, room)):
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root).replace(os.sep, "/")
                for module in imported_modules(path, root):
                    parts = module.split(".")
                    if parts[0] != PACKAGE or len(parts) < 2 or parts[1] not in forbidden:
                        continue
                    if (rel, parts[1]) not in ALLOWED:
                        found.append(f"{rel} imports {module}")
    return found


def test_no_room_imports_a_room_above_it() -> None:
    assert violations() == []


def test_the_checker_sees_relative_function_local_and_type_checking_imports(tmp_path) -> None:
    """A fake worker module with three kinds of engine import: all three are found."""
    pkg = tmp_path / PACKAGE / "worker"
    pkg.mkdir(parents=True)
    src = pkg / "bad.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "from ..engine import request\n"
        "if TYPE_CHECKING:\n    from fastdeploy_r3.engine.scheduler import Scheduler\n"
        "def f():\n    import fastdeploy_r3.engine.llm\n"
    )
    root = str(tmp_path / PACKAGE)
    assert imported_modules(str(src), root) == [
        "typing", "fastdeploy_r3.engine", "fastdeploy_r3.engine.scheduler", "fastdeploy_r3.engine.llm",
    ]
    assert violations(root) == [
        "worker/bad.py imports fastdeploy_r3.engine",
        "worker/bad.py imports fastdeploy_r3.engine.scheduler",
        "worker/bad.py imports fastdeploy_r3.engine.llm",
    ]
