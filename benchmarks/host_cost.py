"""Host cost per call: the host time inside every hot public call, and the time to completion.

For every call it reports, over REPS calls after WARM warm-up calls (fresh random ids each call,
drawn before any timing, distinct destinations, consecutive calls on disjoint blocks):

* host p50 / p90: ``time.perf_counter_ns()`` around the call alone, nothing synchronised inside;
  before every call the device and the engine are idle (``torch.cuda.synchronize()``, and
  ``engine.flush()``), so no backlog distorts it;
* call-to-done p50: from before the call to after ``torch.cuda.synchronize()`` (ops, baselines,
  PLE) or ``engine.flush()`` (engine store/load: "call to end of flush");
* beside two same-run baselines of the same bytes and direction, timed the same way:
  ``copy_`` -- one bare ``tensor.copy_(non_blocking=True)`` of the bytes, GPU to page-locked
  host memory for stores, back for loads (the floor); ``torch`` -- the plain-torch gather a user
  would write: ``index_select`` per region into one packed GPU buffer, then one ``copy_`` to
  page-locked host memory (store), or one ``copy_`` to the GPU, then ``index_copy_`` per region
  (load); device ids, made before timing; no host-side scatter into mirror rows. The ratios are
  host p50 / baseline host p50 and baseline call-to-done / call-to-done (a bandwidth ratio).
  ``copy_`` is measured again at each engine, after its settle (rows ``copy_`` with the engine's
  path): the engine's rows are divided by that floor, so that a host whose speed drifts during
  the run (for a whole engine's rows, say) gives honest ratios. The
  engine's store/load rows also time that ``copy_`` right before each call, in the same state
  (``copy_ just before``, column ``paired_copy_host_p50_us``): the drift within an engine's rows
  (seconds) is larger than between a call and the copy before it.

Rows (the cache: 8 layers K/V-first, ``{f"layer{i}": torch.empty(2, num_blocks, 16, 8, 256,
bfloat16)}``, 64 KiB per region, 16 regions, 1 MiB per packed block; 1, 4, 16, 64 blocks):

* ``copy_blocks`` store / load, ``gather_blocks`` (store: GPU regions to one page-locked packed
  buffer), ``scatter_blocks`` (load: packed page-locked buffer to GPU regions); eager, id checks
  on and off (``kv_ops.set_id_checks``). ids ``gpu``: int64 tensors already on the GPU; ids
  ``cpu``: int64 CPU tensors with the user's ``.to(device)`` inside the timed call (the CUDA op
  takes device ids only). Host side: 16 regions, each page-locked (``kv_ops.pinned_empty``).
* ``store`` / ``load``: ``kv_ops.OffloadEngine`` per path (kernel, staged, dma, auto; auto's picks
  beside the path, from ``engine.path_counts``) with ids as Python lists, CPU tensors and GPU
  tensors; a call that raises ValueError is recorded as ``refused``. The engine's id checks are
  its own, as it comes (checks ``engine``). Each engine first runs untimed store/flush pairs for
  ``SETTLE_S`` seconds (on the GPU; none with ``--quick``).
* regimes: the ``store`` / ``load`` rows with list ids again, each call preceded (after the
  flush and sync) by what a serving loop does between its calls: ``list, after GPU work`` -- a
  ``torch.cuda._sleep`` of about 1.5 ms on the caller's stream, then ``torch.cuda.synchronize()``
  (a step and the sync on its tokens; CUDA only); ``list, after a host sweep`` -- ``SWEEP_BYTES``
  of host memory read and written by numpy (the host work of a step, which evicts the engine's
  code and data from the caches). Each regime has its own ``copy_`` floor at that engine, timed
  after the same disturbance. A serving loop's stores cost more inside the loop than replayed
  back to back; these rows take that apart.
* ``poll``: ids ``after store``: one ``poll()`` right after a store of the blocks (CPU-tensor ids),
  call-to-done from the store's call to the first ``poll()`` that reports it; ``idle``: nothing
  in flight. ``flush``: ``after store``: ``flush()`` right after such a store (its host time
  includes the wait for the copy); ``idle``: nothing in flight.
* ``prepare`` / ``forward`` / ``release``: ``ple_ops.OffloadRuntime`` (8 PLE layers of 256
  float32 per token, 8 tokens: 64 KiB of rows per step; pure lookups, gathered by the offload
  process), eager steps; prepare's call-to-done ends when the offload
  process has served the step (``served_steps()``): the wait a step's first PLE layer may meet;
  the forward (its rows already served: the host cost of enqueuing every layer's wait and pull)
  and release's at ``torch.cuda.synchronize()``.
  Then a step captured in a ``torch.cuda.CUDAGraph`` (warm-up done eagerly, captured with no step
  prepared, the releases inside the graph) and each step ``prepare()`` / ``graph.replay()`` /
  ``release(enqueue=False)``: rows ``prepare``, ``replay``, ``release`` (ids ``replay``) and
  ``step`` (all three; call-to-done at the synchronize). Their baselines: ``copy_`` of the
  step's row bytes to the GPU, and ``torch``: ``index_select`` of the ids from each layer's host
  table into one page-locked buffer, one ``copy_`` to the GPU.

On the CPU (no CUDA) the same code runs a tiny configuration (512 B per region, CPU engines,
2 PLE layers) in seconds, as a smoke test: GPU-id rows and the graph replay are left out.

Writes host_cost.csv, host_cost.md (the table "Host cost per call", also printed) and
host_cost.png (when matplotlib is installed) to --out. Exits non-zero if a measurement failed.

Usage: python benchmarks/host_cost.py [--out DIR] [--quick] [--reps N]
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import torch

from common import (  # this script's own directory
    PATH_COLORS,
    at_least_one,
    figure,
    finish,
    guard,
    kib,
    parse,
    parser,
    save,
    save_figure,
    table_head,
)
from host_cost_bench import BLOCKS, LAYERS, PATHS, QUICK_REPS, REPS, Config, make_config
from host_cost_kv import KvBench
from host_cost_ple import PleBench

COLUMNS = [
    "call", "path", "dir", "ids", "checks", "blocks", "bytes", "family", "regime", "status", "picked", "reps",
    "host_p50_us", "host_p90_us", "done_p50_us", "done_p90_us",
    "copy_host_p50_us", "copy_done_p50_us", "torch_host_p50_us", "torch_done_p50_us",
    "paired_copy_host_p50_us", "host_vs_copy", "host_vs_paired_copy", "host_vs_torch", "bw_vs_copy", "bw_vs_torch",
    "note",
]  # fmt: skip


class HostCost(KvBench, PleBench):
    """Every row's measurements over one cache: the ops, the engine paths, the PLE runtime."""


def add_baselines(rows: list[dict]) -> None:
    """Each row's same-run baselines (same family, direction, bytes and regime) and its ratios to
    them: the floor measured at the row's own engine where there is one (path), else the run's.
    A regime's rows have no torch baseline: that is timed idle only."""
    found = {}
    for r in rows:
        if r["call"] in ("copy_", "torch") and r["status"] == "ok":
            found[r["call"], r["family"], r["dir"], r["bytes"], r.get("regime", ""), r["path"]] = r
    for r in rows:
        if r["status"] != "ok" or not r.get("bytes"):
            continue
        for name, call in (("copy", "copy_"), ("torch", "torch")):
            key = (call, r["family"], r["dir"], r["bytes"], r.get("regime", ""))
            b = found.get((*key, r["path"])) or found.get((*key, "-"))
            if b is None:
                continue
            r[f"{name}_host_p50_us"] = b["host_p50_us"]
            r[f"{name}_done_p50_us"] = b.get("done_p50_us")
            r[f"host_vs_{name}"] = r["host_p50_us"] / b["host_p50_us"]
            if r.get("bw", True) and r.get("done_p50_us") and b.get("done_p50_us"):
                r[f"bw_vs_{name}"] = b["done_p50_us"] / r["done_p50_us"]


# --- output ----------------------------------------------------------------------------------


def num(x, ratio: bool = False) -> str:
    if x is None or x == "":
        return "-"
    if ratio:
        return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"
    return f"{x:.1f}" if x < 100 else f"{x:.0f}"


HEADER = table_head(
    *("call", "path", "dir", "ids", "checks", "blocks:", "host p50 us:", "host p90 us:", "call-to-done us:"),
    *("host p50 / copy_:", "host p50 / copy_ just before:", "host p50 / torch:"),
    *("copy_ done / done:", "torch done / done:"),
)


def markdown(rows: list[dict], cfg: Config, note: str) -> str:
    """One line per call setting, its block counts side by side ("a / b / c / d")."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["family"], r["call"], r["path"], r["dir"], r["ids"], r["checks"]), []).append(r)
    lines = [
        "# Host cost per call",
        "",
        note,
        "",
        "Each cell lists the block counts in the order of the blocks column (PLE rows: tokens per step;",
        "idle poll/flush: nothing in flight). host: perf_counter_ns around the call alone, idle device",
        "and engine before it. call-to-done: to the end of torch.cuda.synchronize() (ops, baselines,",
        "PLE), engine.flush() (store/load), the first poll() that reports the store (poll after store);",
        "flush's is its own duration. copy_: one bare non_blocking copy_ of the same bytes (the floor;",
        "measured again at each engine, path column, and that engine's rows are divided by it);",
        "torch: index_select per region into one packed GPU buffer + one copy_ (store), one copy_ +",
        "index_copy_ per region (load); PLE torch: index_select per host table + one copy_. Ratios:",
        "host p50 / baseline host p50, baseline call-to-done / call-to-done (bandwidth). ids gpu:",
        "device tensors; cpu: CPU tensors (the ops: with .to(device) inside the timed call); list:",
        "Python lists; PLE rows: eager steps, or prepare / graph.replay() / release(enqueue=False) of a",
        "captured step (step: all three). checks: kv_ops.set_id_checks for the ops; engine: the",
        "engine's own, as it comes. refused: the call raised ValueError (host_cost.csv has the message).",
        "copy_ just before (engine store/load rows): the same floor timed before each call, in the same",
        "state (after the flush, the sync and the regime's disturbance), its p50 over the row's calls.",
        "Full per-row figures (p90 of call-to-done too) are in host_cost.csv.",
        "",
        *HEADER,
    ]
    for (family, call, path, direction, ids, checks), group in groups.items():
        group.sort(key=lambda r: r.get("blocks") or 0)

        def cells(key, ratio=False, group=group):
            return " / ".join(r["status"] if r["status"] != "ok" else num(r.get(key), ratio) for r in group)

        picks = [r.get("picked") for r in group if r.get("picked")]
        if path == "auto" and picks:
            path = f"auto ({' / '.join(picks)})" if len(set(picks)) > 1 else f"auto ({picks[0]})"
        blocks = " / ".join(str(r.get("blocks", "-")) for r in group)
        if family == "ple":
            call, blocks = f"PLE {call}" if call in ("copy_", "torch") else call, f"{blocks} tok"
        lines.append(
            f"| {call} | {path} | {direction} | {ids} | {checks} | {blocks} | {cells('host_p50_us')} "
            f"| {cells('host_p90_us')} | {cells('done_p50_us')} | {cells('host_vs_copy', True)} "
            f"| {cells('host_vs_paired_copy', True)} | {cells('host_vs_torch', True)} | {cells('bw_vs_copy', True)} "
            f"| {cells('bw_vs_torch', True)} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    colors = PATH_COLORS
    ok = [r for r in rows if r["status"] == "ok" and r["family"] == "kv"]
    fig, axes = figure(3, (18, 4.8))
    for ax, direction in zip(axes[:2], ("store", "load")):
        for p in PATHS:
            pts = sorted(
                (r["blocks"], r["host_p50_us"]) for r in ok if (r["call"], r["path"], r["ids"]) == (direction, p, "cpu")
            )
            if pts:
                ax.plot(*zip(*pts), "-o", color=colors[p], label=f"engine.{direction} {p} (CPU-tensor ids)")
        for name, style in (("copy_", "k--"), ("torch", "k:")):
            pts = sorted((r["blocks"], r["host_p50_us"]) for r in ok if (r["call"], r["dir"]) == (name, direction))
            if pts:
                ax.plot(*zip(*pts), style, label=f"{name} baseline")
        ops = ("copy_blocks", "gather_blocks") if direction == "store" else ("copy_blocks", "scatter_blocks")
        for op, style in zip(ops, ("-s", "-^")):
            for checks, color in (("on", "tab:purple"), ("off", "tab:gray")):
                pts = sorted(
                    (r["blocks"], r["host_p50_us"])
                    for r in ok
                    if (r["call"], r["dir"], r["checks"]) == (op, direction, checks) and r["ids"] == ok_ids(ok)
                )
                if pts:
                    ax.plot(*zip(*pts), style, color=color, ms=4, lw=0.8, label=f"{op} checks {checks}")
        ax.set_title(f"host time inside the call, {direction}")
        ax.set_ylabel("host p50, us")
    ax = axes[2]
    for p in PATHS:
        for direction, style in (("store", "-o"), ("load", "--s")):
            pts = sorted(
                (r["blocks"], r["bw_vs_copy"])
                for r in ok
                if (r["call"], r["path"], r["ids"]) == (direction, p, "cpu") and r.get("bw_vs_copy")
            )
            if pts:
                ax.plot(*zip(*pts), style, color=colors[p], label=f"{p} {direction}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_title("copy_ call-to-done / engine call-to-flush")
    ax.set_ylabel("bandwidth ratio to bare copy_")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(BLOCKS, [str(b) for b in BLOCKS])
        ax.set_xlabel("blocks per call (1 MiB each on the GPU)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    fig.suptitle("Host cost per call: kv_ops ops and OffloadEngine, against copy_ and plain torch")
    save_figure(fig, path)


def ok_ids(rows: list[dict]) -> str:
    """The ops' ids plotted: device tensors where there are any."""
    return "gpu" if any(r["ids"] == "gpu" and r["call"].endswith("_blocks") for r in rows) else "cpu"


def main() -> None:
    p = parser(__doc__, quick=f"{QUICK_REPS} calls per figure instead of {REPS}")
    p.add_argument("--reps", type=at_least_one, default=None, help="calls per figure (after the warm-up)")
    args = parse(p, cuda=False)
    cfg = make_config(args)
    began = time.perf_counter()
    where = torch.cuda.get_device_name(cfg.device) if cfg.cuda else "CPU (no CUDA: the tiny smoke configuration)"
    bench = HostCost(cfg)
    note = (
        f"{where}, torch {torch.__version__}. Cache: {LAYERS} layers K/V-first, {kib(bench.width // (2 * LAYERS))} "
        f"per region, {2 * LAYERS} regions, {kib(bench.width)} per packed block, {cfg.num_blocks} blocks each side. "
        f"PLE: {cfg.ple_layers} layers x {cfg.ple_dim} float32 x {cfg.ple_tokens} tokens = {kib(cfg.ple_bytes)} "
        f"per step. {cfg.reps} calls per figure after {cfg.warm} warm-up calls."
    )
    print(note, flush=True)
    rows: list[dict] = []
    for what, fn in (("baselines", bench.baselines), ("ops", bench.ops)):
        gc.collect()
        rows += guard(what, fn) or []
        print(f"[{time.perf_counter() - began:.1f} s] {what}", flush=True)
    for path in PATHS:
        gc.collect()
        rows += guard(f"engine path={path}", bench.engine_rows, path) or []
        print(f"[{time.perf_counter() - began:.1f} s] engine path={path}", flush=True)
    gc.collect()
    rows += guard("OffloadRuntime", bench.ple_rows) or []
    print(f"[{time.perf_counter() - began:.1f} s] OffloadRuntime", flush=True)
    add_baselines(rows)
    table = markdown(rows, cfg, note)
    save(args.out, "host_cost", rows, COLUMNS, table=table, plot=plot, digits=4, ignore_extra=True)
    print(f"host_cost.py took {time.perf_counter() - began:.1f} s", flush=True)
    finish()


if __name__ == "__main__":
    main()
