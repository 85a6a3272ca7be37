"""Packaging: the declared torch floor holds and matches the import-time check, and the built
wheel holds every module of kv_ops and ple_ops and nothing else, and installs and imports from
outside the tree, typed and versioned."""

import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kv_ops", "ple_ops")


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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel as users get it: `python -m build` makes the sdist and, from it, the wheel (so
    nothing stale under build/ can get in), with this Python's setuptools."""
    try:
        importlib.metadata.distribution("build")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("`build` is not installed (pyproject.toml's test extra): pip install build")
    dist = tmp_path_factory.mktemp("dist")
    command = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(ROOT)]
    # Outside the checkout: its build/ folder must not answer `-m build`.
    done = subprocess.run(command, cwd=dist, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (found,) = dist.glob("offload_ops-*.whl")
    return found


def test_the_wheel_holds_every_module_and_nothing_else(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    # Every module under kv_ops/ and ple_ops/ (a subpackage that setuptools did not find, a folder
    # left out of the sdist), both py.typed markers, and nothing but the two packages and the metadata.
    modules = {str(p.relative_to(ROOT)) for top in PACKAGES for p in (ROOT / top).rglob("*.py")}
    missing = sorted((modules | {f"{top}/py.typed" for top in PACKAGES}) - names)
    assert missing == [], f"the wheel lacks {missing}"
    dist_info = wheel.name.split("-py3")[0] + ".dist-info"
    stray = sorted(n for n in names if n.split("/")[0] not in (*PACKAGES, dist_info))
    assert stray == [], f"the wheel holds files outside kv_ops/ and ple_ops/: {stray}"


def test_the_wheel_installs_and_imports_from_outside_the_tree(wheel, tmp_path):
    target, elsewhere = tmp_path / "site", tmp_path / "cwd"
    elsewhere.mkdir()
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
