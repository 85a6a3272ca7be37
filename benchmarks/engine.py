"""kv_ops.OffloadEngine on the GPU: every path against contiguous pinned memcpy, duplex, compute overlap.

The cache is 8 layers, each K/V-first ``(2, num_blocks, ...)``, so one block id moves 16 regions'
blocks: 4, 16, 64 or 256 KiB per region, which makes a packed block (one mirror row) of 64 KiB,
256 KiB, 1 MiB or 4 MiB. Paths: ``kernel`` (the zero-copy Triton kernel), ``staged`` (gather into
a GPU ring, then the copy engines), ``dma`` (the copy engines per region and block) and ``auto``
(the engine's per-call pick from its measured crossover; what it picked is read from
``engine.path_counts``).

Every figure is sustained: CALLS calls of 64 MiB each are issued back to back (each ordered after
the caller's stream, as a serving engine issues them) and the clock stops when ``flush()``
returns; 512 MiB per direction per measurement, median of REPS after a warm-up. The baseline is
one contiguous pinned memcpy of the same bytes on a created stream, timed the same way in the same
run, before and after each block size: their mean is the baseline, their difference the drift.

* bandwidth: store and load, random ids and runs of RUN consecutive ids on both sides;
  ratio = memcpy seconds / path seconds.
* duplex: CALLS stores and CALLS loads interleaved (disjoint GPU blocks and mirror rows); ratio =
  bytes moved both ways / time / the faster one-direction memcpy rate (2.0 at most). Contiguous
  memcpy both ways at once is the hardware's figure.
* staged attribution, per staged row: the gather (store) or scatter (load) alone, device to
  device with ``paths.STAGE_PROGRAMS`` programs, replayed from a CUDA graph and timed with CUDA
  events, as SM-microseconds per GB (programs x kernel time / bytes) and as a fraction of the link
  (memcpy) time; and the packed-row DMA alone (``kv_ops.dma`` plans from a contiguous GPU buffer
  to the same mirror rows, or back). A staged row below its target is put down to descriptors
  (the DMA alone falls short too), the gather's SMs or the ring/pipeline.
* overlap: MATMULS bf16 8192^3 matmuls (the whole GPU) alone, then while each path moves both
  directions (64 KiB per region, random ids) throughout; the matmuls alone are repeated between
  the paths, so the drift is known, and each path's slowdown is against the mean of the two
  alone runs around it.
* crossover: the table each auto engine measured for its shape.

Writes engine.csv, engine.png and engine.md (the printed tables) to --out. Exits non-zero if any
measurement failed (the others are still written).

Usage: python benchmarks/engine.py --out DIR [--quick] [--sizes 4096,65536]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from kv_ops.transfer import dma, paths

import common  # this script's own directory
from common import PATH_COLORS, columns, figure, finish, guard, kib, parse, parser, save_figure, table_head, write_csv
from engine_bandwidth import (
    CALL_BYTES,
    CALLS,
    FIXED,
    IDS,
    LAYERS,
    PATHS,
    QUICK_REPS,
    QUICK_SIZES,
    REPS,
    SIZES,
    Memcpy,
    State,
    build_rows,
    call_shape,
    measure_size,
    target,
)
from engine_overlap import IN_FLIGHT, MATMUL_N, MATMULS, OVERLAP_BLOCK, OVERLAP_REPS, overlap

COLUMNS = [
    "kind", "block_bytes", "packed_bytes", "ids", "direction", "path", "picked", "calls", "ids_per_call",
    "bytes", "seconds", "gbps", "memcpy_gbps", "ratio", "memcpy_duplex_ratio", "auto_vs_best",
    "seconds_before", "seconds_after", "drift",
    "staged_ratio", "gather_us", "sm_us_per_gb", "link_fraction", "dma_only_gbps", "dma_only_ratio",
    "chunk_rows", "ring_bytes", "issue_us_per_call", "issue_fraction", "limit",
    "run", "matmul_ms", "baseline_ms", "slowdown", "duplex_ratio",
    "blocks", "runs", "single_gbps", "host_us",
]  # fmt: skip


# --- tables ----------------------------------------------------------------------------------


def fmt(value, spec: str = ".2f") -> str:
    return "-" if value in (None, "") else format(value, spec)


def markdown(rows: list[dict], state: State) -> str:
    out = [
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuMemcpyBatchAsync ABI {dma.batched_copy_abi() or 'none'}; "
        f"{CALLS} calls of {kib(CALL_BYTES)} back to back per measurement, median of {state.reps}, "
        "clock stopped when flush() returns. Ratio = contiguous pinned memcpy seconds / path seconds, same bytes, same run.",
        "",
    ]
    bw = {(r["block_bytes"], r["ids"], r["direction"], r["path"]): r for r in rows if r["kind"] == "bandwidth"}
    blocks = sorted({k[0] for k in bw})

    def cells(block, ids, d):
        got = [bw.get((block, ids, d, p)) for p in PATHS]
        auto = got[-1] or {}
        return (
            " | ".join(fmt(r and r["ratio"]) for r in got)
            + f" | {auto.get('picked') or '-'} | {fmt(auto.get('auto_vs_best'))} |"
        )

    out += [
        "One direction (ratio to memcpy of that direction):",
        "",
        *table_head(
            "per region:",
            "packed:",
            "ids",
            "direction",
            "memcpy GB/s:",
            "kernel:",
            "staged:",
            "dma:",
            "auto:",
            "auto picks",
            "auto / best:",
        ),
    ]
    for block in blocks:
        for ids in IDS:
            for d in ("store", "load"):
                any_row = next((bw[block, ids, d, p] for p in PATHS if (block, ids, d, p) in bw), None)
                if any_row:
                    out.append(
                        f"| {kib(block)} | {kib(any_row['packed_bytes'])} | {ids} | {d} | {any_row['memcpy_gbps']:.1f} | "
                        + cells(block, ids, d)
                    )
    out += [
        "",
        "Both directions at once (bytes both ways / time / the faster one-direction memcpy rate; 2.0 at most; "
        "'memcpy' is contiguous memcpy both ways at once, the hardware's figure):",
        "",
        *table_head(
            "per region:",
            "packed:",
            "ids",
            "one-way memcpy GB/s:",
            "memcpy:",
            "kernel:",
            "staged:",
            "dma:",
            "auto:",
            "auto picks",
            "auto / best:",
            "staged: issue / wall:",
        ),
    ]
    for block in blocks:
        for ids in IDS:
            any_row = next((bw[block, ids, "duplex", p] for p in PATHS if (block, ids, "duplex", p) in bw), None)
            if any_row:
                staged_row = bw.get((block, ids, "duplex", "staged"))
                issue = f" {staged_row['issue_fraction']:.2f} |" if staged_row else " - |"
                out.append(
                    f"| {kib(block)} | {kib(any_row['packed_bytes'])} | {ids} | {any_row['memcpy_gbps']:.1f} | "
                    f"{any_row['memcpy_duplex_ratio']:.2f} | " + cells(block, ids, "duplex") + issue
                )
    drift = [r["drift"] for r in rows if r["kind"] == "memcpy" and r["drift"] != ""]
    if drift:
        out += [
            "",
            f"memcpy drift over each size's measurements (after / before - 1): {min(drift):+.1%} to {max(drift):+.1%}",
        ]

    ov = [r for r in rows if r["kind"] == "overlap"]
    if ov:
        alone = [r["matmul_ms"] for r in ov if r["path"] == "none"]
        out += [
            "",
            f"{MATMULS} bf16 {MATMUL_N}^3 matmuls (the whole GPU) while each path moves both directions "
            f"({kib(ov[0]['block_bytes'])} per region, random ids, {IN_FLIGHT} store+load pairs in flight); "
            "slowdown against the mean of the alone runs before and after:",
            "",
            *table_head(
                "matmuls beside",
                "matmul ms:",
                "baseline ms:",
                "slowdown:",
                "GB/s both ways:",
                "ratio to one-way memcpy:",
                "auto picks",
            ),
        ]
        for r in ov:
            if r["path"] == "none":
                out.append(
                    f"| nothing (run {r['run']}) | {r['matmul_ms']:.2f} | - | {fmt(r.get('slowdown'), '+.1%')} vs run 1 | - | - | - |"
                )
            else:
                out.append(
                    f"| {r['path']} | {r['matmul_ms']:.2f} | {r['baseline_ms']:.2f} | {r['slowdown']:+.1%} | {r['gbps']:.1f} | "
                    f"{r['duplex_ratio']:.2f} | {r['picked'] or '-'} |"
                )
        if len(alone) > 1:
            out.append(f"| drift of the alone runs (max / min - 1) | | | {max(alone) / min(alone) - 1:+.1%} | | | |")

    st = [r for r in rows if r["kind"] == "stage"]
    if st:
        out += [
            "",
            f"The staged path's halves alone, per staged row: the gather (store) or scatter (load) device to device "
            f"with {paths.STAGE_PROGRAMS} programs (CUDA events), as SM-us per GB and as a fraction of the link (memcpy) "
            "time; the packed-row DMA alone (contiguous GPU buffer <-> the same mirror rows). Limit: 'descriptors' when "
            "the DMA alone falls short of the target, 'gather SMs' when the gather takes over half the link time, "
            "'host issue time' when issuing the calls (host microseconds per call, flush excluded) took over 85% of "
            "the wall time, else 'ring/pipeline'.",
            "",
            *table_head(
                "per region:",
                "packed:",
                "ids",
                "direction",
                "staged:",
                "DMA alone:",
                "gather us:",
                "SM-us/GB:",
                "gather / link:",
                "chunk rows:",
                "issue us/call:",
                "issue / wall:",
                "limit",
            ),
        ]
        for r in st:
            out.append(
                f"| {kib(r['block_bytes'])} | {kib(r['packed_bytes'])} | {r['ids']} | {r['direction']} | {r['staged_ratio']:.2f} | "
                f"{r['dma_only_ratio']:.2f} | {r['gather_us']:.0f} | {r['sm_us_per_gb']:.0f} | {r['link_fraction']:.3f} | "
                f"{r['chunk_rows']} | {r['issue_us_per_call']:.0f} | {r['issue_fraction']:.2f} | {r['limit']} |"
            )

    out += [
        "",
        "Targets (random ids; best of kernel/staged/dma, and auto):",
        "",
        *table_head("target", "needed:", "best path", "auto:", "best meets", "auto meets"),
    ]
    for block in blocks:
        packed = 2 * LAYERS * block
        one, both = target(packed)
        for d, needed in (("store", one), ("load", one), ("duplex", both)):
            if needed is None:
                continue
            got = {p: bw[block, "random", d, p]["ratio"] for p in PATHS if (block, "random", d, p) in bw}
            fixed = {p: v for p, v in got.items() if p in FIXED}
            if not fixed:
                continue
            name = max(fixed, key=fixed.get)
            auto = got.get("auto")
            out.append(
                f"| {kib(packed)} packed, {d} | {needed:.2f} | {name} {fixed[name]:.2f} | {fmt(auto)} | "
                f"{'yes' if fixed[name] >= needed else 'NO'} | {'-' if auto is None else 'yes' if auto >= needed else 'NO'} |"
            )
    staged = next((r for r in ov if r["path"] == "staged"), None)
    if staged:
        ok = staged["slowdown"] <= 0.05 and staged["duplex_ratio"] >= 1.6
        out.append(
            f"| matmul beside staged duplex | <= +5.0%, >= 1.60 | staged {staged['slowdown']:+.1%}, {staged['duplex_ratio']:.2f} | - | "
            f"{'yes' if ok else 'NO'} | - |"
        )
    ratios = [(r["auto_vs_best"], r) for r in bw.values() if r.get("auto_vs_best") is not None]
    if ratios:
        worst, r = min(ratios, key=lambda x: x[0])
        out.append(
            f"| auto within 5% of best, every row | 0.95 | - | worst {worst:.2f} ({kib(r['packed_bytes'])} packed, {r['ids']}, "
            f"{r['direction']}) | - | {'yes' if worst >= 0.95 else 'NO'} |"
        )

    for block, cross in state.crossover.items():
        out += [
            "",
            f"Crossover the auto engine measured, {kib(block)} per region ({kib(state.shape[block].per_id)} packed):",
            "",
            cross.table(),
        ]
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    colors = PATH_COLORS
    bw = [r for r in rows if r["kind"] == "bandwidth"]
    fig, axes = figure(4, (21, 4.8))
    for ax, ids in zip(axes[:2], IDS):
        for p in PATHS:
            for d, style in (("store", "-o"), ("load", "--s")):
                pts = sorted(
                    (r["packed_bytes"], r["ratio"]) for r in bw if (r["path"], r["ids"], r["direction"]) == (p, ids, d)
                )
                if pts:
                    ax.plot(*zip(*pts), style, color=colors[p], label=f"{p} {d}")
        ax.axhline(0.93, color="k", ls=":", lw=0.8)
        ax.axhline(0.88, color="gray", ls=":", lw=0.8)
        ax.set_title(f"one direction, {ids} ids")
        ax.set_ylabel("throughput / contiguous pinned memcpy")
    ax = axes[2]
    for p in PATHS:
        for ids, style in (("random", "-o"), ("run", "--s")):
            pts = sorted(
                (r["packed_bytes"], r["ratio"])
                for r in bw
                if (r["path"], r["ids"], r["direction"]) == (p, ids, "duplex")
            )
            if pts:
                ax.plot(*zip(*pts), style, color=colors[p], label=f"{p} {ids}")
    pts = sorted({(r["packed_bytes"], r["memcpy_duplex_ratio"]) for r in bw if r["direction"] == "duplex"})
    if pts:
        ax.plot(*zip(*pts), "k-", lw=2, label="memcpy both ways")
    ax.axhline(1.70, color="k", ls=":", lw=0.8)
    ax.axhline(1.60, color="gray", ls=":", lw=0.8)
    ax.set_title("both directions at once")
    ax.set_ylabel("bytes both ways / time / one-way memcpy rate")
    packed = sorted({r["packed_bytes"] for r in bw})
    for ax in axes[:3]:
        ax.set_xscale("log", base=2)
        if packed:
            ax.set_xticks(packed, [kib(x) for x in packed])
        ax.set_xlabel("packed block bytes (16 regions)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[3]
    ov = [r for r in rows if r["kind"] == "overlap"]
    labels = [r["path"] if r["path"] != "none" else f"alone {r['run']}" for r in ov]
    values = [100 * r.get("slowdown", 0.0) for r in ov]
    ax.bar(range(len(ov)), values, color=[colors.get(r["path"], "lightgray") for r in ov])
    ax.set_xticks(range(len(ov)), labels, rotation=45, fontsize=8)
    ax.axhline(5, color="k", ls=":", lw=0.8)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_ylabel("matmul slowdown, % (alone: drift vs the first)")
    ax.set_title("bf16 matmuls beside each path's duplex")
    fig.suptitle("kv_ops.OffloadEngine, 8 layers K/V-first (16 regions), sustained, vs contiguous pinned memcpy")
    save_figure(fig, path)


def save(state: State, out: Path, final: bool = False) -> list[dict]:
    """The CSV (after every block size, so a crash later still leaves one); when ``final``, the
    table and the figure too."""
    rows = build_rows(state)
    if final:
        common.save(out, "engine", rows, columns(rows, COLUMNS), table=markdown(rows, state), plot=plot)
    else:
        write_csv(out / "engine.csv", rows, columns(rows, COLUMNS))
    return rows


def sizes_arg(text: str) -> tuple[int, ...]:
    sizes = tuple(int(s) for s in text.split(","))
    if any(s < 256 or s % 256 for s in sizes):
        raise argparse.ArgumentTypeError("block sizes must be positive multiples of 256 bytes")
    return sizes


def main() -> None:
    p = parser(__doc__, quick=f"block sizes {QUICK_SIZES}, {QUICK_REPS} reps")
    p.add_argument("--sizes", type=sizes_arg, default=None, help="bytes per region's block, comma-separated")
    args = parse(p, cuda=True)
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    state = State(QUICK_REPS if args.quick else REPS)
    began = time.perf_counter()
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, batched copies: {dma.has_batched_copy()}",
        flush=True,
    )
    memcpy = Memcpy(max(call_shape(b)[0] * call_shape(b)[2] for b in (*sizes, OVERLAP_BLOCK)))
    for block in sizes:
        guard(f"{kib(block)} per region", measure_size, block, memcpy, state)
        guard("writing the CSV", save, state, args.out)
        print(f"[{time.perf_counter() - began:.0f} s]", flush=True)
    guard("matmul overlap", overlap, memcpy, state, QUICK_REPS if args.quick else OVERLAP_REPS)
    guard("writing the results", save, state, args.out, True)
    print(f"engine.py took {time.perf_counter() - began:.0f} s", flush=True)
    finish()


if __name__ == "__main__":
    main()
