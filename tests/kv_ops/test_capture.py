"""The capture guard: one refusal of work during CUDA-graph capture, asked in one place."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kv_ops
from kv_ops.capture import capturing, refuse_capture

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
    assert askers == [], f"ask kv_ops.capture instead: {askers}"
