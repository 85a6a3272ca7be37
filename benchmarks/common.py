"""What the benchmark scripts share: timing a GPU call from CUDA-graph replays."""

from __future__ import annotations

import statistics

import torch


def time_graph(fn, reps: int = 15) -> float:
    """Median GPU seconds of one call of ``fn``: captured once in a CUDA graph (so Python's launch
    cost leaves no gaps between its kernels), replayed ``reps`` times, timed with CUDA events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside capture: compiles, builds the region tables
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del graph
    return statistics.median(times)


__all__ = ["time_graph"]
