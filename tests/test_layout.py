"""Imports point one way: server -> engine -> executor -> worker -> models -> layers ->
kernels. The engine's plain-data modules (request.py, step.py, info.py) and config.py are
the shared vocabulary every layer may import."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "tpserve"
SHARED = {"tpserve.engine.request", "tpserve.engine.step", "tpserve.engine.info",
          "tpserve.config", "tpserve.errors"}
# package -> packages it must not import (directly, at run time)
FORBIDDEN = {
    "engine": ("tpserve.executor", "tpserve.worker", "tpserve.server", "tpserve.cluster",
               "tpserve.models", "tpserve.layers"),
    "executor": ("tpserve.server", "tpserve.engine.engine", "tpserve.engine.async_engine"),
    "worker": ("tpserve.server", "tpserve.executor", "tpserve.engine.engine",
               "tpserve.engine.async_engine", "tpserve.engine.scheduler"),
    "models": ("tpserve.worker", "tpserve.executor", "tpserve.engine.engine", "tpserve.server"),
}


def _runtime_imports(path: Path) -> set[str]:
    """Modules imported by a file, skipping `if TYPE_CHECKING:` blocks (annotations only)."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and getattr(node.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(node)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package):
    bad = []
    for path in sorted((ROOT / package).glob("*.py")):
        for mod in _runtime_imports(path) - SHARED:
            if mod.startswith(FORBIDDEN[package]):
                bad.append(f"{path.name} imports {mod}")
    assert not bad, f"tpserve/{package}: " + "; ".join(bad)


def test_engine_modules_import_no_torch():
    code = ("import sys, tpserve.engine.engine, tpserve.engine.async_engine, "
            "tpserve.executor.base; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
