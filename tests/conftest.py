"""Test set-up, shared with the other test tree: see tests/gpu_marker.py."""

from gpu_marker import pytest_collection_modifyitems, stand_ins_under_a_sanitizer  # noqa: F401
