"""benchmarks/timeline.py: interval arithmetic against a unit-cell count, and, on a GPU, the
kernels a profiled run launched, a replayed CUDA graph's included."""

import gzip
import json
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import timeline  # noqa: E402

spans = st.lists(
    st.tuples(st.integers(0, 60), st.integers(1, 20)).map(lambda t: (float(t[0]), float(t[0] + t[1]))), max_size=12
)


def cells(intervals) -> set[int]:
    """The unit cells ``[i, i + 1)`` that integer intervals cover: the oracle."""
    return {i for start, end in intervals for i in range(int(start), int(end))}


@given(spans)
def test_length_is_the_cells_the_intervals_cover(a):
    assert timeline.length(a) == len(cells(a))
    merged = timeline.union(a)
    assert all(e1 < s2 for (_, e1), (s2, _) in zip(merged, merged[1:]))  # disjoint, in order
    assert cells(merged) == cells(a)


@given(spans, spans)
def test_overlap_is_the_cells_both_cover(a, b):
    assert timeline.overlap(a, b) == len(cells(a) & cells(b))


@given(spans, spans)
def test_busy_splits_the_kernels_by_name(copies, others):
    kernels = [("_prefix_copy_kernel", s, e) for s, e in copies] + [("ampere_gemm", s, e) for s, e in others]
    got = timeline.busy(kernels)
    assert got["copies"] == len(cells(copies)) and got["others"] == len(cells(others))
    assert got["both"] == len(cells(copies) & cells(others))
    every = copies + others
    assert got["span"] == (max(e for _, e in every) - min(s for s, _ in every) if every else 0.0)


def test_load_spans_groups_the_copies_by_step_in_start_order():
    # Two steps of three loads, given out of order, claims and model kernels between them, and a
    # third step cut short: its one copy is left out.
    copies = [(0.0, 2.0), (2.0, 4.0), (5.0, 7.0), (20.0, 21.0), (21.5, 23.0), (22.0, 24.0), (40.0, 41.0)]
    kernels = [("_prefix_copy_kernel", s, e) for s, e in reversed(copies)]
    kernels += [("_claim_kernel", s - 0.5, s) for s, _ in copies] + [("gemm", 1.0, 30.0)]
    assert timeline.load_spans(kernels, 3) == [7.0, 4.0]
    with pytest.raises(ValueError, match=r"loads must be >= 1, got 0"):
        timeline.load_spans(kernels, 0)


@given(st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 100)), max_size=30), st.integers(1, 5))
def test_a_steps_load_span_covers_its_copies_busy_time(raw, loads):
    kernels = [("_prefix_copy_kernel", float(s), float(s + d)) for s, d in raw]
    spans = timeline.load_spans(kernels, loads)
    assert len(spans) == len(kernels) // loads
    ordered = sorted((s, e) for _, s, e in kernels)
    for i, span in enumerate(spans):
        assert span >= timeline.length(ordered[i * loads : (i + 1) * loads])


def test_per_step_refuses_a_long_run_not_longer_than_the_short_one():
    with pytest.raises(ValueError, match=r"long \(4\) must be over short \(4\)"):
        timeline.per_step(lambda n: None, 4, 4)


@pytest.mark.gpu
def test_on_a_gpu_the_kernels_of_a_replayed_cuda_graph_are_in_the_trace(tmp_path):
    a = torch.randn(2048, 2048, device="cuda")
    out = torch.full_like(a, float("nan"))
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # The relu is a kernel of its own (a bare copy_ would be a memcpy node, which is no kernel).
        out.copy_((a @ a).relu())  # warm-up: cuBLAS's workspace outside the capture
        with torch.cuda.graph(graph):
            out.copy_((a @ a).relu())
    torch.cuda.current_stream().wait_stream(side)
    out.fill_(float("nan"))
    eager = timeline.kernels_of(lambda: a.mul_(1.0))
    kept = tmp_path / "kernels.json.gz"
    replayed = timeline.kernels_of(graph.replay, kept)
    with gzip.open(kept, "rt") as f:
        assert [(k["name"], k["ts"], k["ts"] + k["dur"]) for k in json.load(f)] == replayed
    assert len(eager) == 1 and eager[0][2] > eager[0][1]
    assert len(replayed) >= 2, replayed  # the matmul and the relu, each reported from the graph
    # The replay ran (out was poisoned); eagerly cuBLAS may pick another algorithm: close, not equal.
    torch.testing.assert_close(out, (a @ a).relu())
    got = timeline.busy(replayed)
    assert 0 < got["others"] <= got["span"] and got["copies"] == 0
