"""Dependencies point one way: ``tree`` and ``verify`` import no model code (docs/design.md §4)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import ddspec

PACKAGE = Path(ddspec.__file__).resolve().parent
FORBIDDEN = ("ddspec.models", "ddspec.draft", "ddspec.engine", "transformers")
ALLOWED_DDSPEC = ("ddspec.config", "ddspec.sampling", "ddspec.errors", "ddspec.tree", "ddspec.verify")


def _is_under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_importing_tree_and_verify_loads_no_model_code():
    code = "import sys, json, ddspec.tree, ddspec.verify; print(json.dumps(sorted(sys.modules)))"
    path = os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    loaded = json.loads(result.stdout)
    assert "ddspec.tree" in loaded and "ddspec.verify" in loaded
    assert [m for m in loaded if _is_under(m, FORBIDDEN)] == []


def _imports(path: Path) -> list[str]:
    """Absolute module names a source file imports (relative imports resolved in the package)."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                names.append(f"{base}.{node.module}" if node.module else base)
            else:
                names.append(node.module)
    return names


def test_tree_and_verify_sources_import_only_torch_stdlib_and_allowed_ddspec_modules():
    files = sorted((PACKAGE / "tree").glob("*.py")) + sorted((PACKAGE / "verify").glob("*.py"))
    assert len(files) >= 7
    for path in files:
        for name in _imports(path):
            top = name.split(".")[0]
            allowed = (
                top in sys.stdlib_module_names
                or top == "torch"
                or _is_under(name, ALLOWED_DDSPEC)
            )
            assert allowed, f"{path.relative_to(PACKAGE)} imports {name}"


def _module_graph() -> dict[str, set[str]]:
    """ddspec module -> the ddspec modules it imports anywhere in its source (lazy imports too)."""
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in files.items():
        deps = set()
        for imported in _imports(path):
            while imported and imported not in files:  # `from ddspec.x import y` with y not a module
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                deps.add(imported)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle():
    """Lazy (function-level) imports count: a cycle of them is still a tangle (calibrate, cli,
    commands and methods once imported each other in a circle)."""
    graph = _module_graph()
    assert {"ddspec.cli", "ddspec.args", "ddspec.commands", "ddspec.methods", "ddspec.calibrate"} <= set(graph)
    assert _cycles(graph) == []


def test_cycle_detection_finds_a_planted_cycle():
    graph = _module_graph()
    graph["ddspec.calibrate"] = graph["ddspec.calibrate"] | {"ddspec.cli"}
    assert any("ddspec.calibrate" in c and "ddspec.cli" in c for c in _cycles(graph))


def test_argument_definitions_reach_no_command():
    graph = _module_graph()
    for low in ("ddspec.args", "ddspec.methods", "ddspec.calibrate"):
        assert not graph[low] & {"ddspec.cli", "ddspec.commands"}, f"{low} imports a command module"


def test_the_kernels_and_their_measurements_import_no_model_code():
    """The C kernels (ddspec.native and its parts) and the measure-once cache (ddspec.measured) sit
    below the models: models tune the kernels (models/tuning.py), never the reverse."""
    graph = _module_graph()
    low = [m for m in graph if _is_under(m, ("ddspec.native", "ddspec.measured", "ddspec.machine"))]
    assert {"ddspec.native.build", "ddspec.native.lib", "ddspec.native.tuning", "ddspec.measured"} <= set(low)
    for module in low:
        assert not [d for d in graph[module] if _is_under(d, FORBIDDEN)], f"{module} imports model code"
