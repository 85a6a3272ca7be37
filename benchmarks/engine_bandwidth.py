"""engine.py's sustained measurements: every engine path's bandwidth one way and both ways against
contiguous pinned memcpy, and the staged path's halves alone (see engine.py for what is timed);
and the CSV's rows built from them."""

from __future__ import annotations

import gc
import statistics
import time
import traceback
import warnings

import torch

import kv_ops
from kv_ops import kernels
from kv_ops.transfer import dma, paths

from common import guard, kib, picked, time_graph  # this script's own directory

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


# --- rows ------------------------------------------------------------------------------------


def target(packed: int) -> tuple[float, float | None]:
    """(per-direction ratio, duplex ratio) targeted for random ids at this packed size (None: no duplex target)."""
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
