"""Test set-up, shared with the other test tree: see tests/gpu_marker.py."""

from gpu_marker import crossover_stand_in_under_a_sanitizer, pytest_collection_modifyitems  # noqa: F401
