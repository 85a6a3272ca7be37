"""Test set-up, shared with the other test tree: see tests/gpu_marker.py."""

from gpu_marker import stand_ins_under_a_sanitizer, pytest_collection_modifyitems  # noqa: F401
