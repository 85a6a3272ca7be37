"""kv_ops's floors: the op floor never imports the engine floor (kv_ops/transfer/) or the tools,
and the engine floor never imports the tools; checked in the source and in a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import kv_ops

PACKAGE = Path(kv_ops.__file__).resolve().parent
ROOT = PACKAGE.parent
OP_FLOOR = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
TRANSFER = sorted(p.stem for p in (PACKAGE / "transfer").glob("*.py") if p.stem != "__init__")
ABOVE = {
    "op": ("kv_ops.transfer", "kv_ops.tools", "kv_ops.integrations"),
    "transfer": ("kv_ops.tools", "kv_ops.integrations"),
}


def _imports(path: Path, package: str) -> set[str]:
    """Every module ``path`` imports, anywhere in it (lazy imports too), as absolute names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize(
    ("floor", "path", "package"),
    [("op", PACKAGE / f"{m}.py", "kv_ops") for m in OP_FLOOR]
    + [("transfer", PACKAGE / "transfer" / f"{m}.py", "kv_ops.transfer") for m in TRANSFER],
    ids=lambda v: v.name if isinstance(v, Path) else None,
)
def test_no_import_runs_up_a_floor(floor, path, package):
    up = sorted(name for name in _imports(path, package) if name.startswith(ABOVE[floor]))
    assert up == [], f"{path.relative_to(ROOT)} imports {up}, above its floor"


def test_the_op_floor_imports_and_registers_its_ops_without_the_engine_floor():
    # kv_ops/__init__.py imports both floors, so stand in a bare package for it and import the
    # op floor's modules alone.
    code = f"""
import importlib, sys, types, torch
package = types.ModuleType("kv_ops")
package.__path__ = [{str(PACKAGE)!r}]
sys.modules["kv_ops"] = package
for name in {OP_FLOOR!r}:
    importlib.import_module("kv_ops." + name)
up = sorted(m for m in sys.modules if m.startswith({ABOVE["op"]!r}))
assert not up, up
for op in ("copy_blocks", "gather_blocks", "scatter_blocks"):
    getattr(torch.ops.kv_ops, op)
print("OK")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip() == "OK"
