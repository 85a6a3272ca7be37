"""ple_ops's layers, bottom up: the op floor (ple_ops/*.py), then the two transports side by side,
ple_ops/gather/ and ple_ops/runtime/ (neither imports the other); each imports only the layers below
it, and from kv_ops only the CUDA floor (kv_ops.cuda) and its gather op, by public names. Checked in the source and in a fresh interpreter."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import ple_ops

PACKAGE = Path(ple_ops.__file__).resolve().parent
ROOT = PACKAGE.parent
# Each layer, bottom up, with its folder and what it must never import.
LAYERS = {
    "op": (PACKAGE, "ple_ops", ("ple_ops.gather", "ple_ops.runtime")),
    "gather": (PACKAGE / "gather", "ple_ops.gather", ("ple_ops.runtime",)),
    "runtime": (PACKAGE / "runtime", "ple_ops.runtime", ("ple_ops.gather",)),
}
# ple_ops stands on kv_ops's CUDA floor (kv_ops.cuda) and takes only public names from it. Beyond
# the floor it uses one op, kv_ops.ops.gather_blocks (the gather transport moves rows with kv_ops's
# gather kernel, on purpose: one kernel tuned for host-to-GPU reads), and the package's version.
KV_FLOOR = "kv_ops.cuda"
KV_OPS_NAMES = {"kv_ops.ops": {"gather_blocks"}, "kv_ops": {"__version__"}}


def modules(layer: str) -> list[str]:
    folder = LAYERS[layer][0]
    return sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")


def sources() -> list[tuple[str, Path, str]]:
    """(layer, path, package) of every module, the packages' __init__ files included."""
    found = []
    for layer, (folder, package, _) in LAYERS.items():
        found += [(layer, folder / f"{m}.py", package) for m in modules(layer)]
        if layer != "op":
            found.append((layer, folder / "__init__.py", package))
    found.append(("top", PACKAGE / "__init__.py", "ple_ops"))  # imports every layer: the top, no floor
    return found


def _absolute(node: ast.ImportFrom, package: str) -> str:
    base = node.module or ""
    if node.level:
        parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        base = f"{parent}.{base}" if base else parent
    return base


def _imports(path: Path, package: str) -> set[str]:
    """Every module ``path`` imports, anywhere in it (lazy imports too), as absolute names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def IDS(value):
    return str(value.relative_to(ROOT)) if isinstance(value, Path) else None


@pytest.mark.parametrize(("layer", "path", "package"), sources(), ids=IDS)
def test_no_import_reaches_a_layer_that_is_not_below(layer, path, package):
    forbidden = LAYERS[layer][2] if layer in LAYERS else ()
    bad = sorted(name for name in _imports(path, package) if forbidden and name.startswith(forbidden))
    assert bad == [], f"{path.relative_to(ROOT)} ({layer} layer) imports {bad}"


def _kv_names(path: Path, package: str) -> list[tuple[str, str]]:
    """(kv_ops module, name) for every kv_ops name ``path`` uses: imported, or read off an imported module."""
    tree = ast.parse(path.read_text())
    used, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "kv_ops" or alias.name.startswith("kv_ops."):
                    used.append((alias.name, "*"))  # a bare module import: its every attribute is open
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            if base not in ("kv_ops", KV_FLOOR) and not base.startswith("kv_ops."):
                continue
            for alias in node.names:
                module = f"{base}.{alias.name}"
                if base == KV_FLOOR or module == "kv_ops.ops":
                    aliases[alias.asname or alias.name] = module
                    if base == KV_FLOOR:
                        continue
                used.append((base, alias.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            used.append((aliases[node.value.id], node.attr))
    return used


@pytest.mark.parametrize(("layer", "path", "package"), sources(), ids=IDS)
def test_only_the_cuda_floor_and_public_names_of_kv_ops_are_used(layer, path, package):
    bad = []
    for module, name in _kv_names(path, package):
        if module.startswith(KV_FLOOR + "."):
            ok = name in getattr(importlib.import_module(module), "__all__", ())
        else:
            ok = name in KV_OPS_NAMES.get(module, ())
        if not ok:
            bad.append(f"{module}.{name}")
    assert bad == [], f"{path.relative_to(ROOT)} uses kv_ops names outside the CUDA floor's __all__s: {bad}"


@pytest.mark.parametrize(("layer", "path", "package"), sources(), ids=IDS)
def test_every_module_says_what_it_owns_in_its_first_line(layer, path, package):
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
    assert doc and doc.splitlines()[0].strip(), f"{path.relative_to(ROOT)} has no one-line docstring"


@pytest.mark.parametrize("layer", list(LAYERS))
def test_each_layer_imports_in_a_fresh_interpreter_without_the_layers_it_must_not_reach(layer):
    # ple_ops/__init__.py imports every layer, so stand in a bare package for it and import the
    # layer's modules alone.
    package = LAYERS[layer][1]
    names = [f"{package}.{m}" for m in modules(layer)]
    code = f"""
import importlib, sys, types, torch
package = types.ModuleType("ple_ops")
package.__path__ = [{str(PACKAGE)!r}]
sys.modules["ple_ops"] = package
for name in {names!r}:
    importlib.import_module(name)
reached = sorted(m for m in sys.modules if m.startswith({LAYERS[layer][2]!r}))
assert not reached, reached
if {layer!r} == "op":
    for op in ("wait", "wait_copy", "release"):
        getattr(torch.ops.ple_ops, op)
print("OK")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip().splitlines()[-1] == "OK"
