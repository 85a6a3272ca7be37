"""engine.py's compute overlap: full-GPU bf16 matmuls alone, and while each engine path moves both
directions throughout."""

from __future__ import annotations

import gc
import statistics
import time

import torch

from common import guard, picked  # this script's own directory
from engine_bandwidth import CALLS, PATHS, Cache, Memcpy, State, close_quietly

OVERLAP_BLOCK = 65536  # per region: 1 MiB packed
OVERLAP_REPS = 7
MATMULS = 20
MATMUL_N = 8192
IN_FLIGHT = 3  # store+load pairs in flight beside the matmuls


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
