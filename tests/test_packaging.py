"""`pip install fastdeploy_r3` alone serves a model: every third-party module the package imports
belongs to a runtime dependency (or to the extra that names it), and every runtime dependency carries
a lower and an upper bound that the installed versions, the ones the tests run against, satisfy."""

from __future__ import annotations

import ast
import importlib.metadata as md
import os
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# modules only an extra brings, imported where that extra's feature is used
EXTRA_MODULES = {"mooncake": "mooncake", "paddle": "paddle", "triton": "triton"}


def _setup_kwargs() -> dict:
    tree = ast.parse(open(os.path.join(REPO, "setup.py")).read())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    return {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg in ("install_requires",
                                                                                       "extras_require")}


def _imported_top_level_modules() -> set[str]:
    names: set[str] = set()
    for root, _, files in os.walk(os.path.join(REPO, "fastdeploy_r3")):
        for name in files:
            if name.endswith(".py"):
                for node in ast.walk(ast.parse(open(os.path.join(root, name)).read())):
                    if isinstance(node, ast.Import):
                        names.update(a.name.split(".")[0] for a in node.names)
                    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                        names.add(node.module.split(".")[0])
    return {n for n in names if n != "fastdeploy_r3" and n not in sys.stdlib_module_names}


def test_every_runtime_dependency_is_bounded_and_the_installed_version_is_inside() -> None:
    for line in _setup_kwargs()["install_requires"]:
        req = Requirement(line)
        ops = {s.operator for s in req.specifier}
        assert ops & {">=", ">"} and ops & {"<", "<="}, f"{line}: give a lower and an upper bound"
        installed = md.version(req.name)
        assert req.specifier.contains(installed, prereleases=True), f"{line}: the tests run {req.name} {installed}"


def test_every_third_party_import_comes_with_the_install() -> None:
    kwargs = _setup_kwargs()
    runtime = {canonicalize_name(Requirement(r).name) for r in kwargs["install_requires"]}
    # a runtime dependency brings its own dependencies too (transformers brings huggingface_hub, ...)
    closure = set(runtime)
    todo = list(runtime)
    while todo:
        for r in md.requires(todo.pop()) or []:
            dep = Requirement(r)
            if dep.marker is None and canonicalize_name(dep.name) not in closure:
                closure.add(canonicalize_name(dep.name))
                todo.append(canonicalize_name(dep.name))
    dists = md.packages_distributions()
    missing = {}
    for module in _imported_top_level_modules() - set(EXTRA_MODULES):
        provided_by = {canonicalize_name(d) for d in dists.get(module, [])}
        if not provided_by & closure:
            missing[module] = sorted(provided_by)
    assert not missing, f"imported but not installed by `pip install fastdeploy_r3`: {missing}"
    for extra, module in EXTRA_MODULES.items():
        assert extra in kwargs["extras_require"], f"{module} is imported; the extra {extra!r} must bring it"
    assert "transformers" in {canonicalize_name(Requirement(r).name) for r in kwargs["install_requires"]}
