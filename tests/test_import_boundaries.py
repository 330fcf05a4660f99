"""Import boundaries, read from the source with `ast` (docs/architecture.md, "Processes").

- A process folder (router, model_infer, detokenizer) imports its own modules, the libraries (shm,
  kernels) and the words every process shares (SHARED); never another process folder's modules or
  the HTTP front's. The libraries import only SHARED and themselves. The launcher side of
  lightserve/ imports a process folder's modules only where LAUNCHER_IMPORTS says why.
- Within lightserve/, only the app module (api_server) imports a route module (one with an
  ApiRouter): shared helpers live below both.
- No import cycle among the project's modules (imports under `if TYPE_CHECKING:` do not run and do
  not count).
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# folder -> package it installs as (setup.py's package_dir)
FOLDERS = {"lightserve": "lightserve", "router": "lightserve.router", "model_infer": "lightserve.model_infer",
           "detokenizer": "lightserve.detokenizer", "shm": "lightserve.shm", "kernels": "lightserve.kernels"}
PROCESSES = ("lightserve.router", "lightserve.model_infer", "lightserve.detokenizer")
LIBRARIES = ("lightserve.shm", "lightserve.kernels")
# The words every process shares: settings, messages, sampling params, logging, the child-process
# harness and the debug knobs. (config names the tool/reasoning parsers to validate its flags; rank 0's
# grammar waits out the reasoning by the reasoning parser's own tags and rule.)
# lightserve.model_config: the model facts, read once by the launcher and carried in the resolved config.
SHARED = frozenset({"lightserve", "lightserve.config", "lightserve.messages", "lightserve.sampling", "lightserve.log",
                    "lightserve.procutil", "lightserve.envs", "lightserve.reasoning_parsers",
                    "lightserve.model_config"})
# Launcher-side modules of lightserve/ that import a process folder's module, and why: the launcher
# starts each process's entry function, and reads the model folder through its family's module (the
# config, and whether --tp can split the weights) before any process runs.
LAUNCHER_IMPORTS = {
    "lightserve.engine_procs": {"lightserve.router.process", "lightserve.model_infer.process",
                                "lightserve.detokenizer.process", "lightserve.model_infer.models"},
}
APP_MODULE = "lightserve.api_server"


def _modules() -> dict[str, ast.Module]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = ast.parse(path.read_text(), str(path))
    return out


MODULES = _modules()


def _imports(name: str, tree: ast.Module) -> set[str]:
    """The project modules `name` imports at run time (function-level imports included)."""
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node.test)
            for stmt in node.body for n in ast.walk(stmt)}
    package = name if tree_is_package(name) else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from . import x`, `from ..y import x`
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            submodules = {f"{base}.{a.name}" for a in node.names} & MODULES.keys()  # `from pkg import module`
            found |= submodules
            if len(submodules) < len(node.names):  # also names defined in `base` itself
                found.add(base)
    return {m for m in found if m in MODULES and m != name}


def tree_is_package(name: str) -> bool:
    return any(m.startswith(name + ".") for m in MODULES)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
           (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _home(module: str) -> str:
    for package in (*PROCESSES, *LIBRARIES):
        if module == package or module.startswith(package + "."):
            return package
    return "lightserve"


GRAPH = {name: _imports(name, tree) for name, tree in MODULES.items()}


def test_process_folders_and_libraries_keep_to_their_rooms():
    bad = []
    for name, deps in GRAPH.items():
        home = _home(name)
        for dep in deps:
            if dep in SHARED or _home(dep) == home:
                continue
            if home in PROCESSES and _home(dep) in LIBRARIES:
                continue
            if home == "lightserve" and (_home(dep) in LIBRARIES or dep in LAUNCHER_IMPORTS.get(name, ())):
                continue
            bad.append(f"{name} imports {dep}")
    assert not bad, "\n".join(sorted(bad))


def test_the_shared_modules_import_no_process_folder():
    bad = [f"{name} imports {dep}" for name in SHARED for dep in GRAPH[name] if _home(dep) != "lightserve"]
    assert not bad, "\n".join(bad)


def test_only_the_app_module_imports_route_modules():
    routes = {name for name, tree in MODULES.items()
              if _home(name) == "lightserve" and name != APP_MODULE and _defines_api_router(tree)}
    assert {"lightserve.openai_api", "lightserve.lightllm_api", "lightserve.ops_api"} <= routes
    bad = [f"{name} imports {dep}" for name, deps in GRAPH.items() if name != APP_MODULE
           for dep in deps if dep in routes]
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(GRAPH[name]):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, [*path, dep])
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(cycles)


def _defines_api_router(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
               and isinstance(node.value.func, ast.Name) and node.value.func.id == "ApiRouter"
               for node in tree.body)
