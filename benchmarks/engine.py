"""kv_ops.OffloadEngine on the GPU: each path's bandwidth, the crossover, duplex, and compute overlap.

The cache is 8 layers in the K/V-first layout, so one block id moves 16 regions' blocks (4 KiB to
256 KiB each). Every figure is sustained throughput: CALLS transfers are issued back to back
(as a serving engine issues them, each ordered after the caller's stream) and the clock stops
when ``flush()`` returns; 512 MiB move per measurement, median of 5. Baseline: one contiguous
pinned memcpy of the same bytes on a created stream, timed the same way in the same run.

* bandwidth: ``store`` and ``load`` with random ids, and with runs of consecutive ids (which the
  DMA path merges into one copy per region), on the kernel path and on the DMA path.
* crossover: :func:`kv_ops.dma.measure_crossover`, the table an ``path="auto"`` engine decides by.
* duplex: stores and loads at once (disjoint GPU blocks), against the one-direction memcpy;
  contiguous memcpy in both directions at once is the hardware's figure.
* overlap: 20 bf16 8192^3 matmuls alone, then with stores and loads of 16 KiB blocks issued
  from a side stream throughout; the slowdown of the matmuls, per path.

Usage: python benchmarks/engine.py --out DIR [--quick]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import kv_ops  # noqa: E402
from kv_ops import dma  # noqa: E402

LAYERS = 8
CALLS = 8
TOTAL_BYTES = 512 << 20


class Setup:
    """An engine over an 8-layer K/V-first cache, sized so that CALLS calls move TOTAL_BYTES."""

    def __init__(self, block_bytes: int, path: str):
        self.per_id = 2 * LAYERS * block_bytes
        self.ids_per_call = TOTAL_BYTES // CALLS // self.per_id
        self.gpu_blocks = 4 * self.ids_per_call
        cache = {
            f"layer{i}": torch.randint(-9, 9, (2, self.gpu_blocks, block_bytes // 2), device="cuda").to(torch.bfloat16)
            for i in range(LAYERS)
        }
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.engine = kv_ops.OffloadEngine(cache, self.gpu_blocks, capacity_bytes=CALLS * self.ids_per_call * self.per_id, path=path)
        gen = torch.Generator().manual_seed(block_bytes)
        n = self.ids_per_call
        self._ids = {}  # drawn here, outside the timed loops
        for call in range(CALLS):
            host = torch.arange(call * n, (call + 1) * n)
            first = (call * n) % (self.gpu_blocks - n + 1)
            self._ids["run", call] = torch.arange(first, first + n), host
            self._ids["random", call] = torch.randperm(self.gpu_blocks, generator=gen)[:n], host[torch.randperm(n, generator=gen)]

    def ids(self, kind: str, call: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(GPU ids, host ids) of one call; host ids are this call's own slots."""
        return self._ids[kind, call]

    def issue(self, direction: str, kind: str, calls=range(CALLS)) -> None:
        for c in calls:
            gpu_ids, host_ids = self.ids(kind, c)
            if direction == "store":
                self.engine.store(gpu_ids, host_ids)
            else:
                self.engine.load(host_ids, gpu_ids)


def wall(fn, reps: int = 5) -> float:
    """Median seconds of ``fn()`` (which ends synchronised), after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Memcpy:
    """Contiguous pinned memcpy of TOTAL_BYTES each way: the ceiling."""

    def __init__(self):
        self.gpu = [torch.empty(TOTAL_BYTES, dtype=torch.uint8, device="cuda") for _ in range(2)]
        self.host = [kv_ops.pinned_empty(TOTAL_BYTES) for _ in range(2)]
        self.streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def run(self, directions) -> None:
        for d, stream in zip(directions, self.streams):
            with torch.cuda.stream(stream):
                if d == "store":
                    self.host[0].copy_(self.gpu[0], non_blocking=True)
                else:
                    self.gpu[1].copy_(self.host[1], non_blocking=True)
        torch.cuda.synchronize()

    def seconds(self) -> dict[str, float]:
        return {d: wall(lambda: self.run([d])) for d in ("store", "load")}


def bandwidth(sizes, memcpy: Memcpy) -> list[dict]:
    rows = []
    base = memcpy.seconds()
    for size in sizes:
        for path in ("kernel", "dma"):
            setup = Setup(size, path)
            for ids_kind in ("random", "run"):
                for direction in ("store", "load"):
                    seconds = wall(lambda: (setup.issue(direction, ids_kind), setup.engine.flush()))
                    rows.append(dict(kind="bandwidth", direction=direction, path=path, ids=ids_kind, block_bytes=size,
                                     gbps=TOTAL_BYTES / seconds / 1e9, memcpy_gbps=TOTAL_BYTES / base[direction] / 1e9,
                                     ratio=base[direction] / seconds))
            del setup
    return rows


def duplex(sizes, memcpy: Memcpy) -> list[dict]:
    ceiling = TOTAL_BYTES / min(memcpy.seconds().values()) / 1e9
    t = wall(lambda: memcpy.run(["store", "load"]))
    rows = [dict(kind="duplex", path="memcpy", ids="contiguous", block_bytes=TOTAL_BYTES, gbps=2 * TOTAL_BYTES / t / 1e9,
                 memcpy_gbps=ceiling, ratio=2 * TOTAL_BYTES / t / 1e9 / ceiling)]
    for size in sizes:
        for path in ("kernel", "dma"):
            setup = Setup(size, path)
            for ids_kind in ("random", "run"):

                def both():
                    # Half the calls each way, interleaved (a benchmark: contents go unchecked).
                    for c in range(CALLS // 2):
                        setup.issue("store", ids_kind, [c])
                        setup.issue("load", ids_kind, [CALLS // 2 + c])
                    setup.engine.flush()

                t = wall(both)
                rows.append(dict(kind="duplex", path=path, ids=ids_kind, block_bytes=size, gbps=TOTAL_BYTES / t / 1e9,
                                 memcpy_gbps=ceiling, ratio=TOTAL_BYTES / t / 1e9 / ceiling))
                if path == "dma" and ids_kind == "run":
                    # Does the prefer-overlap-with-compute hint cost duplex bandwidth?
                    dma.PREFER_OVERLAP_WITH_COMPUTE = False
                    t = wall(both)
                    dma.PREFER_OVERLAP_WITH_COMPUTE = True
                    rows.append(dict(kind="duplex", path="dma, no overlap hint", ids=ids_kind, block_bytes=size,
                                     gbps=TOTAL_BYTES / t / 1e9, memcpy_gbps=ceiling, ratio=TOTAL_BYTES / t / 1e9 / ceiling))
            del setup
    return rows


def overlap(size: int = 16384, matmuls: int = 20) -> list[dict]:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()

    def matmul_ms(setup=None, ids_kind="random") -> tuple[float, float]:
        """Matmul milliseconds, and the transfer GB/s (bytes issued during the matmuls, over the
        time from the start until the last of them finished)."""
        torch.cuda.synchronize()
        began = time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(matmuls):
            a @ b
        end.record()
        moved, issued, finished = 0, 0, 0
        if setup is not None:
            # Issued from a side stream, so the engine's copies are not ordered after the matmuls.
            with torch.cuda.stream(side):
                while not end.query():
                    setup.issue("store", ids_kind, [issued % CALLS])
                    setup.issue("load", ids_kind, [(issued + 1) % CALLS])
                    issued += 1
                    moved += 2 * setup.ids_per_call * setup.per_id
                    while issued - finished > 2:  # keep two pairs in flight, no more
                        finished += len(setup.engine.poll().stores)
                        time.sleep(20e-6)
            setup.engine.flush()
        torch.cuda.synchronize()
        return start.elapsed_time(end), moved / (time.perf_counter() - began) / 1e9

    matmul_ms()  # warm-up
    alone = statistics.median(matmul_ms()[0] for _ in range(5))
    rows = [dict(kind="overlap", path="none", ids="-", block_bytes=size, matmul_ms=alone, ratio=1.0, gbps=0.0)]
    for path, ids_kind in (("kernel", "random"), ("kernel", "run"), ("dma", "random"), ("dma", "run")):
        setup = Setup(size, path)
        results = [matmul_ms(setup, ids_kind) for _ in range(5)]
        ms = statistics.median(r[0] for r in results)
        rows.append(dict(kind="overlap", path=path, ids=ids_kind, block_bytes=size, matmul_ms=ms, ratio=ms / alone,
                         gbps=statistics.median(r[1] for r in results)))
        del setup
    after = statistics.median(matmul_ms()[0] for _ in range(5))  # drift check: alone again
    rows.append(dict(kind="overlap", path="none (again)", ids="-", block_bytes=size, matmul_ms=after, ratio=after / alone, gbps=0.0))
    return rows


def plot(rows, crossover: dma.Crossover, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (p, ids, d), style in zip(
        [(p, i, d) for p in ("kernel", "dma") for i in ("random", "run") for d in ("store", "load")],
        ["o-", "o--", "s-", "s--", "^-", "^--", "v-", "v--"],
    ):
        sel = [r for r in rows if r["kind"] == "bandwidth" and (r["path"], r["ids"], r["direction"]) == (p, ids, d)]
        left.plot([r["block_bytes"] for r in sel], [r["ratio"] for r in sel], style, label=f"{p}, {ids} ids, {d}")
    left.axhline(0.92, color="r", ls=":", label="target 0.92")
    left.set_xscale("log", base=2)
    left.set_xlabel("block bytes per region (16 regions, 512 MiB per measurement)")
    left.set_ylabel("GB/s / contiguous memcpy GB/s")
    left.legend(fontsize=7)
    for d, style in (("store", "-"), ("load", "--")):
        for count in sorted({r["blocks"] for r in crossover.rows}):
            sel = [r for r in crossover.rows if r["direction"] == d and r["blocks"] == count]
            right.plot([r["block_bytes"] for r in sel], [r["dma_gbps"] / r["kernel_gbps"] for r in sel], "o" + style,
                       label=f"{d}, {count} blocks")
    right.axhline(1.0, color="k", ls=":", label="crossover")
    right.set_xscale("log", base=2)
    right.set_yscale("log", base=2)
    right.set_xlabel("block bytes (each its own copy)")
    right.set_ylabel("DMA GB/s / kernel GB/s")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--quick", action="store_true", help="fewer block sizes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("engine.py needs a CUDA device")
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = [4096, 65536] if args.quick else [4096, 16384, 65536, 262144]
    crossover = dma.measure_crossover()
    memcpy = Memcpy()
    rows = bandwidth(sizes, memcpy) + duplex([4096, 65536], memcpy) + overlap()
    rows += [dict(kind="crossover", **r) for r in crossover.rows]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(args.out / "engine.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    plot(rows, crossover, args.out / "engine.png")
    print(f"batched cuMemcpyBatchAsync: {dma.has_batched_copy()}")
    print("| block | ids | direction | memcpy GB/s | kernel | DMA |\n| ---: | --- | --- | ---: | ---: | ---: |")
    bw = {(r["block_bytes"], r["ids"], r["direction"], r["path"]): r for r in rows if r["kind"] == "bandwidth"}
    for (size, ids, d, p), r in bw.items():
        if p == "kernel":
            print(f"| {size} | {ids} | {d} | {r['memcpy_gbps']:.1f} | {r['ratio']:.2f} | {bw[size, ids, d, 'dma']['ratio']:.2f} |")
    print("\n| both directions at once | block | GB/s | ratio to one-direction memcpy |\n| --- | ---: | ---: | ---: |")
    for r in rows:
        if r["kind"] == "duplex":
            print(f"| {r['path']} ({r['ids']}) | {r['block_bytes']} | {r['gbps']:.1f} | {r['ratio']:.2f} |")
    print("\n| matmuls with transfers | ids | matmul ms | slowdown | transfer GB/s meanwhile |\n| --- | --- | ---: | ---: | ---: |")
    for r in rows:
        if r["kind"] == "overlap":
            print(f"| {r['path']} | {r['ids']} | {r['matmul_ms']:.2f} | {100 * (r['ratio'] - 1):+.1f}% | {r['gbps']:.1f} |")
    print("\ncrossover (random ids, every block its own copy):\n" + crossover.table())


if __name__ == "__main__":
    main()
