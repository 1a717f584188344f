"""What installing nanoserve puts on a machine: its packages, its command, its dependencies."""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nanoserve_cli.main import app

tomllib = pytest.importorskip("tomllib")
ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_installed_packages_are_every_package_folder_and_no_top_level_cli():
    setuptools = PYPROJECT["tool"]["setuptools"]
    inits = (ROOT / "nanoserve").rglob("__init__.py")
    folders = {".".join(init.parent.relative_to(ROOT).parts) for init in inits}
    assert set(setuptools["packages"]) == folders | {"nanoserve_cli"}
    assert setuptools["package-dir"] == {"nanoserve_cli": "cli"}
    assert PYPROJECT["project"]["scripts"] == {"nanoserve": "nanoserve_cli.main:app"}


def _third_party_imports(folder: Path) -> set[str]:
    ours = {"nanoserve", "nanoserve_cli", *sys.stdlib_module_names}
    names = set()
    for source in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - ours


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared(requirements: list[str]) -> set[str]:
    return {_normalized(re.split(r"[<>=!~ ;\[]", requirement)[0]) for requirement in requirements}


# Imported directly but part of a declared dependency's own API: fastapi is built on starlette
# and pins its version.
PROVIDED_BY = {"starlette": "fastapi"}


def test_every_module_the_installed_code_imports_is_a_declared_dependency():
    """Runtime dependencies, or an extra for an optional path (transformers: `baseline`); never
    only `dev`, which is for running the tests, not the installed code."""
    project = PYPROJECT["project"]
    extras = [extra for name, extra in project["optional-dependencies"].items() if name != "dev"]
    declared = _declared(project["dependencies"]) | {name for extra in extras for name in _declared(extra)}
    distributions = metadata.packages_distributions()
    imported = _third_party_imports(ROOT / "nanoserve") | _third_party_imports(ROOT / "cli")
    imported = {PROVIDED_BY.get(module, module) for module in imported}
    undeclared = {module for module in imported
                  if not {_normalized(d) for d in distributions.get(module, [module])} & declared}
    assert undeclared == set()


@pytest.mark.parametrize(("name", "floor"),
                         [("gguf", "0.16"), ("jinja2", "3.1.6"), ("huggingface_hub", "0.23")])
def test_dependency_floors_are_the_versions_whose_features_we_use(name, floor):
    assert f"{name}>={floor}" in PYPROJECT["project"]["dependencies"]


def test_shell_completion_is_offered():
    result = CliRunner().invoke(app, ["--help"])
    assert "--install-completion" in result.output and "--show-completion" in result.output


def _module_names() -> dict[str, Path]:
    names = {}
    for source in (ROOT / "nanoserve").rglob("*.py"):
        parts = source.relative_to(ROOT).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = source
    return names


MODULES = _module_names()


def _imports(source: Path) -> set[str]:
    """The nanoserve modules `source` imports anywhere: at module level, under `if
    TYPE_CHECKING:` and inside functions (an import deferred into a function, or made only for
    annotations, still ties the two modules together). `from nanoserve.x import y` counts as
    importing the module `nanoserve.x.y` where there is one, else `nanoserve.x`."""
    names = set()
    for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                names.add(submodule if submodule in MODULES else node.module)
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return {name for name in names if name.split(".")[0] == "nanoserve"}


def _graph() -> dict[str, set[str]]:
    return {name: _imports(source) - {name} for name, source in MODULES.items()}


def test_the_core_modules_import_one_way_only():
    """DESIGN: no two modules import each other, directly or round a longer circle, counting
    imports inside functions."""
    graph = _graph()
    circles = []
    for start in graph:
        stack, seen = [(start, (start,))], set()
        while stack:
            module, path = stack.pop()
            for imported in graph.get(module, ()):
                if imported == start:
                    circles.append(" -> ".join((*path, start)))
                elif imported not in seen:
                    seen.add(imported)
                    stack.append((imported, (*path, imported)))
    assert not circles, circles


# The floors of the layout, lowest first: a module imports only from its own floor and below.
# A rank (worker/) and tensor parallelism (distributed/) never reach the request lifecycle
# (engine/), the fronts (llm, server/, bench/) or each other's callers.
FLOORS = (
    ("nanoserve.openmp", "nanoserve.errors", "nanoserve.machine", "nanoserve.huge_pages", "nanoserve.config",
     "nanoserve.sampling_params", "nanoserve.pooling_params", "nanoserve.tokenizer", "nanoserve.quant",
     "nanoserve.multimodal.limits", "nanoserve.multimodal.images"),
    ("nanoserve.native",),
    ("nanoserve.model", "nanoserve.multimodal"),
    ("nanoserve.distributed",),
    ("nanoserve.loading",),
    ("nanoserve.worker",),
    ("nanoserve.engine",),
    ("nanoserve.llm", "nanoserve.server", "nanoserve.bench", "nanoserve.__main__"),
)


def _floor(module: str) -> int:
    if module == "nanoserve":
        return 0  # the package imports only openmp: its front-door names load lazily, by string
    for level, prefixes in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    raise AssertionError(f"{module} stands on no floor of the layout: add it to FLOORS")


def test_every_module_imports_only_its_own_floor_and_below():
    upward = sorted(f"{module} -> {imported}" for module, imports in _graph().items()
                    for imported in imports if _floor(imported) > _floor(module))
    assert not upward, upward
