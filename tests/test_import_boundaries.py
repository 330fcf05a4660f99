"""Import boundaries, read from the source with `ast` (docs/architecture.md, "Processes" and "The launcher's
folders").

- A process folder (router, model_infer, detokenizer) imports its own modules, the libraries (shm,
  kernels) and the words every process shares (SHARED); never another process folder's modules or
  the rest of lightserve/. The libraries import only SHARED and themselves. The launcher side of
  lightserve/ imports a process folder's modules only where LAUNCHER_IMPORTS says why.
- lightserve/ itself is folders with rules (FOLDER_RULES): http/ may import chat/ and the engine's
  client side (ENGINE_CLIENT), never the reverse; chat/ and engine/ import only the shared words (and
  the libraries); nothing imports http/ but the launcher, which serves the app. The shared words
  import only one another, and lightserve/'s top holds only them and the launch's entry modules.
- Within http/, only the app module imports a route module (one with an ApiRouter): shared helpers
  live below both.
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
# harness, the debug knobs and the model's facts (read once by the launcher, carried in the resolved
# config). And chat/'s parser registries with the base they stand on: config names the tool and
# reasoning parsers to check its flags, and rank 0's grammar waits out the reasoning by the reasoning
# parser's own tags and rule. And the LoRA adapter reader: the front validates an adapter with it before
# accepting it, and each worker reads the adapter with it. And the tokenizer loader: the front, the
# detokenizer (its cached decoder), rank 0's grammar and the offline pipeline load the model's tokenizer alike.
SHARED = frozenset({"lightserve.config", "lightserve.messages", "lightserve.sampling", "lightserve.log",
                    "lightserve.procutil", "lightserve.envs", "lightserve.model_config",
                    "lightserve.chat.tool_call", "lightserve.chat.tool_parsers", "lightserve.chat.reasoning_parsers",
                    "lightserve.lora_adapter", "lightserve.hf_tokenizer"})
# The rest of lightserve/'s top: the launch's entry modules. The package itself (the pipeline's public
# names), the server launcher, the offline pipeline, the config's resolution and its command line.
ENTRIES = frozenset({"lightserve", "lightserve.launch_server", "lightserve.pipeline", "lightserve.resolve_config",
                     "lightserve.cli"})
# What the HTTP front may use of the engine: the client and what a request's run gives its caller.
ENGINE_CLIENT = ("lightserve.engine.client", "lightserve.engine.generation", "lightserve.engine.adapters")
# lightserve/'s folders (its top is "lightserve") and what each may import besides itself, the shared
# words and the libraries.
FOLDER_RULES = {
    "lightserve.chat": (),
    "lightserve.engine": (),
    "lightserve.http": ("lightserve.chat", *ENGINE_CLIENT),
    "lightserve": ("lightserve.chat", "lightserve.engine"),
}
# The one module outside http/ that imports it: the launcher starts the app.
HTTP_LAUNCHER = "lightserve.launch_server"
# Launcher-side modules of lightserve/ that import a process folder's module, and why: the launcher
# starts each process's entry function, and reads the model folder through its family's module (the
# config, and whether --tp can split the weights) before any process runs.
LAUNCHER_IMPORTS = {
    "lightserve.engine.procs": {"lightserve.router.process", "lightserve.model_infer.process",
                                "lightserve.detokenizer.process"},
    "lightserve.resolve_config": {"lightserve.model_infer.models"},
}
APP_MODULE = "lightserve.http.app"


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
    """The process folder or library a module belongs to, else "lightserve"."""
    for package in (*PROCESSES, *LIBRARIES):
        if module == package or module.startswith(package + "."):
            return package
    return "lightserve"


def _folder(module: str) -> str:
    """The folder of lightserve/ a module of it sits in: a key of FOLDER_RULES."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or module in FOLDER_RULES else "lightserve"


def _within(module: str, targets: tuple[str, ...]) -> bool:
    return any(module == t or module.startswith(t + ".") for t in targets)


GRAPH = {name: _imports(name, tree) for name, tree in MODULES.items()}
OWN = {name for name in MODULES if _home(name) == "lightserve"}  # lightserve/'s modules


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


def test_lightserve_folders_keep_to_their_rules():
    def allowed(name: str, dep: str) -> bool:
        folder = _folder(name)
        if dep in SHARED or _folder(dep) == folder or _within(dep, FOLDER_RULES[folder]):
            return True
        return name == HTTP_LAUNCHER and _folder(dep) == "lightserve.http"

    bad = [f"{name} ({_folder(name)}) imports {dep}" for name in sorted(OWN - SHARED)
           for dep in sorted(GRAPH[name] & OWN) if not allowed(name, dep)]
    assert not bad, "\n".join(bad)


def test_nothing_imports_http_but_the_launcher():
    bad = [f"{name} imports {dep}" for name, deps in GRAPH.items() if _folder(name) != "lightserve.http"
           and name != HTTP_LAUNCHER for dep in deps if dep in OWN and _folder(dep) == "lightserve.http"]
    assert not bad, "\n".join(sorted(bad))


def test_the_shared_words_import_only_one_another():
    bad = [f"{name} imports {dep}" for name in sorted(SHARED) for dep in GRAPH[name] if dep not in SHARED]
    assert not bad, "\n".join(bad)


def test_lightserve_holds_only_its_folders_shared_words_and_entries():
    assert SHARED | ENTRIES <= OWN, sorted((SHARED | ENTRIES) - OWN)
    top = {name for name in OWN if _folder(name) == "lightserve"}
    assert top <= SHARED | ENTRIES, \
        f"give each a folder, or a place in SHARED or ENTRIES: {sorted(top - SHARED - ENTRIES)}"
    assert {_folder(name) for name in OWN} == set(FOLDER_RULES)


def test_only_the_app_module_imports_route_modules():
    routes = {name for name, tree in MODULES.items()
              if name in OWN and name != APP_MODULE and _defines_api_router(tree)}
    assert {"lightserve.http.openai_api", "lightserve.http.lightllm_api", "lightserve.http.ops_api"} <= routes
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
