"""The capture guard: one refusal of work during CUDA-graph capture, asked in one place; and the
ops' own captures."""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path

import pytest
import torch

import kv_ops
from kv_ops.cuda import capture
from kv_ops.cuda.capture import capturing, refuse_capture

ROOT = Path(kv_ops.__file__).resolve().parents[1]


def test_refusal_names_who_what_and_instead_while_capturing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"^op: the copy cannot be captured; do this instead$"):
        refuse_capture("op", "the copy cannot be captured", "do this instead")
    with pytest.raises(KeyError):
        refuse_capture("op", "what", "instead", error=KeyError)


def test_nothing_is_refused_outside_a_capture_or_for_a_cpu_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    refuse_capture("op", "what", "instead")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not capturing(torch.device("cpu"))
    refuse_capture("op", "what", "instead", device=torch.device("cpu"))


def test_only_the_guard_asks_torch_whether_a_capture_runs():
    askers = [
        str(p.relative_to(ROOT))
        for package in ("kv_ops", "ple_ops")
        for p in sorted((ROOT / package).rglob("*.py"))
        if "is_current_stream_capturing()" in p.read_text() and p.name != "capture.py"
    ]
    assert askers == [], f"ask kv_ops.cuda.capture instead: {askers}"


class RecordingGraph:
    """What captured_into asks of a graph; records whether the collector could run meanwhile."""

    def __init__(self):
        self.seen = []

    def capture_begin(self, capture_error_mode):
        self.seen.append(("begin", capture_error_mode, gc.isenabled()))

    def capture_end(self):
        self.seen.append(("end", gc.isenabled()))


@pytest.mark.parametrize("raises", [False, True])
def test_the_ops_own_captures_run_thread_local_with_the_collector_off_and_restore_it(raises):
    # A collection inside a capture may destroy an old CUDAGraph, whose teardown frees memory:
    # the driver refuses that during a capture, and the capture is invalidated.
    graph = RecordingGraph()
    assert gc.isenabled()
    with pytest.raises(ValueError) if raises else contextlib.nullcontext():
        with capture.captured_into(graph):
            graph.seen.append(("inside", gc.isenabled()))
            if raises:
                raise ValueError("the captured work failed")
    assert graph.seen == [("begin", "thread_local", False), ("inside", False), ("end", False)]
    assert gc.isenabled()
    gc.disable()  # a caller that had it off keeps it off
    try:
        with capture.captured_into(RecordingGraph()):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
