"""The torch floor declared in pyproject.toml holds for the torch these tests run on."""

import re
import tomllib
from pathlib import Path

import torch


def _version(text: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", text).groups()
    return int(major), int(minor)


def test_installed_torch_meets_the_declared_floor():
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    (torch_req,) = [d for d in project["dependencies"] if d.startswith("torch")]
    floor = re.match(r"torch>=([\d.]+)$", torch_req).group(1)
    assert _version(torch.__version__) >= _version(floor), f"torch {torch.__version__} < declared {floor}"


def test_both_packages_import_and_export_what_they_declare():
    import kv_ops
    import ple_ops

    for module in (kv_ops, ple_ops):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.__all__ names missing {name}"
    assert {"copy_blocks", "gather_blocks", "scatter_blocks"} <= {
        op for op in dir(torch.ops.kv_ops) if not op.startswith("_")
    }
