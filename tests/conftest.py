"""Test set-up, shared with the other test tree: see tests/gpu_marker.py."""

from gpu_marker import pytest_collection_modifyitems  # noqa: F401
