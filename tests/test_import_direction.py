"""Dependencies point one way: ``tree`` and ``verify`` import no model code (DESIGN.md §4)."""

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
