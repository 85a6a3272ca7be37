"""Block-copy bandwidth between GPU memory and page-locked host memory, as ratios to memcpy.

For each direction, block size and block count it times, on one H2D/D2H link:

* ``memcpy``     the baseline: one contiguous pinned copy of the same total bytes;
* ``kernel``     ``kv_ops.copy_blocks`` (Triton, zero-copy, at most 8 programs) with random ids;
* ``naive``      torch ``index_select`` + one DMA of the packed blocks (GPU->host), or one DMA +
                 ``index_copy_`` (host->GPU). It skips the host-side scatter/gather that a real
                 offload needs, so it is an upper bound for the naive way;
* ``per_block``  one ``cuMemcpyAsync`` per block issued from Python (wall time of the loop).

The first three are captured in a CUDA graph and timed by replay with CUDA events (median), so
launch overhead from Python does not count; ``per_block`` is timed eagerly because its Python
loop is the point. Writes block_copy.csv, block_copy.png and block_copy.md (the table, also
printed) to --out; with --tune, block_copy_tuning.csv too. Needs a CUDA device.

Usage: python benchmarks/block_copy.py --out DIR [--quick] [--tune]
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

import kv_ops
from kv_ops import kernels
from kv_ops.cuda.driver import driver as cuda_driver

from common import figure, finish, parse, parser, save, save_figure, table_head, time_graph, write_csv

BLOCK_BYTES = [256, 1024, 4096, 16384, 65536, 262144, 2 << 20]
COUNTS = [16, 256, 2048, 16384]
MAX_TOTAL = 1 << 30  # skip combinations that would move more than 1 GiB per call


def time_eager(fn, reps: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


class Setup:
    """One GPU region and one host region of ``pool`` blocks each, and random ids into them."""

    def __init__(self, block: int, count: int, gen: torch.Generator):
        pool = min(2 * count, max(count, MAX_TOTAL // block))
        self.block, self.count = block, count
        self.gpu = torch.randint(0, 256, (pool, block), dtype=torch.uint8, device="cuda")
        self.host = kv_ops.pinned_empty((pool, block))
        self.host.copy_(torch.randint(0, 256, (pool, block), dtype=torch.uint8, generator=gen))
        self.gpu_ids = torch.randperm(pool, generator=gen)[:count].cuda()
        self.host_ids = torch.randperm(pool, generator=gen)[:count].cuda()
        total = block * count
        self.flat_gpu = torch.empty(total, dtype=torch.uint8, device="cuda")
        self.flat_host = kv_ops.pinned_empty(total)
        self.packed_gpu = torch.empty((count, block), dtype=torch.uint8, device="cuda")
        self.packed_host = kv_ops.pinned_empty((count, block))

    def memcpy(self, d2h: bool):
        if d2h:
            return lambda: self.flat_host.copy_(self.flat_gpu, non_blocking=True)
        return lambda: self.flat_gpu.copy_(self.flat_host, non_blocking=True)

    def kernel(self, d2h: bool, **launch):
        errors = kv_ops.error_counter("cuda")
        if d2h:
            return lambda: kernels.block_copy(
                [self.gpu], [self.host], self.gpu_ids, self.host_ids, self.count, errors, **launch
            )
        return lambda: kernels.block_copy(
            [self.host], [self.gpu], self.host_ids, self.gpu_ids, self.count, errors, **launch
        )

    def op(self, d2h: bool):
        if d2h:
            return lambda: kv_ops.copy_blocks([self.gpu], [self.host], self.gpu_ids, self.host_ids)
        return lambda: kv_ops.copy_blocks([self.host], [self.gpu], self.host_ids, self.gpu_ids)

    def naive(self, d2h: bool):
        def d2h_fn():
            torch.index_select(self.gpu, 0, self.gpu_ids, out=self.packed_gpu)
            self.packed_host.copy_(self.packed_gpu, non_blocking=True)

        def h2d_fn():
            self.packed_gpu.copy_(self.packed_host, non_blocking=True)
            self.gpu.index_copy_(0, self.gpu_ids, self.packed_gpu)

        return d2h_fn if d2h else h2d_fn

    def per_block(self, d2h: bool):
        driver = cuda_driver()

        gpu_ids, host_ids = self.gpu_ids.tolist(), self.host_ids.tolist()
        g0, h0, b = self.gpu.data_ptr(), self.host.data_ptr(), self.block

        def fn():
            stream = torch.cuda.current_stream().cuda_stream
            for gi, hi in zip(gpu_ids, host_ids):
                if d2h:
                    driver.cuMemcpyDtoHAsync(h0 + hi * b, g0 + gi * b, b, stream)
                else:
                    driver.cuMemcpyHtoDAsync(g0 + gi * b, h0 + hi * b, b, stream)

        return fn


def sweep(args) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    blocks = [1024, 4096, 65536] if args.quick else BLOCK_BYTES
    counts = [2048] if args.quick else COUNTS
    for block in blocks:
        for count in counts:
            if block * count > MAX_TOTAL:
                continue
            s = Setup(block, count, gen)
            for d2h in (True, False):
                direction = "gpu_to_host" if d2h else "host_to_gpu"
                base = time_graph(s.memcpy(d2h))
                results = {"memcpy": base, "kernel": time_graph(s.op(d2h)), "naive": time_graph(s.naive(d2h))}
                if count <= 2048 or not args.quick:
                    results["per_block"] = time_eager(s.per_block(d2h), reps=3 if count > 2048 else 5)
                for method, sec in results.items():
                    rows.append(
                        dict(
                            direction=direction,
                            block_bytes=block,
                            blocks=count,
                            total_bytes=block * count,
                            method=method,
                            seconds=sec,
                            gbps=block * count / sec / 1e9,
                            ratio_to_memcpy=base / sec,
                        )
                    )
                print(
                    f"{direction:12s} {block:>8d} B x {count:>6d}: memcpy {block * count / base / 1e9:6.1f} GB/s, "
                    + ", ".join(f"{m} {base / t:5.2f}x" for m, t in results.items() if m != "memcpy"),
                    flush=True,
                )
            del s
    return rows


def tune(args) -> list[dict]:
    """Kernel launch parameters against memcpy, to choose the defaults in kernels.py."""
    gen = torch.Generator().manual_seed(1)
    rows = []
    configs = [(16384, 8), (32768, 8), (16384, 16), (32768, 16), (65536, 16)]
    for block in (256, 1024, 4096, 65536):
        s = Setup(block, 4096 if block < 65536 else 1024, gen)
        for d2h in (True, False):
            base = time_graph(s.memcpy(d2h))
            for tile, warps in configs:
                for programs in (8,):
                    sec = time_graph(s.kernel(d2h, tile_bytes=tile, num_warps=warps, num_programs=programs))
                    rows.append(
                        dict(
                            direction="gpu_to_host" if d2h else "host_to_gpu",
                            block_bytes=block,
                            tile_bytes=tile,
                            num_warps=warps,
                            num_programs=programs,
                            ratio_to_memcpy=base / sec,
                        )
                    )
                    print(f"tune {rows[-1]}", flush=True)
        del s
    return rows


def plot(rows: list[dict], path: Path) -> None:
    fig, axes = figure(2, (12, 4.5), sharey=True)
    for ax, direction in zip(axes, ("gpu_to_host", "host_to_gpu")):
        for method, style in (("kernel", "-o"), ("naive", "--s"), ("per_block", ":^")):
            for count in sorted({r["blocks"] for r in rows}):
                pts = [
                    (r["block_bytes"], r["ratio_to_memcpy"])
                    for r in rows
                    if r["direction"] == direction and r["method"] == method and r["blocks"] == count
                ]
                if pts and (method == "kernel" or count == 2048):
                    xs, ys = zip(*sorted(pts))
                    ax.plot(xs, ys, style, label=f"{method}, {count} blocks")
        ax.axhline(1.0, color="k", lw=0.8)
        for target, size in ((0.92, 4096), (0.85, 1024), (0.70, 256)):
            ax.plot([size], [target], "r_", markersize=14)
        ax.set_xscale("log", base=2)
        ax.set_title(direction.replace("_", " "))
        ax.set_xlabel("block bytes")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("throughput / contiguous pinned memcpy")
    axes[1].legend(fontsize=7)
    fig.suptitle("kv_ops.copy_blocks vs memcpy of the same bytes (red ticks: targets)")
    save_figure(fig, path)


def markdown(rows: list[dict], count: int = 2048) -> str:
    lines = table_head(
        "block:", "direction", "memcpy GB/s:", "kernel:", "naive (no host scatter):", "per-block memcpy:"
    )
    for block in sorted({r["block_bytes"] for r in rows}):
        for direction in ("gpu_to_host", "host_to_gpu"):
            sel = {
                r["method"]: r
                for r in rows
                if r["block_bytes"] == block and r["blocks"] == count and r["direction"] == direction
            }
            if "memcpy" not in sel:
                continue
            cell = lambda m, sel=sel: f"{sel[m]['ratio_to_memcpy']:.2f}" if m in sel else "-"  # noqa: E731
            size = f"{block // 1024} KiB" if block >= 1024 else f"{block} B"
            lines.append(
                f"| {size} | {direction.replace('_', ' ')} | {sel['memcpy']['gbps']:.1f} | {cell('kernel')} | "
                f"{cell('naive')} | {cell('per_block')} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = parser(__doc__, quick="three block sizes, 2048 blocks")
    p.add_argument("--tune", action="store_true", help="also sweep the kernel's launch parameters")
    args = parse(p, cuda=True)
    kv_ops.set_id_checks(False)  # time the copy, not the eager host-sync checks
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    if args.tune:
        rows = tune(args)
        write_csv(args.out / "block_copy_tuning.csv", rows, list(rows[0]))
    rows = sweep(args)
    save(args.out, "block_copy", rows, list(rows[0]), table=markdown(rows) + "\n", plot=plot)
    finish()


if __name__ == "__main__":
    main()
