"""Packaging: the declared torch floor holds and matches the import-time check, and the built
wheel installs and imports from outside the tree, typed and versioned."""

import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _version(text: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", text).groups()
    return int(major), int(minor)


def _declared_floor() -> tuple[int, int]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (torch_req,) = [d for d in project["dependencies"] if d.startswith("torch")]
    return _version(re.match(r"torch>=([\d.]+)$", torch_req).group(1))


def test_installed_torch_meets_the_declared_floor_and_the_import_check_agrees():
    import kv_ops

    assert _version(torch.__version__) >= _declared_floor(), f"torch {torch.__version__} < declared {_declared_floor()}"
    assert kv_ops.TORCH_FLOOR == _declared_floor()


def test_both_packages_import_and_export_what_they_declare():
    import kv_ops
    import ple_ops

    for module in (kv_ops, ple_ops):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.__all__ names missing {name}"
    # Registered at import: each resolves (a library op appears in dir() only once looked up).
    for op in ("copy_blocks", "gather_blocks", "scatter_blocks"):
        assert hasattr(torch.ops.kv_ops, op), f"torch.ops.kv_ops.{op} is not registered"


def test_the_wheel_installs_and_imports_from_outside_the_tree(tmp_path):
    wheels, target, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "cwd"
    elsewhere.mkdir()
    build = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(wheels),
        str(ROOT),
    ]
    subprocess.run(build, check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("offload_ops-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    # Every module of every declared package ships, so a subpackage missing from pyproject.toml's
    # list (setuptools would leave it out silently) fails here.
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    on_disk = sorted(
        ".".join(p.parent.relative_to(ROOT).parts)
        for top in ("kv_ops", "ple_ops")
        for p in (ROOT / top).rglob("__init__.py")
    )
    assert sorted(declared) == on_disk, (
        "pyproject.toml's [tool.setuptools] packages differ from the packages in the tree"
    )
    modules = {
        str(p.relative_to(ROOT)) for package in declared for p in (ROOT / package.replace(".", "/")).glob("*.py")
    }
    missing = sorted((modules | {"kv_ops/py.typed", "ple_ops/py.typed"}) - names)
    assert missing == [], f"the wheel lacks {missing}"
    assert not any(n.startswith(("tests/", "compile_tests/", "examples/", "benchmarks/")) for n in names)
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)]
    subprocess.run(install, check=True, capture_output=True, timeout=300)
    probe = (
        "import kv_ops, ple_ops, pathlib;"
        "print(kv_ops.__file__); print(ple_ops.__file__); print(kv_ops.__version__, ple_ops.__version__);"
        "print(all((pathlib.Path(m.__file__).parent / 'py.typed').exists() for m in (kv_ops, ple_ops)))"
    )
    # Only the installed copy on the path, run from a directory that holds no source tree.
    env = dict(os.environ, PYTHONPATH=str(target), TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    kv_file, ple_file, versions, typed = out.stdout.split("\n")[:4]
    assert Path(kv_file).is_relative_to(target) and Path(ple_file).is_relative_to(target)
    kv_version, ple_version = versions.split()
    assert kv_version == ple_version and wheel.name.startswith(f"offload_ops-{kv_version}-")
    assert typed == "True"
