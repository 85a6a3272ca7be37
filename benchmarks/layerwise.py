"""Layer-wise KV loads inside a compiled, captured prefill-like step: how much of the load is hidden.

The step: ``--layers`` layers (32 by default) of Llama-3-8B's matmuls over ``--tokens`` tokens
in bf16: RMSNorm, the QKV projection ``[4096, 6144]``, the read of the layer's blocks (the
stand-in for attention, which scales the queries), the output projection ``[4096, 4096]``,
RMSNorm and the gated MLP ``[4096, 2 x 14336]``, ``[14336, 4096]``, with the residual adds.
The cache is Llama-3-8B's: per layer K/V-first ``[2, blocks, 16, 8, 128]`` bf16, so a block packs
64 KiB per layer and 2 MiB over 32 layers. The step is ``torch.compile(fullgraph=True)``, then
captured in a ``torch.cuda.CUDAGraph``, once with a ``kv_ops.wait_layer`` before each layer and
once without.

Per block count, from the host call to the end of the step (``torch.cuda.synchronize``), medians:

* ``compute``: the step alone, no load (taken in turn with ``load_then_step`` and ``layerwise``);
* ``load``: ``engine.load`` (on the path ``auto`` picks) then ``flush``: the load alone, and
  ``layerwise_copies``: ``start`` then ``flush``, the layer-wise copies alone;
* ``load_then_step``: ``engine.load``, ``flush``, then the step: what a resume costs today (the
  step with waits, and no start: they find completed events; the same graph, so the outputs
  compare bitwise);
* ``layerwise``: ``LayerwiseLoads.start`` then the step with waits;
* ``hidden``: ``(load_then_step - layerwise) / (load_then_step - compute)``, the fraction of the
  load's time that the step hid; at most ``compute / load`` (``hideable``) when the load is longer;
* ``step_vs_target``: ``layerwise / max(compute, layerwise_copies)``, 1.0 where the step takes no
  longer than the slower of its two halves; ``picked``: what ``copies="auto"`` moved the load with;
* ``start_us``: host time inside ``start``, and ``pipelined``: the layer-wise step in a loop of back-to-back steps with
  no host sync between them, where each ``start`` is issued while the previous step runs.

And once: the step with waits and a zero-block ``start`` against the step without waits (the
ops' own cost), taken in turn, on the wall clock, on GPU time, and on GPU time behind a queued
sleep (the launch hidden, as in a serving loop's queue); the steps compared share one set of
weights. Every layer-wise step's output is checked bitwise against load-then-step's.

Writes layerwise.csv, layerwise.md (also printed) and layerwise.png to --out. Needs a CUDA device.
Exits non-zero if a layer-wise step's output differs from load-then-step's.

Usage: python benchmarks/layerwise.py --out DIR [--blocks 16,64] [--copies kernel,dma,staged,auto]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import kv_ops

from common import (  # this script's own directory
    figure,
    finish,
    parse,
    parser,
    save,
    save_figure,
    table_head,
)

NAME = "benchmark-layerwise"
BLOCK_TOKENS, KV_HEADS, HEAD_DIM = 16, 8, 128  # Llama-3-8B's KV per layer and block
READS = 16  # blocks each layer reads (the stand-in for attention's read of the loaded blocks)
COLUMNS = [
    "gpu",
    "blocks",
    "hosts",
    "copies",
    "picked",
    "mib",
    "compute_us",
    "load_us",
    "load_then_step_us",
    "layerwise_us",
    "pipelined_us",
    "hidden",
    "hideable",
    "step_vs_target",
    "start_us",
    "queued_start_us",
    "load_gbps",
    "layerwise_copies_us",
    "layerwise_gbps",
    "bitwise",
]


def rms_norm(h: torch.Tensor) -> torch.Tensor:
    x = h.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)


class PrefillStep(nn.Module):
    """Per layer, Llama-3-8B's matmuls: (optionally) wait for the layer's blocks, RMSNorm, the
    QKV projection, the read of the blocks (the stand-in for attention: it scales the queries),
    the output projection, RMSNorm and the gated MLP, each with its residual add.

    ``like``: another step whose weight tensors this one uses. The steps compared with one another
    share them: the same matmuls over another copy of the same weights can differ in GPU time by
    more than the waits cost."""

    def __init__(self, caches: list[torch.Tensor], hidden: int, mlp: int, name: str | None, like=None):
        super().__init__()
        self.caches, self.name, self.hidden = caches, name, hidden  # name: the LayerwiseLoads to wait for, or none
        if like is not None:
            self.weights = like.weights
            return
        gen = torch.Generator(device="cuda").manual_seed(0)

        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, device="cuda", generator=gen).mul_(rows**-0.5).bfloat16()

        kv = hidden // 4  # Llama-3-8B: 8 KV heads of 128 beside 32 query heads
        self.weights = [
            (weight(hidden, hidden + 2 * kv), weight(hidden, hidden), weight(hidden, 2 * mlp), weight(mlp, hidden))
            for _ in caches
        ]

    def forward(self, h: torch.Tensor, read_ids: torch.Tensor) -> torch.Tensor:
        for i, (cache, (qkv, out, gate_up, down)) in enumerate(zip(self.caches, self.weights)):
            if self.name is not None:
                h = kv_ops.wait_layer(h, self.name, i, [cache])
            q = (rms_norm(h) @ qkv)[:, : self.hidden]
            q = q * cache[:, read_ids].float().mean().to(h.dtype)
            h = h + q @ out
            gate, up = (rms_norm(h) @ gate_up).chunk(2, dim=-1)
            h = h + (torch.nn.functional.silu(gate) * up) @ down
        return h


class Captured:
    def __init__(self, model: nn.Module, h: torch.Tensor, read_ids: torch.Tensor):
        self.model = model  # the graph reads its weights: they must outlive it
        compiled = torch.compile(model, fullgraph=True)
        self.h, self.read_ids = h, read_ids
        for _ in range(2):
            compiled(h, read_ids)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = compiled(h, read_ids)

    def replay(self) -> None:
        self.graph.replay()


def interleaved(fns: dict, reps: int) -> dict:
    """Median microseconds of each ``fn()`` followed by a device sync, run in turn ``reps`` times
    after one warm-up each: the long step's clock drifts by 10-20% over a run (power and heat),
    so figures that are compared with one another are taken side by side."""
    times = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    for _ in range(reps):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times[key].append((time.perf_counter() - t0) * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


def timed(fn, reps: int) -> float:
    """Median microseconds of ``fn()`` followed by a device sync, after one warm-up."""
    return interleaved({"fn": fn}, reps)["fn"]


# GPU cycles of a sleep queued ahead of a timed step (about 2 ms at 2 GHz): longer than the
# host takes to issue the step, so the step's launch is hidden as in a serving loop's queue.
COVER_CYCLES = 4_000_000


def graph_time(graphs: dict, reps: int, hide_launch: bool = False) -> dict:
    """Median GPU microseconds of each captured step, replayed in turn and timed with CUDA events
    (alternating, so that clock drift treats them alike). ``hide_launch``: each behind a queued
    sleep, so that what the host does in ``step()`` before the GPU gets work is not timed."""
    times = {k: [] for k in graphs}
    for _ in range(reps):
        for key, step in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if hide_launch:
                torch.cuda._sleep(COVER_CYCLES)
            start.record()
            step()
            end.record()
            end.synchronize()
            times[key].append(start.elapsed_time(end) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def wait_node_cost(engine, layers: list[torch.Tensor], loads, reps: int = 30) -> dict:
    """GPU time the waits add to a captured step: a short step (a small MLP per layer, tens of
    microseconds each) without and with a wait per layer after a zero-block start, on GPU time
    alone. Isolates the ops' own cost in the graph from the long step's clock drift."""
    h = torch.randn(256, 1024, device="cuda").bfloat16()
    read_ids = torch.zeros(READS, dtype=torch.int64, device="cuda")
    plain = Captured(PrefillStep(layers, 1024, 1024, None), h, read_ids)
    waiting = Captured(PrefillStep(layers, 1024, 1024, loads.name, like=plain.model), h, read_ids)
    loads.start([], [])
    t = graph_time({"plain": plain.replay, "waits": waiting.replay}, reps, hide_launch=True)
    return {
        "short_step_us": t["plain"],
        "short_step_waits_us": t["waits"],
        "per_wait_us": (t["waits"] - t["plain"]) / len(layers),
    }


def make_cache(args) -> tuple[list[int], dict[str, torch.Tensor], int]:
    """The block counts, Llama-3-8B's per-layer caches with twice the largest count of GPU blocks,
    and a block's bytes over every layer."""
    counts = [int(b) for b in args.blocks.split(",")]
    shape = (2, 2 * max(counts), BLOCK_TOKENS, KV_HEADS, HEAD_DIM)
    caches = {f"layer{i}": torch.randn(shape, device="cuda").bfloat16() for i in range(args.layers)}
    return counts, caches, 2 * BLOCK_TOKENS * KV_HEADS * HEAD_DIM * 2 * args.layers


def measure(args) -> tuple[list[dict], dict]:
    counts, caches, block_bytes = make_cache(args)
    most = max(counts)
    gpu_blocks = 2 * most
    # path="auto": load-then-step gets the engine's best path for its size (staged, for these).
    engine = kv_ops.OffloadEngine(caches, gpu_blocks, capacity_bytes=most * block_bytes)
    # Random mirror rows, written from the GPU (a CPU RNG over GiBs would take longer than the run).
    for lo in range(0, most, 64):
        rows = engine.mirror[lo : lo + 64]
        rows.copy_(torch.randint(0, 256, rows.shape, dtype=torch.uint8, device="cuda"))
    mechanisms = args.copies.split(",")
    # One instance per mechanism, each with the step captured against it (a captured step waits
    # on the events of the instance that was live at its capture).
    loads = {c: kv_ops.LayerwiseLoads(engine, f"{NAME}-{c}", copies=c) for c in mechanisms}
    layers = list(caches.values())
    h = torch.randn(args.tokens, args.hidden, device="cuda").bfloat16()
    read_ids = torch.zeros(READS, dtype=torch.int64, device="cuda")
    plain = Captured(PrefillStep(layers, args.hidden, args.mlp, None), h, read_ids)
    waiting = {
        c: Captured(PrefillStep(layers, args.hidden, args.mlp, loads[c].name, like=plain.model), h, read_ids)
        for c in mechanisms
    }
    first = mechanisms[0]

    def compute():
        plain.replay()

    def zero_block_step():
        loads[first].start([], [])
        waiting[first].replay()

    # The two in turn, rep by rep, after a warm-up of both (the clock drifts over a run): on the
    # wall clock, host call included, and on GPU time alone (the steadier of the two).
    wall = interleaved({"zero": zero_block_step, "alone": compute}, 3 * args.reps)
    on_gpu = graph_time({"zero": zero_block_step, "alone": compute}, 3 * args.reps)
    queued = graph_time({"zero": zero_block_step, "alone": compute}, 3 * args.reps, hide_launch=True)
    once = {
        "compute_us": wall["alone"],
        "zero_block_us": wall["zero"],
        "zero_block_ratio": wall["zero"] / wall["alone"],
        "zero_block_gpu_ratio": on_gpu["zero"] / on_gpu["alone"],
        "zero_block_queued_ratio": queued["zero"] / queued["alone"],
    }
    once.update(wait_node_cost(engine, layers, loads[first]))
    print(", ".join(f"{k}={v:.4g}" for k, v in once.items()), flush=True)  # before the long rows
    gen = torch.Generator().manual_seed(1)
    rows = []
    for hosts, n in [(p, n) for p in args.hosts.split(",") for n in counts]:
        if hosts == "run":  # a sequence stored to consecutive host blocks
            offset = int(torch.randint(0, most - n + 1, (1,), generator=gen))
            host_ids = list(range(offset, offset + n))
        else:
            host_ids = torch.randperm(most, generator=gen)[:n].tolist()
        gpu_ids = torch.randperm(gpu_blocks, generator=gen)[:n].tolist()  # always scattered
        read_ids.copy_(torch.tensor((gpu_ids * READS)[:READS]))

        def load(host_ids=host_ids, gpu_ids=gpu_ids):
            engine.load(host_ids, gpu_ids)
            engine.flush()

        def load_then_step():
            # The same graph as the layer-wise step's (so the outputs compare bitwise: the waits
            # bound Inductor's fusions), with no start: its waits find completed events.
            load()
            waiting[first].replay()

        def layerwise_of(c, host_ids=host_ids, gpu_ids=gpu_ids):
            def run():
                loads[c].start(host_ids, gpu_ids)
                waiting[c].replay()

            return run

        t_load = timed(load, args.reps)
        # The step alone, load-then-step and every layer-wise step, side by side: "hidden"
        # compares them with one another.
        t = interleaved(
            {"compute": compute, "lts": load_then_step, **{c: layerwise_of(c) for c in mechanisms}}, args.reps
        )
        alone, t_lts = t["compute"], t["lts"]
        load_then_step()
        torch.cuda.synchronize()
        want = waiting[first].out.clone()
        for c in mechanisms:
            lw, step, layerwise = loads[c], waiting[c], layerwise_of(c)
            before = dict(lw.starts)
            t_copies = timed(lambda h=host_ids, g=gpu_ids, lw=lw: (lw.start(h, g), engine.flush()), args.reps)
            t_lw = t[c]
            layerwise()
            torch.cuda.synchronize()
            bitwise = torch.equal(step.out.view(torch.int16), want.view(torch.int16))  # NaNs too
            starts = []
            for _ in range(args.reps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                lw.start(host_ids, gpu_ids)
                starts.append((time.perf_counter() - t0) * 1e6)
                step.replay()
            torch.cuda.synchronize()
            # Back to back: each start is issued while the step before it runs (its copies still
            # wait for that step's end: they overwrite blocks it may read). Its host time there
            # too: the one above follows a sync on the whole step, after which the host is slower.
            queued_starts = []
            t0 = time.perf_counter()
            for _ in range(args.reps):
                t1 = time.perf_counter()
                lw.start(host_ids, gpu_ids)
                queued_starts.append((time.perf_counter() - t1) * 1e6)
                step.replay()
            torch.cuda.synchronize()
            t_pipe = (time.perf_counter() - t0) * 1e6 / args.reps
            engine.flush()
            picked = "+".join(k for k, v in lw.starts.items() if v > before[k])  # auto's pick, or c itself
            hidden = (t_lts - t_lw) / (t_lts - alone) if t_lts > alone else float("nan")
            rows.append(
                dict(
                    gpu=torch.cuda.get_device_name(),
                    blocks=n,
                    hosts=hosts,
                    copies=c,
                    picked=picked,
                    mib=n * block_bytes / 2**20,
                    compute_us=alone,
                    load_us=t_load,
                    load_then_step_us=t_lts,
                    layerwise_us=t_lw,
                    pipelined_us=t_pipe,
                    hidden=hidden,
                    hideable=min(1.0, alone / t_load),
                    step_vs_target=t_lw / max(alone, t_copies),
                    start_us=statistics.median(starts),
                    queued_start_us=statistics.median(queued_starts),
                    load_gbps=n * block_bytes / t_load / 1e3,
                    layerwise_copies_us=t_copies,
                    layerwise_gbps=n * block_bytes / t_copies / 1e3,
                    bitwise=bitwise,
                )
            )
            print(
                ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()),
                flush=True,
            )
    for lw in loads.values():
        lw.close()
    engine.close()
    return rows, once


def copies(row: dict) -> str:
    """The copies cell: the mechanism, and what auto picked."""
    return f"auto ({row['picked']})" if row["copies"] == "auto" else row["copies"]


def markdown(rows: list[dict], once: dict, args) -> str:
    lines = [
        f"Step: {args.layers} layers of Llama-3-8B's matmuls (hidden {args.hidden}, QKV, output, gated MLP "
        f"{args.mlp}), {args.tokens} tokens, bf16, compiled and captured; "
        f"compute alone {once['compute_us']:.0f} us. With a wait per layer and a zero-block start: "
        f"{once['zero_block_us']:.0f} us ({once['zero_block_ratio']:.3f} of the step without waits on the wall clock, "
        f"{once['zero_block_gpu_ratio']:.3f} on GPU time, {once['zero_block_queued_ratio']:.3f} on GPU time with the "
        "launch hidden behind queued work; the two taken in turn, one set of weights). "
        f"On a short step ({args.layers} such layers of hidden 1024 and MLP 1024 over 256 tokens, GPU time of the "
        "replay, launch hidden), a wait per "
        f"layer after a zero-block start adds {once['per_wait_us']:.1f} us per layer "
        f"({once['short_step_us']:.0f} us without, {once['short_step_waits_us']:.0f} us with).",
        "",
        *table_head(
            "blocks (2 MiB):",
            "host ids",
            "copies",
            "step alone (us):",
            "load alone, GB/s:",
            "layer-wise copies alone, GB/s:",
            "load, flush, step (us):",
            "layer-wise step (us):",
            "load hidden:",
            "at most:",
            "step / max(step alone, copies alone):",
            "back-to-back step (us):",
            "host time in start, after a sync / back to back (us):",
            "bitwise",
        ),
    ]
    for r in rows:
        lines.append(
            f"| {r['blocks']} | {r['hosts']} | {copies(r)} | {r['compute_us']:.0f} | {r['load_us']:.0f}, {r['load_gbps']:.1f} "
            f"| {r['layerwise_copies_us']:.0f}, {r['layerwise_gbps']:.1f} "
            f"| {r['load_then_step_us']:.0f} | {r['layerwise_us']:.0f} "
            f"| {r['hidden']:.2f} | {r['hideable']:.2f} | {r['step_vs_target']:.2f} | {r['pipelined_us']:.0f} | {r['start_us']:.0f} / {r['queued_start_us']:.0f} "
            f"| {'yes' if r['bitwise'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    fig, (a, b) = figure(2, (12, 4.5))
    first = rows[0]["copies"], rows[0]["hosts"]
    base = [r for r in rows if (r["copies"], r["hosts"]) == first]
    blocks = [r["blocks"] for r in base]
    for key, label in (("compute_us", "compute alone"), ("load_then_step_us", "load, flush, step")):
        a.plot(blocks, [r[key] / 1e3 for r in base], "k-" if key == "compute_us" else "k--", label=label)
    for c, hosts in sorted({(r["copies"], r["hosts"]) for r in rows}):
        mine = [r for r in rows if (r["copies"], r["hosts"]) == (c, hosts)]
        xs = [r["blocks"] for r in mine]
        style = "-o" if hosts == "random" else "-^"
        a.plot(xs, [r["layerwise_us"] / 1e3 for r in mine], style, label=f"layer-wise ({c}, {hosts} host ids)")
        b.plot(xs, [r["hidden"] for r in mine], style, label=f"load hidden ({c}, {hosts} host ids)")
    a.set_ylabel("step time, ms")
    b.plot(blocks, [r["hideable"] for r in base], "k--", label="at most (compute / load)")
    b.axhline(0.8, color="tab:red", lw=0.8, label="target 0.80")
    b.set_ylabel("fraction of the load hidden")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("blocks loaded (2 MiB each)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Layer-wise loads in a captured prefill step")
    save_figure(fig, path)


def add_step_arguments(p, blocks: str, reps: int) -> None:
    """The step's shape, the block counts and host-id patterns, and the repetitions: the arguments
    this script and ``layerwise_parts.py`` share."""
    p.add_argument("--layers", type=int, default=32, help="layers of the step (default 32)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the step (default 2048)")
    p.add_argument("--hidden", type=int, default=4096, help="hidden width (default 4096)")
    p.add_argument("--mlp", type=int, default=14336, help="MLP width (default 14336)")
    p.add_argument("--blocks", default=blocks, help=f"comma-separated block counts (default {blocks})")
    p.add_argument("--reps", type=int, default=reps, help=f"repetitions per figure (default {reps})")
    p.add_argument("--hosts", default="random,run", help="host id patterns: random, and run (consecutive host blocks)")


def main() -> int:
    p = parser(__doc__)
    add_step_arguments(p, "16,64,256,512,1024", 7)
    p.add_argument("--copies", default="kernel,dma,staged,auto", help="LayerwiseLoads mechanisms to measure")
    args = parse(p, cuda=True)
    rows, once = measure(args)
    save(args.out, "layerwise", rows, COLUMNS, table=markdown(rows, once, args), plot=plot, digits=4)
    finish()
    return 0 if all(r["bitwise"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
