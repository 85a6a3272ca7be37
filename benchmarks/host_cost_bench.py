"""host_cost.py's set-up and timing: the configuration, the host-time measurement, and the cache
with the same-run baselines (the bare ``copy_`` floor and the plain-torch gather) that every row
is divided by."""

from __future__ import annotations

import gc
import math
import statistics
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch

import kv_ops

LAYERS = 8  # K/V-first: 16 regions
BLOCKS = (1, 4, 16, 64)  # blocks per call
PATHS = ("kernel", "staged", "dma", "auto")
REPS, QUICK_REPS = 40, 10
WARM, QUICK_WARM = 3, 2
SERVE_TIMEOUT = 30.0  # seconds a poll or an offload step may take before the row fails
# Untimed store/flush pairs after each engine is made, before its rows: the host thread runs
# slower for a while after an auto engine's crossover sweep, which its rows would charge to the path.
SETTLE_S, QUICK_SETTLE_S = 2.0, 0.0
# The regimes' disturbances (see host_cost.py's docstring): GPU clock cycles of the busy kernel (about
# 1.5 ms at the H200's 1.98 GHz), and the host bytes swept (larger than a host CPU's L2 and its
# share of L3; the CPU smoke configuration sweeps less).
BUSY_CYCLES = 3_000_000
SWEEP_BYTES, QUICK_SWEEP_BYTES = 32 << 20, 1 << 20
AFTER_GPU, AFTER_SWEEP = "list, after GPU work", "list, after a host sweep"


@dataclass
class Config:
    device: torch.device
    block_shape: tuple[int, ...]  # one region's block, bfloat16 elements
    num_blocks: int  # GPU blocks, and as many host blocks
    reps: int
    warm: int
    ple_layers: int
    ple_dim: int
    ple_vocab: int
    ple_tokens: int
    settle_s: float = 0.0  # see SETTLE_S
    sweep_bytes: int = QUICK_SWEEP_BYTES

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def regimes(self) -> tuple[str, ...]:
        return (AFTER_GPU, AFTER_SWEEP) if self.cuda else (AFTER_SWEEP,)

    def ids_kinds(self, engine: bool) -> tuple[str, ...]:
        if engine:
            return ("list", "cpu", "gpu") if self.cuda else ("list", "cpu")
        return ("gpu", "cpu") if self.cuda else ("cpu",)

    @property
    def ple_bytes(self) -> int:
        return self.ple_layers * self.ple_tokens * self.ple_dim * 4


def make_config(args) -> Config:
    quick = args.quick
    reps = args.reps or (QUICK_REPS if quick else REPS)
    warm = QUICK_WARM if quick else WARM
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        settle = QUICK_SETTLE_S if quick else SETTLE_S
        sweep = QUICK_SWEEP_BYTES if quick else SWEEP_BYTES
        return Config(device, (16, 8, 256), 512, reps, warm, 8, 256, 8192, 8, settle, sweep)
    return Config(torch.device("cpu"), (4, 64), 128, reps, warm, 2, 64, 512, 4)


def quiet_pinned(shape, dtype=torch.uint8) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # without CUDA: "returning ordinary (pageable) host memory"
        return kv_ops.pinned_empty(shape, dtype)


def pct(values: list[int], q: float) -> float:
    """Nearest-rank percentile (q in (0, 1]) of nanoseconds, in microseconds."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] / 1e3


def summary(host: list[int], done: list[int] | None) -> dict:
    out = dict(reps=len(host), host_p50_us=statistics.median(host) / 1e3, host_p90_us=pct(host, 0.9))
    if done:
        out |= dict(done_p50_us=statistics.median(done) / 1e3, done_p90_us=pct(done, 0.9))
    return out


def measure(call, finish, idle, reps: int, warm: int) -> dict:
    """Host time of ``call(i)`` and the time from the call to the end of ``finish()``, for
    ``i`` in ``range(warm + reps)`` (the first ``warm`` untimed); ``idle()`` before each."""
    host, done = [], []
    gc.disable()  # a collection inside a timed call would be its p90 (main collects between sections)
    try:
        for i in range(warm + reps):
            idle()
            t0 = time.perf_counter_ns()
            call(i)
            t1 = time.perf_counter_ns()
            finish()
            t2 = time.perf_counter_ns()
            if i >= warm:
                host.append(t1 - t0)
                done.append(t2 - t0)
    finally:
        gc.enable()
    return summary(host, done)


def nothing() -> None:
    pass


class Bench:
    """The cache, its regions, a page-locked mirror of every region, and buffers for the baselines."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        dev = cfg.device
        self.caches = {
            f"layer{i}": torch.zeros((2, cfg.num_blocks, *cfg.block_shape), dtype=torch.bfloat16, device=dev)
            for i in range(LAYERS)
        }
        self.regions = kv_ops.infer_regions(self.caches, cfg.num_blocks)
        self.width = kv_ops.block_bytes(self.regions)  # one packed block
        self.host_regions = {name: quiet_pinned((cfg.num_blocks, r.shape[1])) for name, r in self.regions.items()}
        max_n = max(BLOCKS)
        self.packed_host = quiet_pinned((max_n, self.width))
        flat = max(max_n * self.width, cfg.ple_bytes)
        self.dev_flat = torch.zeros(flat, dtype=torch.uint8, device=dev)
        self.host_flat = quiet_pinned(flat)
        self.host_flat.zero_()
        self.gen = torch.Generator().manual_seed(0)
        self.swept = np.ones(cfg.sweep_bytes // 8)  # float64: the host sweep's memory

    def sync(self) -> None:
        if self.cfg.cuda:
            torch.cuda.synchronize(self.cfg.device)

    def disturb(self, regime: str) -> None:
        """What comes before a call in ``regime`` (see host_cost.py's docstring), after the idle wait."""
        if regime == AFTER_GPU:
            torch.cuda._sleep(BUSY_CYCLES)
            self.sync()
        elif regime == AFTER_SWEEP:
            self.swept += 1.0  # one read and one write of every byte, on this thread

    def draw(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(GPU ids, host ids) of warm + reps calls of ``n`` blocks: int64 CPU tensors, distinct
        within a call, and consecutive calls on disjoint blocks (chunks of one permutation)."""
        per_perm = self.cfg.num_blocks // n
        calls = []
        for c in range(self.cfg.warm + self.cfg.reps):
            k = c % per_perm
            if k == 0:
                gpu = torch.randperm(self.cfg.num_blocks, generator=self.gen)
                host = torch.randperm(self.cfg.num_blocks, generator=self.gen)
            calls.append((gpu[k * n : (k + 1) * n].clone(), host[k * n : (k + 1) * n].clone()))
        return calls

    def form(self, ids: torch.Tensor, kind: str):
        if kind == "list":
            return ids.tolist()
        if kind == "gpu":
            return ids.to(self.cfg.device)
        return ids

    def row(self, **fields) -> dict:
        fields.setdefault("family", "kv")
        fields.setdefault("status", "ok")
        return fields

    # --- baselines -----------------------------------------------------------------------

    def floor_call(self, direction: str, nbytes: int):
        """The floor: ``call(i)``, one bare non_blocking ``copy_`` of ``nbytes`` (GPU to page-locked
        host memory for a store, back for a load)."""
        dev, host = self.dev_flat[:nbytes], self.host_flat[:nbytes]
        if direction == "store":
            return lambda i: host.copy_(dev, non_blocking=True)
        return lambda i: dev.copy_(host, non_blocking=True)

    def copy_baseline(self, direction: str, nbytes: int, family: str = "kv", regime: str = "") -> dict:
        call = self.floor_call(direction, nbytes)

        def idle():
            self.sync()
            self.disturb(regime)

        stats = measure(call, self.sync, idle, self.cfg.reps, self.cfg.warm)
        return self.row(
            call="copy_", path="-", dir=direction, ids=regime or "-", checks="-", bytes=nbytes, family=family,
            regime=regime, **stats,
        )  # fmt: skip

    def torch_baseline(self, direction: str, n: int) -> dict:
        regions = list(self.regions.values())
        nbytes = n * self.width
        views, offset = [], 0
        for r in regions:  # region-major packed buffer: one contiguous [n, width_r] slice per region
            views.append(self.dev_flat[offset : offset + n * r.shape[1]].view(n, r.shape[1]))
            offset += n * r.shape[1]
        dev, host = self.dev_flat[:nbytes], self.host_flat[:nbytes]
        calls = self.draw(n)
        ids = [g.to(self.cfg.device) for g, _ in calls]
        if direction == "store":

            def call(i):
                for r, v in zip(regions, views):
                    torch.index_select(r, 0, ids[i], out=v)
                host.copy_(dev, non_blocking=True)

        else:

            def call(i):
                dev.copy_(host, non_blocking=True)
                for r, v in zip(regions, views):
                    r.index_copy_(0, ids[i], v)

        stats = measure(call, self.sync, self.sync, self.cfg.reps, self.cfg.warm)
        ids_kind = "gpu" if self.cfg.cuda else "cpu"  # the device's ids
        return self.row(
            call="torch", path="-", dir=direction, ids=ids_kind, checks="-", blocks=n, bytes=nbytes, **stats
        )

    def baselines(self) -> list[dict]:
        rows = []
        for n in BLOCKS:
            for direction in ("store", "load"):
                r = self.copy_baseline(direction, n * self.width)
                rows += [r | dict(blocks=n), self.torch_baseline(direction, n)]
        return rows
