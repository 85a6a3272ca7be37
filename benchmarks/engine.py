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
import gc
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

import kv_ops
from kv_ops import kernels
from kv_ops.transfer import dma, paths

from common import time_graph  # this script's own directory
from report import can_plot, columns, figure, save_figure, write_csv

LAYERS = 8  # K/V-first: 2 regions per layer
SIZES = (4096, 16384, 65536, 262144)  # bytes of one region's block
QUICK_SIZES = (4096, 65536)
PATHS = ("kernel", "staged", "dma", "auto")
FIXED = ("kernel", "staged", "dma")  # the paths auto chooses from
IDS = ("random", "run")
DIRECTIONS = ("store", "load", "duplex")
CALLS = 8  # calls per measurement, back to back
CALL_BYTES = 64 << 20  # bytes per call (a whole number of packed blocks): 64 blocks of 1 MiB
RUN = 16  # ids per run in the "run" pattern
REPS = 5
QUICK_REPS = 3
OVERLAP_BLOCK = 65536  # per region: 1 MiB packed
OVERLAP_REPS = 7
MATMULS = 20
MATMUL_N = 8192
IN_FLIGHT = 3  # store+load pairs in flight beside the matmuls
COLUMNS = [
    "kind", "block_bytes", "packed_bytes", "ids", "direction", "path", "picked", "calls", "ids_per_call",
    "bytes", "seconds", "gbps", "memcpy_gbps", "ratio", "memcpy_duplex_ratio", "auto_vs_best",
    "seconds_before", "seconds_after", "drift",
    "staged_ratio", "gather_us", "sm_us_per_gb", "link_fraction", "dma_only_gbps", "dma_only_ratio",
    "chunk_rows", "ring_bytes", "issue_us_per_call", "issue_fraction", "limit",
    "run", "matmul_ms", "baseline_ms", "slowdown", "duplex_ratio",
    "blocks", "runs", "single_gbps", "host_us",
]  # fmt: skip
FAILURES: list[str] = []


def kib(n: int) -> str:
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20} MiB"
    if n >= 1024 and n % 1024 == 0:
        return f"{n >> 10} KiB"
    return f"{n} B"


def guard(what: str, fn, *args):
    """``fn(*args)``, or None after printing the traceback: one failed measurement must not cost
    the others (a GPU run measures everything in one go)."""
    try:
        return fn(*args)
    except Exception:
        FAILURES.append(what)
        print(f"FAILED: {what}", flush=True)
        traceback.print_exc()
        sys.stderr.flush()
        return None


def close_quietly(engine) -> None:
    try:
        engine.close()
    except Exception:
        traceback.print_exc()


def wall(fn, reps: int) -> float:
    """Median seconds of ``fn()`` (which returns synchronised), after one untimed warm-up."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def picked(before: dict, after: dict) -> str:
    """Which paths served the calls between two snapshots of ``engine.path_counts``."""
    diff = {p: n - before.get(p, 0) for p, n in after.items() if n > before.get(p, 0)}
    if len(diff) <= 1:
        return next(iter(diff), "")
    total = sum(diff.values())
    return " + ".join(f"{p} {round(100 * n / total)}%" for p, n in sorted(diff.items(), key=lambda kv: -kv[1]))


def call_shape(block: int) -> tuple[int, int, int]:
    """(packed bytes per id, ids per call, ids per direction) for ``block`` bytes per region."""
    per_id = 2 * LAYERS * block
    per_call = max(1, CALL_BYTES // per_id)
    if per_call >= RUN:
        per_call -= per_call % RUN  # whole runs per call
    return per_id, per_call, CALLS * per_call


def pattern(kind: str, n: int, run: int, gen: torch.Generator) -> torch.Tensor:
    """A permutation of ``range(n)``: random order, or runs of ``run`` consecutive ids in random order."""
    if kind == "random":
        return torch.randperm(n, generator=gen)
    starts = torch.randperm(n // run, generator=gen) * run
    return (starts[:, None] + torch.arange(run)).flatten()


class Cache:
    """An 8-layer K/V-first cache of ``block`` bytes per region, and each call's ids.

    Stores read GPU blocks ``[0, n)`` into mirror rows ``[0, n)``; loads read mirror rows
    ``[n, 2n)`` into GPU blocks ``[n, 2n)``: the two directions never touch the same memory, so
    duplex is two independent streams of work. Ids are drawn here, outside the timed loops.
    """

    def __init__(self, block: int, device="cuda"):
        self.block = block
        self.per_id, self.per_call, self.n = call_shape(block)
        self.bytes = self.n * self.per_id  # per direction per measurement
        self.call_bytes = self.per_call * self.per_id
        self.num_blocks = 2 * self.n
        self.tensors = {
            f"layer{i}": torch.empty((2, self.num_blocks, block // 2), dtype=torch.bfloat16, device=device)
            for i in range(LAYERS)
        }
        gen = torch.Generator().manual_seed(block)
        run = min(RUN, self.per_call)
        pc = self.per_call
        self.calls: dict[tuple[str, str], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for ids in IDS:
            for direction, offset in (("store", 0), ("load", self.n)):
                gpu = pattern(ids, self.n, run, gen) + offset
                host = pattern(ids, self.n, run, gen) + offset
                # (GPU ids, host ids) of every call
                self.calls[ids, direction] = [
                    (gpu[c * pc : (c + 1) * pc].clone(), host[c * pc : (c + 1) * pc].clone()) for c in range(CALLS)
                ]

    def engine(self, path: str) -> kv_ops.OffloadEngine:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return kv_ops.OffloadEngine(
                self.tensors, self.num_blocks, capacity_bytes=self.num_blocks * self.per_id, path=path
            )


# Host seconds spent inside the store/load calls of each issue() (flush excluded): when they are
# close to the whole wall time, the host's issue time, not the link, limits the row.
ISSUED: list[float] = []


def issue(engine, store_calls, load_calls) -> None:
    """Every call back to back (stores and loads interleaved when both), then ``flush()``."""
    start = time.perf_counter()
    for c in range(CALLS):
        if store_calls is not None:
            gpu_ids, host_ids = store_calls[c]
            engine.store(gpu_ids, host_ids)
        if load_calls is not None:
            gpu_ids, host_ids = load_calls[c]
            engine.load(host_ids, gpu_ids)
    ISSUED.append(time.perf_counter() - start)
    engine.flush()


class Memcpy:
    """Contiguous pinned memcpy each way, on created streams: the baseline and the ceiling."""

    def __init__(self, nbytes: int):
        self.gpu = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
        self.host = [kv_ops.pinned_empty(nbytes) for _ in range(2)]
        self.streams = {"store": torch.cuda.Stream(), "load": torch.cuda.Stream()}

    def run(self, directions, nbytes: int) -> None:
        for d in directions:
            with torch.cuda.stream(self.streams[d]):
                if d == "store":
                    self.host[0][:nbytes].copy_(self.gpu[0][:nbytes], non_blocking=True)
                else:
                    self.gpu[1][:nbytes].copy_(self.host[1][:nbytes], non_blocking=True)
        for d in directions:
            self.streams[d].synchronize()

    def seconds(self, nbytes: int, reps: int) -> dict[str, float]:
        """Seconds to move ``nbytes`` GPU to host, host to GPU, and both at once."""
        return {
            "store": wall(lambda: self.run(("store",), nbytes), reps),
            "load": wall(lambda: self.run(("load",), nbytes), reps),
            "duplex": wall(lambda: self.run(("store", "load"), nbytes), reps),
        }


class State:
    """Everything measured, by key; rows and tables are built from it at the end (and after
    every block size, so a crash later still leaves a CSV)."""

    def __init__(self, reps: int):
        self.reps = reps
        self.shape: dict[int, Cache] = {}  # block -> its cache's shape (tensors dropped)
        self.memcpy: dict[int, list[dict[str, float]]] = {}  # block -> [before, after]
        self.sustained: dict[tuple[int, str, str, str], tuple[float, str]] = {}  # (block, ids, direction, path)
        self.stage: dict[tuple[int, str, str], tuple[float, float]] = {}  # (block, ids, dir) -> gather s, DMA s
        self.ring: dict[int, tuple[int, int]] = {}  # block -> staged chunk rows, ring bytes
        self.crossover: dict[int, object] = {}  # block -> kv_ops.transfer.crossover.Crossover
        self.overlap: list[dict] = []
        self.issued: dict[tuple[int, str, str, str], float] = {}  # (block, ids, direction, path) -> host issue s

    def base(self, block: int) -> dict[str, float] | None:
        """The memcpy baseline of a size: the mean of its before and after runs."""
        runs = self.memcpy.get(block)
        if not runs:
            return None
        return {d: statistics.fmean(r[d] for r in runs) for d in runs[0]}


# --- measurements ----------------------------------------------------------------------------


def attribution(engine, cache: Cache, state: State) -> None:
    """The staged path's two halves alone, on the same blocks and mirror rows: the gather (or
    scatter) device to device, and the packed-row DMA."""
    regions = list(engine.regions.values())
    mirror = engine.mirror  # kept alive here: the DMA plans hold its addresses
    errors = kv_ops.error_counter(engine.device)
    buf = torch.empty((cache.per_call, cache.per_id), dtype=torch.uint8, device=engine.device)
    rows = torch.arange(cache.per_call)
    stream = torch.cuda.Stream(engine.device)
    staged = engine.paths.get("staged")
    if staged is not None:
        state.ring[cache.block] = (staged.chunk, staged.ring_bytes)
    for ids in IDS:
        for direction in ("store", "load"):
            calls = cache.calls[ids, direction]
            gpu_ids = [g.to(engine.device) for g, _ in calls]
            if direction == "store":

                def stage(gpu_ids=gpu_ids):
                    for g in gpu_ids:
                        kernels.block_copy(regions, buf, g, None, g.numel(), errors, num_programs=paths.STAGE_PROGRAMS)

                plans = [dma.plan_copies([buf], [mirror], rows[: h.numel()], h) for _, h in calls]
            else:

                def stage(gpu_ids=gpu_ids):
                    for g in gpu_ids:
                        kernels.block_copy(buf, regions, None, g, g.numel(), errors, num_programs=paths.STAGE_PROGRAMS)

                plans = [dma.plan_copies([mirror], [buf], h, rows[: h.numel()]) for _, h in calls]

            def copy(plans=plans):
                for plan in plans:
                    dma.launch(plan, stream)
                stream.synchronize()

            gather_s = time_graph(stage, state.reps)
            dma_s = wall(copy, state.reps)
            state.stage[cache.block, ids, direction] = (gather_s, dma_s)
            print(
                f"  staged halves, {kib(cache.block)}/region {ids} {direction}: gather {gather_s * 1e6:.0f} us, "
                f"DMA alone {cache.bytes / dma_s / 1e9:.1f} GB/s",
                flush=True,
            )


def measure_path(cache: Cache, path: str, state: State) -> None:
    base = state.base(cache.block)
    engine = cache.engine(path)
    try:
        for ids in IDS:
            for direction in DIRECTIONS:
                stores = cache.calls[ids, "store"] if direction != "load" else None
                loads = cache.calls[ids, "load"] if direction != "store" else None
                before = dict(engine.path_counts)
                ISSUED.clear()
                seconds = wall(lambda s=stores, ld=loads: issue(engine, s, ld), state.reps)
                state.sustained[cache.block, ids, direction, path] = (seconds, picked(before, engine.path_counts))
                state.issued[cache.block, ids, direction, path] = statistics.median(ISSUED[1:])  # after the warm-up
                moved = cache.bytes * (2 if direction == "duplex" else 1)
                ratio = ""
                if base is not None:
                    ratio = f" = {base[direction] / seconds:.2f} of memcpy" if direction != "duplex" else ""
                print(
                    f"{kib(cache.block)}/region {ids:6s} {direction:6s} {path:6s}: {moved / seconds / 1e9:6.1f} GB/s"
                    f"{ratio}  [{state.sustained[cache.block, ids, direction, path][1]}]",
                    flush=True,
                )
        if path == "staged":
            attribution(engine, cache, state)
        if path == "auto" and engine.crossover is not None:
            state.crossover[cache.block] = engine.crossover
    finally:
        close_quietly(engine)


def measure_size(block: int, memcpy: Memcpy, state: State) -> None:
    cache = Cache(block)
    state.shape[block] = cache
    try:
        state.memcpy[block] = [memcpy.seconds(cache.bytes, state.reps)]
        for path in PATHS:
            guard(f"{path} path, {kib(block)} per region", measure_path, cache, path, state)
            gc.collect()
        state.memcpy[block].append(memcpy.seconds(cache.bytes, state.reps))
    finally:
        cache.tensors = {}  # keep the shape and ids, free the cache
        gc.collect()
        torch.cuda.empty_cache()


def overlap(memcpy: Memcpy, state: State, reps: int) -> None:
    """Full-GPU bf16 matmuls alone, and while each path moves both directions throughout."""
    cache = Cache(OVERLAP_BLOCK)
    base = memcpy.seconds(cache.bytes, state.reps)
    one_way = max(cache.bytes / base["store"], cache.bytes / base["load"]) / 1e9
    a = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    stores, loads = cache.calls["random", "store"], cache.calls["random", "load"]

    def run(engine=None) -> tuple[float, float]:
        """Matmul milliseconds, and the GB/s moved both ways meanwhile (bytes issued while the
        matmuls ran, over the time from the first issue until the last of them finished)."""
        torch.cuda.synchronize()
        go = torch.cuda.Event()
        go.record()  # before the matmuls: the transfers are ordered after nothing that runs
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(MATMULS):
            torch.matmul(a, b, out=c)
        end.record()
        if engine is None:
            end.synchronize()
            return start.elapsed_time(end), 0.0
        began = time.perf_counter()
        issued = stored = loaded = 0
        while not end.query():
            if issued - min(stored, loaded) < IN_FLIGHT:
                gpu_ids, host_ids = stores[issued % CALLS]
                engine.store(gpu_ids, host_ids, after=go)
                gpu_ids, host_ids = loads[issued % CALLS]
                engine.load(host_ids, gpu_ids, after=go)
                issued += 1
            else:
                done = engine.poll()
                stored += len(done.stores)
                loaded += len(done.loads)
                time.sleep(20e-6)
        engine.flush()
        seconds = time.perf_counter() - began
        torch.cuda.synchronize()
        return start.elapsed_time(end), 2 * issued * cache.call_bytes / seconds / 1e9

    def alone() -> float:
        ms = statistics.median(run()[0] for _ in range(reps))
        state.overlap.append(
            dict(
                kind="overlap",
                block_bytes=cache.block,
                packed_bytes=cache.per_id,
                ids="-",
                path="none",
                run=len(alone_ms) + 1,
                matmul_ms=ms,
            )
        )
        alone_ms.append(ms)
        print(f"matmuls alone ({len(alone_ms)}): {ms:.2f} ms", flush=True)
        return ms

    run()
    run()  # warm-up: cuBLAS, clocks
    alone_ms: list[float] = []
    alone()
    for path in PATHS:

        def beside(path=path):
            engine = cache.engine(path)
            try:
                run(engine)  # warm-up: compiles, the ring
                before = dict(engine.path_counts)
                results = [run(engine) for _ in range(reps)]
                return results, picked(before, engine.path_counts)
            finally:
                close_quietly(engine)

        got = guard(f"matmul overlap beside {path}", beside)
        gc.collect()
        alone()
        if got is None:
            continue
        results, pick = got
        ms = statistics.median(r[0] for r in results)
        gbps = statistics.median(r[1] for r in results)
        ref = (alone_ms[-2] + alone_ms[-1]) / 2
        state.overlap.append(
            dict(
                kind="overlap",
                block_bytes=cache.block,
                packed_bytes=cache.per_id,
                ids="random",
                path=path,
                picked=pick,
                matmul_ms=ms,
                baseline_ms=ref,
                slowdown=ms / ref - 1,
                gbps=gbps,
                memcpy_gbps=one_way,
                duplex_ratio=gbps / one_way,
            )
        )
        print(
            f"matmuls beside {path}: {ms:.2f} ms ({100 * (ms / ref - 1):+.1f}%), {gbps:.1f} GB/s both ways "
            f"= {gbps / one_way:.2f}x one-way memcpy  [{pick}]",
            flush=True,
        )
    for row in state.overlap:
        if row["path"] == "none":
            row["slowdown"] = row["matmul_ms"] / alone_ms[0] - 1  # drift against the first run


# --- rows and tables -------------------------------------------------------------------------


def target(packed: int) -> tuple[float, float | None]:
    """(per-direction ratio, duplex ratio) the issue asks of random ids at this packed size."""
    if packed >= 1 << 20:
        return 0.93, 1.70
    if packed >= 256 << 10:
        return 0.88, 1.60
    return 0.88, None


def limit(staged: float, dma_only: float, link_fraction: float, needed: float, issue_fraction: float) -> str:
    if staged >= needed:
        return "meets"
    if issue_fraction > 0.85:
        return "host issue time"  # the calls took nearly the whole wall time to issue
    if dma_only < needed:
        return "descriptors"  # the copy engines alone fall short on these rows
    if link_fraction > 0.5:
        return "gather SMs"
    return "ring/pipeline"


def build_rows(state: State) -> list[dict]:
    rows: list[dict] = []
    stage_rows: list[dict] = []
    for block, cache in state.shape.items():
        base = state.base(block)
        if base is None:
            continue
        shape = dict(block_bytes=block, packed_bytes=cache.per_id, calls=CALLS, ids_per_call=cache.per_call)
        one_way = max(cache.bytes / base["store"], cache.bytes / base["load"]) / 1e9
        runs = state.memcpy[block]
        for d in DIRECTIONS:
            moved = cache.bytes * (2 if d == "duplex" else 1)
            rows.append(
                dict(
                    kind="memcpy",
                    **shape,
                    ids="contiguous",
                    direction=d,
                    path="memcpy",
                    bytes=moved,
                    seconds=base[d],
                    gbps=moved / base[d] / 1e9,
                    ratio=1.0 if d != "duplex" else moved / base[d] / 1e9 / one_way,
                    seconds_before=runs[0][d],
                    seconds_after=runs[-1][d] if len(runs) > 1 else "",
                    drift=runs[-1][d] / runs[0][d] - 1 if len(runs) > 1 else "",
                )
            )
        for ids in IDS:
            for d in DIRECTIONS:
                moved = cache.bytes * (2 if d == "duplex" else 1)
                found = {}
                for path in PATHS:
                    if (block, ids, d, path) not in state.sustained:
                        continue
                    seconds, pick = state.sustained[block, ids, d, path]
                    gbps = moved / seconds / 1e9
                    row = dict(
                        kind="bandwidth",
                        **shape,
                        ids=ids,
                        direction=d,
                        path=path,
                        picked=pick,
                        bytes=moved,
                        seconds=seconds,
                        gbps=gbps,
                        issue_fraction=state.issued[block, ids, d, path] / seconds,
                    )
                    if d == "duplex":
                        row.update(
                            memcpy_gbps=one_way,
                            ratio=gbps / one_way,
                            memcpy_duplex_ratio=moved / base["duplex"] / 1e9 / one_way,
                        )
                    else:
                        row.update(memcpy_gbps=cache.bytes / base[d] / 1e9, ratio=base[d] / seconds)
                    found[path] = row
                    rows.append(row)
                best = max((found[p]["gbps"] for p in FIXED if p in found), default=None)
                if "auto" in found and best:
                    found["auto"]["auto_vs_best"] = found["auto"]["gbps"] / best
                if (block, ids, d) in state.stage and "staged" in found:  # store and load rows only
                    gather_s, dma_s = state.stage[block, ids, d]
                    staged, fraction = found["staged"]["ratio"], gather_s / base[d]
                    chunk, ring = state.ring.get(block, ("", ""))
                    issue_fraction = state.issued[block, ids, d, "staged"] / found["staged"]["seconds"]
                    stage_rows.append(
                        dict(
                            kind="stage",
                            **shape,
                            ids=ids,
                            direction=d,
                            path="staged",
                            bytes=cache.bytes,
                            staged_ratio=staged,
                            gather_us=gather_s * 1e6,
                            sm_us_per_gb=paths.STAGE_PROGRAMS * gather_s * 1e6 / (cache.bytes / 1e9),
                            link_fraction=fraction,
                            dma_only_gbps=cache.bytes / dma_s / 1e9,
                            dma_only_ratio=base[d] / dma_s,
                            chunk_rows=chunk,
                            ring_bytes=ring,
                            issue_us_per_call=state.issued[block, ids, d, "staged"] / CALLS * 1e6,
                            issue_fraction=issue_fraction,
                            limit=limit(staged, base[d] / dma_s, fraction, target(cache.per_id)[0], issue_fraction),
                        )
                    )
    rows += stage_rows + state.overlap
    for block, cross in state.crossover.items():
        per_id = state.shape[block].per_id
        for cell in cross.cells:
            rows.append(
                dict(
                    kind="crossover",
                    block_bytes=block,
                    packed_bytes=per_id,
                    path=cell.path,
                    direction=cell.direction,
                    blocks=cell.blocks,
                    runs=cell.runs,
                    gbps=cell.gbps,
                    single_gbps=cell.single_gbps,
                    host_us=cell.host_us,
                )
            )
    return rows


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
        "| per region | packed | ids | direction | memcpy GB/s | kernel | staged | dma | auto | auto picks | auto / best |",
        "| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
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
        "| per region | packed | ids | one-way memcpy GB/s | memcpy | kernel | staged | dma | auto | auto picks | auto / best | staged: issue / wall |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
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
            "| matmuls beside | matmul ms | baseline ms | slowdown | GB/s both ways | ratio to one-way memcpy | auto picks |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
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
            "| per region | packed | ids | direction | staged | DMA alone | gather us | SM-us/GB | gather / link | chunk rows | issue us/call | issue / wall | limit |",
            "| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
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
        "| target | needed | best path | auto | best meets | auto meets |",
        "| --- | ---: | --- | ---: | --- | --- |",
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
    colors = {"kernel": "tab:blue", "staged": "tab:green", "dma": "tab:orange", "auto": "tab:red"}
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
    rows = build_rows(state)
    write_csv(out / "engine.csv", rows, columns(rows, COLUMNS))
    if final:
        table = markdown(rows, state)
        (out / "engine.md").write_text(table)
        print("\n" + table, flush=True)
        if can_plot(out / "engine.png"):
            guard("plot", plot, rows, out / "engine.png")
    return rows


def sizes_arg(text: str) -> tuple[int, ...]:
    sizes = tuple(int(s) for s in text.split(","))
    if any(s < 256 or s % 256 for s in sizes):
        raise argparse.ArgumentTypeError("block sizes must be positive multiples of 256 bytes")
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--quick", action="store_true", help=f"block sizes {QUICK_SIZES}, {QUICK_REPS} reps")
    parser.add_argument("--sizes", type=sizes_arg, default=None, help="bytes per region's block, comma-separated")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("engine.py needs a CUDA device")
    args.out.mkdir(parents=True, exist_ok=True)
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
    if FAILURES:
        print("failed: " + "; ".join(FAILURES), flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
