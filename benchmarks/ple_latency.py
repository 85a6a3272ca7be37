"""PLE offload on the GPU: wait+pull latency, pull bandwidth, and the decode-step overhead.

* latency: the host-flag ping-pong (CPU stores flag A; the stream, already waiting on A, writes
  flag B; the CPU sees B) is the floor. One wait+pull of k rows of 16 KiB (``ple_ops.wait_copy``
  between the same wait and write) is reported as a ratio to it. Medians of 300 round trips.
  The "watched" variants arm the layer with a waiting word, as ``OffloadRuntime`` does: the pull
  first writes it (one more ``cuStreamWriteValue32``), and a release first waits for the flag and
  clears the word (one more wait, one more write). ``extra_us`` is the watched p50 minus the plain
  p50 of the same work: what the no-hang protocol costs a step, per layer.
* bandwidth: ``wait_copy`` of 1..8192 rows of 16 KiB with the flag already raised, against a
  contiguous pinned memcpy of the same bytes, all captured in a CUDA graph and timed by replay.
  A captured pull is a wait kernel and then either the copy kernel or a memcpy node (the copy
  engine), by size (``ple_ops.kernels.COPY_ENGINE_FROM``); both routes are timed at every size,
  the ratio column is the route the default picks, and the crossover is where the two meet.
* decode step: a 3-layer model whose PLE tables sit on the GPU, against the same model served
  by ``OffloadRuntime``; both captured in a CUDA graph, one replay + sync per step (the offload
  step adds prepare and the waits on the offload process).

Writes ple_latency.csv, ple_latency.md (the table, also printed) and ple_latency.png to --out.
Needs a CUDA device.

Usage: python benchmarks/ple_latency.py --out DIR
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from torch import nn

import ple_ops
from ple_ops import kernels

from common import (  # this script's own directory
    columns,
    figure,
    finish,
    parse,
    parser,
    save,
    save_figure,
    table_head,
    time_graph,
)

VOCAB, DIM, LAYERS = 1000, 64, 3


class TablePle(ple_ops.PleOffloadLayer):
    """One layer's per-layer-embedding table: rows are ``table[input_ids]``."""

    def __init__(self, layer: int):
        super().__init__()
        gen = torch.Generator().manual_seed(1000 + layer)  # seeded: both processes build the same table
        self.table = nn.Parameter(torch.randn(VOCAB, DIM, generator=gen), requires_grad=False)

    def forward_impl(self, input_ids):
        return self.table[input_ids.to(self.table.device)]


class TinyModel(nn.Module):
    """Three layers, each adding its PLE rows to a projected hidden state."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.projs = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(LAYERS))
        with torch.no_grad():
            for proj in self.projs:
                proj.weight.copy_(torch.randn(DIM, DIM, generator=gen) / DIM**0.5)
                proj.bias.zero_()
        self.ples = nn.ModuleList(TablePle(i) for i in range(LAYERS))

    def forward(self, hidden, input_ids):
        for proj, ple in zip(self.projs, self.ples):
            hidden = torch.tanh(proj(hidden) + ple(hidden, input_ids))
        return hidden


def make_model():
    """The offload process builds the model with this (spawn imports this file, main guarded)."""
    return TinyModel()


ROW_BYTES = 16384


def round_trips(variants: dict, a: ple_ops.CpuGpuSemaphore, b: ple_ops.CpuGpuSemaphore, reps: int = 300) -> dict:
    """Seconds from the CPU raising ``a`` to the CPU seeing ``b`` raised by the stream.

    Each ``variants`` entry enqueues a wait on ``a``, its work, then ``b.signal()``. The variants
    take turns within every repetition, so clock and power-state drift hits them all alike.
    """
    times = {name: [] for name in variants}
    stream = torch.cuda.Stream()
    for rep in range(reps + 20):
        for name, enqueue in variants.items():
            a.host_reset()
            b.host_reset()
            with torch.cuda.stream(stream):
                enqueue()
            time.sleep(200e-6)  # let the stream park on the wait before the flag goes up
            start = time.perf_counter()
            a.host_signal()
            while b.host_value() != ple_ops.semaphore.DONE:
                if time.perf_counter() - start > 5.0:  # a benchmark must not hang either
                    raise RuntimeError("the stream never raised flag b")
            if rep >= 20:
                times[name].append(time.perf_counter() - start)
            stream.synchronize()
    return times


def latency(rows_list) -> list[dict]:
    buf = ple_ops.SharedHostBuffer(192 + max(rows_list) * ROW_BYTES)
    a = ple_ops.CpuGpuSemaphore.in_host_memory(buf.view(0, (1,), torch.int32))
    b = ple_ops.CpuGpuSemaphore.in_host_memory(buf.view(64, (1,), torch.int32))
    waiting = ple_ops.CpuGpuSemaphore.in_host_memory(buf.view(128, (1,), torch.int32))
    slot = buf.view(192, (max(rows_list), ROW_BYTES), torch.uint8)
    # The same flag and slot, armed twice: plain, and watched (with a waiting word, as a runtime arms it).
    ple_ops.arm(ple_ops.ArmedLayer("bench.ple", a, slot))
    ple_ops.arm(ple_ops.ArmedLayer("bench.watched", a, slot, waiting=waiting))
    out = torch.empty(max(rows_list), ROW_BYTES // 2, dtype=torch.bfloat16, device="cuda")
    dep = torch.empty(1, device="cuda")

    def ping():
        a.wait_done()
        b.signal()

    def pull(k, name, release=False):
        ple_ops.wait_copy(out, dep, k, name)  # the same wait on a, then the copy
        if release:
            ple_ops.release(out, name)
        b.signal()

    variants = {("ping_pong", 0): ping}
    for name, what in (("bench.ple", "wait_copy"), ("bench.watched", "wait_copy_watched")):
        variants |= {(what, k): (lambda k=k, name=name: pull(k, name)) for k in rows_list}
        variants[(what.replace("wait_copy", "wait_copy_release"), 1)] = lambda name=name: pull(1, name, release=True)
    times = round_trips(variants, a, b)
    floor = statistics.median(times[("ping_pong", 0)])
    p50 = {key: statistics.median(t) for key, t in times.items()}
    rows = []
    for (what, k), t in times.items():
        row = dict(
            kind="latency",
            what=what,
            rows=k,
            bytes=k * ROW_BYTES,
            p50_us=p50[(what, k)] * 1e6,
            p99_us=statistics.quantiles(t, n=100)[98] * 1e6,
            ratio=p50[(what, k)] / floor,
        )
        if what.endswith("_watched"):
            row["extra_us"] = (p50[(what, k)] - p50[(what.removesuffix("_watched"), k)]) * 1e6
        rows.append(row)
    ple_ops.disarm("bench.ple")
    ple_ops.disarm("bench.watched")
    buf.unlink()
    return rows


def bandwidth(rows_list) -> list[dict]:
    n_max = max(rows_list)
    buf = ple_ops.SharedHostBuffer(64 + n_max * ROW_BYTES)
    flag = ple_ops.CpuGpuSemaphore.in_host_memory(buf.view(0, (1,), torch.int32))
    flag.host_signal()  # raised: measure the pull alone
    slot = buf.view(64, (n_max, ROW_BYTES), torch.uint8)
    slot.copy_(torch.randint(0, 256, slot.shape, dtype=torch.uint8))
    ple_ops.arm(ple_ops.ArmedLayer("bench.bw", flag, slot))
    out = torch.empty(n_max, ROW_BYTES // 2, dtype=torch.bfloat16, device="cuda")
    flat_gpu = torch.empty(n_max * ROW_BYTES, dtype=torch.uint8, device="cuda")
    flat_host = torch.empty(n_max * ROW_BYTES, dtype=torch.uint8, pin_memory=True)
    dep = torch.empty(1, device="cuda")
    default = kernels.COPY_ENGINE_FROM

    def captured_pull(k: int, copy_engine_from: int) -> float:
        kernels.COPY_ENGINE_FROM = copy_engine_from  # read at capture, by ple_ops.ops
        try:
            return time_graph(lambda: ple_ops.wait_copy(out, dep, k, "bench.bw"))
        finally:
            kernels.COPY_ENGINE_FROM = default

    rows = []
    for k in rows_list:
        nbytes = k * ROW_BYTES
        base = time_graph(lambda nbytes=nbytes: flat_gpu[:nbytes].copy_(flat_host[:nbytes], non_blocking=True))
        by_kernel = captured_pull(k, nbytes + 1)
        by_copy_engine = captured_pull(k, 0)
        pull = by_kernel if nbytes < default else by_copy_engine
        rows.append(
            dict(
                kind="bandwidth",
                what="wait_copy",
                rows=k,
                bytes=nbytes,
                memcpy_gbps=nbytes / base / 1e9,
                pull_gbps=nbytes / pull / 1e9,
                ratio=base / pull,
                kernel_us=by_kernel * 1e6,
                copy_engine_us=by_copy_engine * 1e6,
                memcpy_us=base * 1e6,
                route="kernel" if nbytes < default else "copy engine",
            )
        )
    ple_ops.disarm("bench.bw")
    buf.unlink()
    return rows


def decode_step(tokens: int = 4, steps: int = 300) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    all_ids = torch.randint(0, 1000, (steps, tokens), generator=gen)
    hidden = torch.randn(tokens, 64, device="cuda")
    ids = torch.zeros(tokens, dtype=torch.long, device="cuda")

    def capture(model, release, warm_up=True):
        if warm_up:
            model(hidden, ids)
            torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(hidden, ids)
            release()
        return graph

    local = make_model().cuda()
    graph = capture(local, lambda: None)
    t_local = []
    for i in range(steps):
        start = time.perf_counter()
        ids.copy_(all_ids[i], non_blocking=True)
        graph.replay()
        torch.cuda.synchronize()
        t_local.append(time.perf_counter() - start)

    with ple_ops.OffloadRuntime(make_model, max_tokens=tokens, device="cuda") as rt:
        rt.prepare(all_ids[0])  # warm up eagerly with a prepared step ...
        rt.model(hidden, ids)
        rt.release()
        torch.cuda.synchronize()
        graph = capture(rt.model, rt.release, warm_up=False)  # ... capture with none (the runtime refuses otherwise)
        t_off = []
        for i in range(steps):
            start = time.perf_counter()
            rt.prepare(all_ids[i])
            ids.copy_(all_ids[i], non_blocking=True)
            graph.replay()
            rt.release(enqueue=False)
            torch.cuda.synchronize()
            t_off.append(time.perf_counter() - start)
    a, b = statistics.median(t_local[20:]), statistics.median(t_off[20:])
    return [
        dict(kind="decode_step", what="tables_on_gpu", rows=tokens, p50_us=a * 1e6, ratio=1.0),
        dict(kind="decode_step", what="offloaded", rows=tokens, p50_us=b * 1e6, ratio=b / a),
    ]


def plot(rows, path: Path) -> None:
    fig, (left, right) = figure(2, (11, 4))
    lat = [r for r in rows if r["kind"] == "latency" and r["what"] == "wait_copy"]
    watched = [r for r in rows if r["kind"] == "latency" and r["what"] == "wait_copy_watched"]
    floor = next(r for r in rows if r["what"] == "ping_pong")
    left.plot([r["rows"] for r in lat], [r["p50_us"] for r in lat], "o-", label="wait + pull (p50)")
    left.plot(
        [r["rows"] for r in watched], [r["p50_us"] for r in watched], "s--", label="watched: + waiting word (p50)"
    )
    left.axhline(floor["p50_us"], color="k", ls="--", label=f"ping-pong floor {floor['p50_us']:.1f} us")
    left.axhline(2 * floor["p50_us"], color="r", ls=":", label="target: 2x floor")
    left.set_xscale("log", base=2)
    left.set_xlabel("rows of 16 KiB")
    left.set_ylabel("us")
    left.legend(fontsize=8)
    bw = [r for r in rows if r["kind"] == "bandwidth"]
    right.plot([r["rows"] for r in bw], [r["memcpy_us"] / r["kernel_us"] for r in bw], "o-", label="by the copy kernel")
    right.plot(
        [r["rows"] for r in bw], [r["memcpy_us"] / r["copy_engine_us"] for r in bw], "s--", label="by the copy engine"
    )
    right.set_title("captured wait_copy: pinned memcpy time / pull time", fontsize=9)
    right.axhline(0.9, color="r", ls=":", label="target 0.90")
    right.set_xscale("log", base=2)
    right.set_xlabel("rows of 16 KiB")
    right.set_ylabel("ratio")
    right.legend(fontsize=8)
    save_figure(fig, path)


def markdown(rows: list[dict]) -> str:
    lines = table_head("measure", "rows of 16 KiB:", "value:", "ratio to baseline:")
    for r in rows:
        if r["kind"] == "latency":
            extra = f", +{r['extra_us']:.2f} us watched" if "extra_us" in r else ""
            lines.append(
                f"| {r['what']} latency p50 (p99) | {r['rows']} | {r['p50_us']:.1f} ({r['p99_us']:.1f}) us{extra} | {r['ratio']:.2f} |"
            )
        elif r["kind"] == "bandwidth":
            lines.append(
                f"| pull bandwidth ({r['route']}) | {r['rows']} | {r['pull_gbps']:.1f} GB/s (memcpy {r['memcpy_gbps']:.1f}); "
                f"kernel / copy engine / memcpy {r['kernel_us']:.1f} / {r['copy_engine_us']:.1f} / {r['memcpy_us']:.1f} us "
                f"| {r['ratio']:.2f} |"
            )
        else:
            lines.append(f"| decode step, {r['what']} (4 tokens) | - | {r['p50_us']:.1f} us | {r['ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse(parser(__doc__), cuda=True)
    rows = latency([1, 2, 4, 8, 32]) + bandwidth([1, 4, 16, 32, 64, 128, 256, 512, 1024, 4096, 8192]) + decode_step()
    save(args.out, "ple_latency", rows, columns(rows), table=markdown(rows), plot=plot)
    finish()


if __name__ == "__main__":
    main()
