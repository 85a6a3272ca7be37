"""kv_ops's floors: the CUDA floor (kv_ops/cuda/, what ple_ops stands on too) imports nothing above
it, the op floor never imports the engine floor (kv_ops/transfer/) or the tools, and the engine floor
never imports the tools; checked in the source and in a fresh interpreter."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import kv_ops

PACKAGE = Path(kv_ops.__file__).resolve().parent
ROOT = PACKAGE.parent
OP_FLOOR = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
TRANSFER = sorted(p.stem for p in (PACKAGE / "transfer").glob("*.py") if p.stem != "__init__")
CUDA = PACKAGE / "cuda"
# The CUDA floor, bottom first: each may import only the ones before it (and torch, triton, the
# standard library). The first two import no kv_ops module at all.
SHARED = ("torch_internals", "arguments", "registration", "driver", "capture", "host_memory", "launch")
BOTTOM = ("torch_internals", "arguments")
ABOVE = {
    "cuda": ("kv_ops.transfer", "kv_ops.tools", "kv_ops.integrations", *(f"kv_ops.{m}" for m in OP_FLOOR)),
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
    [("cuda", CUDA / f"{m}.py", "kv_ops.cuda") for m in SHARED]
    + [("op", PACKAGE / f"{m}.py", "kv_ops") for m in OP_FLOOR]
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


def _module_uses(path: Path, package: str) -> dict[str, set[str]]:
    """For each shared-floor module ``path`` uses, the names it takes from it: ``from .m import x``
    and ``m.x`` after ``from . import m``."""
    tree = ast.parse(path.read_text())
    used: dict[str, set[str]] = {}
    modules: dict[str, str] = {}  # local name -> shared-floor module
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            base = f"{parent}.{base}" if base else parent
        for alias in node.names:
            if base.startswith("kv_ops.cuda.") and base.removeprefix("kv_ops.cuda.") in SHARED:
                used.setdefault(base.removeprefix("kv_ops.cuda."), set()).add(alias.name)
            elif base == "kv_ops.cuda" and alias.name in SHARED:
                modules[alias.asname or alias.name] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            used.setdefault(modules[node.value.id], set()).add(node.attr)
    return used


@pytest.mark.parametrize("name", SHARED)
def test_every_name_a_shared_module_declares_exists(name):
    module = importlib.import_module(f"kv_ops.cuda.{name}")
    assert module.__all__ and len(set(module.__all__)) == len(module.__all__)
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert missing == [], f"kv_ops.cuda.{name}.__all__ names {missing}, which it does not define"
    first = (module.__doc__ or "").splitlines()[0]
    assert "ple_ops" in first or "both packages" in first, f"kv_ops.cuda.{name}'s first line says both packages use it"


def test_the_cuda_floor_is_one_package_that_says_both_packages_stand_on_it():
    assert sorted(p.stem for p in CUDA.glob("*.py") if p.stem != "__init__") == sorted(SHARED)
    import kv_ops.cuda

    assert "both packages" in kv_ops.cuda.__doc__.splitlines()[0]


@pytest.mark.parametrize("name", SHARED)
def test_the_shared_floor_imports_only_what_sits_below_it(name):
    allowed = set() if name in BOTTOM else {f"kv_ops.cuda.{m}" for m in SHARED[: SHARED.index(name)]}
    found = _imports(CUDA / f"{name}.py", "kv_ops.cuda")
    ours = sorted(m for m in found if m == "kv_ops" or m.startswith("kv_ops."))
    # "from . import driver" shows as both "kv_ops.cuda" and "kv_ops.cuda.driver"; the package itself is fine then.
    bad = [m for m in ours if m != "kv_ops.cuda" and m not in allowed and m.rsplit(".", 1)[0] not in allowed]
    assert bad == [], f"kv_ops/cuda/{name}.py imports {bad}, not below it in the CUDA floor"
    if name in BOTTOM:
        outside = sorted(m for m in found if m.split(".")[0] not in sys.stdlib_module_names | {"torch", "__future__"})
        assert outside == [], f"kv_ops/cuda/{name}.py imports {outside}: the bottom of the floor needs only torch"


def test_kv_ops_takes_only_declared_names_from_the_shared_floor():
    sources = [(p, ".".join(("kv_ops", *p.parent.relative_to(PACKAGE).parts))) for p in PACKAGE.rglob("*.py")]
    undeclared = []
    for path, package in sources:
        for name, names in _module_uses(path, package).items():
            if path.stem == name and path.parent == CUDA:
                continue
            public = set(importlib.import_module(f"kv_ops.cuda.{name}").__all__)
            undeclared += [f"{path.relative_to(ROOT)}: kv_ops.cuda.{name}.{n}" for n in sorted(names - public)]
    assert undeclared == [], "names taken from the shared floor that its __all__ does not declare"
