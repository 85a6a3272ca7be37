"""Shared by tests/ and compile_tests/ conftests: Triton's interpreter where no GPU exists (set
before any kernel module is imported), and the `gpu` marker, whose tests skip without CUDA."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
