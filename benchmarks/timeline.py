"""Where a run's GPU time goes: the kernels of a torch.profiler trace as intervals, how long the
copy kernels and the other kernels each kept the GPU busy, and how long both ran at once."""

from __future__ import annotations

import gzip
import json
import os
import statistics
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

# The kernels that move a HostOffloadedCache's bytes (kv_ops.prefix_copy): the copy, and the
# one-program claim before it.
COPY_KERNELS = ("_prefix_copy_kernel", "_claim_kernel")

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``[start, end)`` intervals, as disjoint intervals in order."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def length(intervals: Iterable[Interval]) -> float:
    """How long the union of ``intervals`` covers."""
    return sum(end - start for start, end in union(intervals))


def overlap(a: Iterable[Interval], b: Iterable[Interval]) -> float:
    """How long the unions of ``a`` and ``b`` cover at the same time."""
    a, b = union(a), union(b)
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def busy(kernels: list[tuple[str, float, float]], copies: tuple[str, ...] = COPY_KERNELS) -> dict[str, float]:
    """From ``(name, start, end)`` kernels: the span from the first start to the last end, the time
    the copy kernels (a name that starts with one of ``copies``) kept the GPU busy, the time the
    others did, and the time both ran at once; in the kernels' unit."""
    if not kernels:
        return {"span": 0.0, "copies": 0.0, "others": 0.0, "both": 0.0}
    copy = [(s, e) for name, s, e in kernels if name.startswith(copies)]
    rest = [(s, e) for name, s, e in kernels if not name.startswith(copies)]
    span = max(e for _, _, e in kernels) - min(s for _, s, _ in kernels)
    return {"span": span, "copies": length(copy), "others": length(rest), "both": overlap(copy, rest)}


def load_spans(kernels: list[tuple[str, float, float]], loads: int, copy: str = COPY_KERNELS[0]) -> list[float]:
    """Per step, from the first start to the last end of its ``loads`` copy kernels (``copy``, in
    start order, ``loads`` to a step; an incomplete last group is left out): back to back, a
    step's loads span their busy time; a longer span is time the loads waited between them."""
    if loads < 1:
        raise ValueError(f"load_spans: loads must be >= 1, got {loads}")
    starts = sorted((s, e) for name, s, e in kernels if name.startswith(copy))
    groups = [starts[i : i + loads] for i in range(0, len(starts) - loads + 1, loads)]
    return [max(e for _, e in g) - g[0][0] for g in groups]


def kernels_of(run: Callable[[], object], keep: Path | None = None) -> list[tuple[str, float, float]]:
    """The GPU kernels ``run()`` launched, eagerly or replayed from a CUDA graph, as ``(name, start
    us, end us)``, from a torch.profiler trace (CUPTI reports the kernels a graph launch runs).
    ``keep``: a ``.json.gz`` file that gets them, with each one's stream, for a closer look."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()  # the trace holds run()'s kernels only, none queued before it
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    if keep is not None:
        with gzip.open(keep, "wt") as f:
            json.dump(
                [
                    {"name": e["name"], "ts": e["ts"], "dur": e["dur"], "stream": e.get("args", {}).get("stream")}
                    for e in kernels
                ],
                f,
            )
    return [(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels]


def per_step(
    run: Callable[[int], object], short: int, long: int, keep: Path | None = None, loads: int | None = None
) -> dict[str, float]:
    """:func:`busy` per decode step, in ms: ``run(n)`` decodes ``n`` tokens (a generate(), prefill
    included), profiled at ``short`` and at ``long``; their difference over ``long - short`` steps
    leaves the prefill out. ``keep``: where :func:`kernels_of` keeps the long run's kernels. With
    ``loads`` (copies per step), also ``loads_span``: the median of the long run's
    :func:`load_spans`, its first step (the prefill) left out."""
    if long <= short:
        raise ValueError(f"per_step: long ({long}) must be over short ({short})")
    first, second = kernels_of(lambda: run(short)), kernels_of(lambda: run(long), keep)
    a, b = busy(first), busy(second)
    got = {key: (b[key] - a[key]) / (long - short) / 1e3 for key in a}
    if loads:
        spans = load_spans(second, loads)[1:]
        got["loads_span"] = statistics.median(spans) / 1e3 if spans else None
    return got
