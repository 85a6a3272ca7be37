"""Where a layer-wise step's time goes with ``copies="kernel"``: the step and the copies alone, the
two side by side without waits, the copies as one launch instead of a graph of one kernel per
layer, and the layer-wise step itself.

The step and the cache are ``layerwise.py``'s (32 layers of Llama-3-8B's matmuls over 2048
tokens, compiled and captured; blocks of 2 MiB). Per block count and host-id pattern, each case
is queued behind a GPU sleep (the host's issue hidden) and timed from one event on the caller's
stream to an event after the copies on their stream (``copy_ms``) and after the step
(``step_ms``); medians of ``--reps``, the cases taken in turn:

* ``step``: the captured step alone;
* ``copies``: ``LayerwiseLoads.start`` alone (one CUDA graph: per layer, the copy kernel on 8
  SMs and the layer's flag);
* ``one launch``: the same blocks in one launch of the same kernel over every layer (an engine
  with ``path="kernel"`` over the same cache);
* ``copies beside step`` and ``one launch beside step``: the two at once, no waits: what the
  copies and the matmuls cost each other when nothing orders them;
* ``layer-wise step``: ``start``, then the step with a wait per layer;
* ``step, matmuls leave N SMs`` and ``layer-wise step, matmuls leave N SMs`` (``--sm-carveout
  N``, default 8, the copy kernel's programs; 0 leaves them out): the same two steps compiled and
  captured with the matmuls on cuBLASLt told to target N SMs fewer
  (``torch._C._set_sm_carveout_experimental``), so the copy kernel's CTAs need not wait for a
  second wave of the matmul's persistent CTAs.

``vs_target``: ``max(copy_ms, step_ms) / max(step alone, copies alone)``. Reading the cases
together: the copies' slowdown beside the step is SM sharing; one launch against the graph is
the per-layer granularity; the layer-wise step against ``copies beside step`` is the waits'. The
carved-out steps are measured against the same target (the step alone, all SMs).

Writes layerwise_parts.csv, layerwise_parts.md (also printed) and layerwise_parts.png to --out.
Needs a CUDA device.

Usage: python benchmarks/layerwise_parts.py --out DIR [--blocks 512,1024] [--hosts random,run]
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

import kv_ops
import kv_ops.cuda.launch

from common import (  # this script's own directory
    at_least,
    figure,
    finish,
    matmuls_leave_sms,
    parse,
    parser,
    save,
    save_figure,
    table_head,
)
from layerwise import READS, Captured, PrefillStep, add_step_arguments, make_cache

NAME = "benchmark-layerwise-parts"
COVER_CYCLES = 8_000_000  # a queued sleep longer than any case's host issue (about 4 ms at 2 GHz)
COLUMNS = ["blocks", "hosts", "case", "copy_ms", "step_ms", "vs_target"]


def measure(args) -> list[dict]:
    counts, caches, block_bytes = make_cache(args)
    most = max(counts)
    gpu_blocks = 2 * most
    # Two engines over the one cache: the layer-wise loads' and a kernel-path one for one launch.
    # Their mirrors hold whatever the page-locked memory held: only time is measured here.
    layered = kv_ops.OffloadEngine(caches, gpu_blocks, capacity_bytes=most * block_bytes, path="kernel")
    single = kv_ops.OffloadEngine(caches, gpu_blocks, capacity_bytes=most * block_bytes, path="kernel")
    loads = kv_ops.LayerwiseLoads(layered, NAME, copies="kernel")
    layers = list(caches.values())
    h = torch.randn(args.tokens, args.hidden, device="cuda").bfloat16()
    read_ids = torch.zeros(READS, dtype=torch.int64, device="cuda")
    plain = Captured(PrefillStep(layers, args.hidden, args.mlp, None), h, read_ids)
    waiting = Captured(PrefillStep(layers, args.hidden, args.mlp, NAME, like=plain.model), h, read_ids)
    # The copies: the call that issues them and the stream they end on.
    graph, one = (loads.start, layered.load_stream), (single.load, single.load_stream)
    # case -> (the copies, or None; the step replayed, or None)
    cases = {
        "step": (None, plain),
        "copies": (graph, None),
        "one launch": (one, None),
        "copies beside step": (graph, plain),
        "one launch beside step": (one, plain),
        "layer-wise step": (graph, waiting),
    }
    if args.sm_carveout:
        with matmuls_leave_sms(args.sm_carveout):  # held while the steps are captured
            carved = Captured(PrefillStep(layers, args.hidden, args.mlp, None, like=plain.model), h, read_ids)
            carved_waiting = Captured(PrefillStep(layers, args.hidden, args.mlp, NAME, like=plain.model), h, read_ids)
        leave = f"matmuls leave {args.sm_carveout} SMs"
        cases[f"step, {leave}"] = (None, carved)
        cases[f"layer-wise step, {leave}"] = (graph, carved_waiting)

    def run(copy, step, host_ids, gpu_ids) -> tuple[float, float]:
        torch.cuda.synchronize()
        torch.cuda._sleep(COVER_CYCLES)
        begin = torch.cuda.Event(enable_timing=True)
        begin.record()
        copied = stepped = None
        if copy is not None:
            issue, stream = copy
            issue(host_ids, gpu_ids)  # ordered after begin: after the caller's stream so far
            copied = torch.cuda.Event(enable_timing=True)
            copied.record(stream)
        if step is not None:
            step.replay()
            stepped = torch.cuda.Event(enable_timing=True)
            stepped.record()
        torch.cuda.synchronize()
        layered.flush()
        single.flush()
        return tuple(begin.elapsed_time(e) if e is not None else float("nan") for e in (copied, stepped))

    rng = np.random.default_rng(1)
    rows = []
    for hosts in args.hosts.split(","):
        for n in counts:
            host_ids = np.arange(n) if hosts == "run" else rng.permutation(most)[:n]
            gpu_ids = rng.permutation(gpu_blocks)[:n]  # always scattered
            times = {case: [] for case in cases}
            for _ in range(args.reps + 1):  # the first round warms up
                for case, (copy, step) in cases.items():
                    times[case].append(run(copy, step, host_ids, gpu_ids))
            med = {case: tuple(statistics.median(t[i] for t in got[1:]) for i in (0, 1)) for case, got in times.items()}
            target = max(med["step"][1], med["copies"][0])
            for case, (copy_ms, step_ms) in med.items():
                ends = [t for t in (copy_ms, step_ms) if not math.isnan(t)]  # the case's ends
                rows.append(
                    dict(
                        blocks=n, hosts=hosts, case=case, copy_ms=copy_ms, step_ms=step_ms, vs_target=max(ends) / target
                    )
                )
                print(", ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    loads.close()
    layered.close()
    single.close()
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        '# Where a layer-wise step\'s time goes (copies="kernel")',
        "",
        "Milliseconds from a common start to the copies' end and to the step's end; vs target: the later end "
        "over max(step alone, copies alone).",
        "",
        *table_head("blocks (2 MiB):", "host ids", "case", "copies end (ms):", "step end (ms):", "vs target:"),
    ]
    for r in rows:
        cells = ["-" if v != v else f"{v:.2f}" for v in (r["copy_ms"], r["step_ms"])]
        lines.append(f"| {r['blocks']} | {r['hosts']} | {r['case']} | {cells[0]} | {cells[1]} | {r['vs_target']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    shapes = list(dict.fromkeys((r["blocks"], r["hosts"]) for r in rows))
    fig, axes = figure(len(shapes), (4 * len(shapes), 4), sharey=True)
    for ax, (blocks, hosts) in zip(np.atleast_1d(axes), shapes):
        mine = [r for r in rows if (r["blocks"], r["hosts"]) == (blocks, hosts)]
        ax.barh([r["case"] for r in mine], [r["vs_target"] for r in mine], color="tab:blue")
        ax.axvline(1.0, color="k", lw=0.8)
        ax.axvline(1.1, color="tab:red", lw=0.8, ls="--")
        ax.set_title(f"{blocks} blocks, {hosts} host ids", fontsize=9)
        ax.set_xlabel("later end / max(step, copies) alone")
    fig.suptitle("Where a layer-wise step's time goes (kernel copies)")
    save_figure(fig, path)


def main() -> int:
    p = parser(__doc__)
    add_step_arguments(p, "512,1024", 5)
    p.add_argument(
        "--sm-carveout",
        type=at_least(0),
        default=kv_ops.cuda.launch.NUM_PROGRAMS,
        help="also the steps with the matmuls on this many SMs fewer (default: the copy kernel's programs; 0: not)",
    )
    args = parse(p, cuda=True)
    sms = torch.cuda.get_device_properties().multi_processor_count
    if args.sm_carveout >= sms:
        p.error(f"--sm-carveout must leave the matmuls an SM: this GPU has {sms}, got {args.sm_carveout}")
    rows = measure(args)
    save(args.out, "layerwise_parts", rows, COLUMNS, table=markdown(rows), plot=plot, digits=4)
    finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
