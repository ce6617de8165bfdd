"""Import rules between the rooms of the package, checked on the source with `ast` (every import
counts: top level, inside functions, and under TYPE_CHECKING).

    model_executor/  imports neither cache_manager/ nor engine/
    worker/          does not import engine/
    cache_manager/   imports neither engine/ nor entrypoints/
    r3/, client/     import none of model_executor/, cache_manager/, engine/, entrypoints/ (a trainer
                     loads them alone, without torch models or the KV cache)
    blobstore/,      import no other room: the storage and process-group rooms sit under everyone
    distributed/
    config/          imports only r3/ (its RoutingReplayConfig) and the leaf errors.py
"""

from __future__ import annotations

import ast
import os

PACKAGE = "fastdeploy_r3"
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PACKAGE)

ROOMS = ("blobstore", "cache_manager", "client", "config", "distributed", "engine", "entrypoints",
         "model_executor", "r3", "worker")


def _all_but(*allowed: str) -> tuple[str, ...]:
    return tuple(room for room in ROOMS if room not in allowed)


FORBIDDEN = {
    "model_executor": ("cache_manager", "engine"),
    "worker": ("engine",),
    "cache_manager": ("engine", "entrypoints"),
    "r3": ("model_executor", "cache_manager", "engine", "entrypoints"),
    "client": ("model_executor", "cache_manager", "engine", "entrypoints"),
    "blobstore": _all_but("blobstore"),
    "distributed": _all_but("distributed"),
    "config": _all_but("config", "r3"),
}

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


def test_r3_and_client_may_not_import_model_executor(tmp_path) -> None:
    """The rule that keeps a trainer's reader free of torch models: a client module importing the
    weight-update group from model_executor/ (where it lived before distributed/) is a violation."""
    pkg = tmp_path / PACKAGE / "client"
    pkg.mkdir(parents=True)
    (pkg / "sync.py").write_text("from fastdeploy_r3.model_executor.weight_update_group import init\n"
                                 "from fastdeploy_r3.distributed.weight_update_group import init\n")
    assert violations(str(tmp_path / PACKAGE)) == [
        "client/sync.py imports fastdeploy_r3.model_executor.weight_update_group",
    ]
