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
  the run (on the H200 it ran twice as slow for a whole engine's rows) gives honest ratios. The
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
  after the same disturbance. The decode loop's stores cost 3.3-3.7x inside the loop what they
  cost replayed back to back on the H200; these rows take that apart.
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

import argparse
import functools
import gc
import math
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

import kv_ops
import ple_ops

from report import can_plot, figure, save_figure, write_csv

LAYERS = 8  # K/V-first: 16 regions
BLOCKS = (1, 4, 16, 64)  # blocks per call
PATHS = ("kernel", "staged", "dma", "auto")
REPS, QUICK_REPS = 40, 10
WARM, QUICK_WARM = 3, 2
SERVE_TIMEOUT = 30.0  # seconds a poll or an offload step may take before the row fails
# Untimed store/flush pairs after each engine is made, before its rows. On the H200
# the host thread ran about twice as slow for the first rows after the auto engine's crossover
# sweep, its idle poll() too, then recovered: without this its rows charged that to the path.
SETTLE_S, QUICK_SETTLE_S = 2.0, 0.0
# The regimes' disturbances (see the docstring): GPU clock cycles of the busy kernel (about
# 1.5 ms at the H200's 1.98 GHz), and the host bytes swept (larger than a host CPU's L2 and its
# share of L3; the CPU smoke configuration sweeps less).
BUSY_CYCLES = 3_000_000
SWEEP_BYTES, QUICK_SWEEP_BYTES = 32 << 20, 1 << 20
AFTER_GPU, AFTER_SWEEP = "list, after GPU work", "list, after a host sweep"
FAILURES: list[str] = []
COLUMNS = [
    "call", "path", "dir", "ids", "checks", "blocks", "bytes", "family", "regime", "status", "picked", "reps",
    "host_p50_us", "host_p90_us", "done_p50_us", "done_p90_us",
    "copy_host_p50_us", "copy_done_p50_us", "torch_host_p50_us", "torch_done_p50_us",
    "paired_copy_host_p50_us", "host_vs_copy", "host_vs_paired_copy", "host_vs_torch", "bw_vs_copy", "bw_vs_torch",
    "note",
]  # fmt: skip


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


# --- the PLE model (module level: the spawned offload process imports this file) -------------


class BenchPle(ple_ops.PleOffloadLayer):
    """One layer's per-layer-embedding table: rows are ``table[input_ids]``, a pure lookup (as the
    decode loop's), which the offload process gathers without running ``forward_impl``."""

    def __init__(self, layer: int, vocab: int, dim: int):
        super().__init__()
        self.table = nn.Parameter(ple_table(layer, vocab, dim), requires_grad=False)

    def forward_impl(self, input_ids):
        return self.table[input_ids.to(self.table.device)]

    def lookup_table(self):
        return self.table


class PleModel(nn.Module):
    def __init__(self, layers: int, vocab: int, dim: int):
        super().__init__()
        self.ples = nn.ModuleList(BenchPle(i, vocab, dim) for i in range(layers))

    def forward(self, hidden, input_ids):
        for ple in self.ples:
            hidden = torch.tanh(hidden + ple(hidden, input_ids))
        return hidden


def ple_table(layer: int, vocab: int, dim: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + layer)  # seeded: both processes build the same table
    return torch.randn(vocab, dim, generator=gen)


def make_ple_model(layers: int, vocab: int, dim: int) -> PleModel:
    """The model factory (``functools.partial`` of it is what the offload process receives)."""
    return PleModel(layers, vocab, dim)


# --- timing ----------------------------------------------------------------------------------


def guard(what: str, fn, *args):
    """``fn(*args)``, or None after printing the traceback: one failure must not cost the rest."""
    try:
        return fn(*args)
    except Exception:
        FAILURES.append(what)
        print(f"FAILED: {what}", flush=True)
        traceback.print_exc()
        sys.stderr.flush()
        return None


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


def kib(n: int) -> str:
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20} MiB"
    if n >= 1024 and n % 1024 == 0:
        return f"{n >> 10} KiB"
    return f"{n} B"


# --- the measurements ------------------------------------------------------------------------


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
        """What comes before a call in ``regime`` (see the module docstring), after the idle wait."""
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

    # --- the ops -------------------------------------------------------------------------

    def op_row(self, op: str, direction: str, ids_kind: str, checks: bool, n: int) -> dict:
        dev = self.cfg.device
        calls = self.draw(n)
        gpu_regions, host_regions = self.regions, self.host_regions
        packed = self.packed_host[:n]
        if ids_kind == "gpu":
            pre = [(g.to(dev), h.to(dev)) for g, h in calls]
            move = lambda t: t  # noqa: E731
        else:
            pre = calls
            move = lambda t: t.to(dev)  # noqa: E731  the user's .to(device), timed (a no-op on the CPU)
        if op == "copy_blocks" and direction == "store":

            def call(i):
                g, h = pre[i]
                kv_ops.copy_blocks(gpu_regions, host_regions, move(g), move(h))

        elif op == "copy_blocks":

            def call(i):
                g, h = pre[i]
                kv_ops.copy_blocks(host_regions, gpu_regions, move(h), move(g))

        elif op == "gather_blocks":

            def call(i):
                kv_ops.gather_blocks(gpu_regions, move(pre[i][0]), packed)

        else:

            def call(i):
                kv_ops.scatter_blocks(packed, move(pre[i][0]), gpu_regions)

        previous = kv_ops.set_id_checks(checks)
        try:
            stats = measure(call, self.sync, self.sync, self.cfg.reps, self.cfg.warm)
        finally:
            kv_ops.set_id_checks(previous)
        return self.row(
            call=op,
            path="-",
            dir=direction,
            ids=ids_kind,
            checks="on" if checks else "off",
            blocks=n,
            bytes=n * self.width,
            **stats,
        )

    def ops(self) -> list[dict]:
        rows = []
        for op, direction in (
            ("copy_blocks", "store"),
            ("copy_blocks", "load"),
            ("gather_blocks", "store"),
            ("scatter_blocks", "load"),
        ):
            for checks in (True, False):
                for ids_kind in self.cfg.ids_kinds(engine=False):
                    for n in BLOCKS:
                        rows.append(self.op_row(op, direction, ids_kind, checks, n))
            print(f"  {op} {direction}: done", flush=True)
        return rows

    # --- the engine ----------------------------------------------------------------------

    def engine(self, path: str) -> kv_ops.OffloadEngine:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return kv_ops.OffloadEngine(
                self.caches, self.cfg.num_blocks, capacity_bytes=self.cfg.num_blocks * self.width, path=path
            )

    def transfer_row(self, engine, path: str, direction: str, ids_kind: str, n: int, regime: str = "") -> dict:
        calls = [(self.form(g, ids_kind), self.form(h, ids_kind)) for g, h in self.draw(n)]
        if direction == "store":
            call = lambda i: engine.store(calls[i][0], calls[i][1])  # noqa: E731
        else:
            call = lambda i: engine.load(calls[i][1], calls[i][0])  # noqa: E731

        # Before each call, in the same state, the floor of its bytes (the paired floor): the
        # host's speed drifts within a run, even between an engine's floor rows and its own rows
        # seconds later (8x the engine's floor for one engine, 3.3x for the next, seen on the H200),
        # but hardly between two calls a copy apart.
        floor, floors = self.floor_call(direction, n * self.width), []

        def idle():
            engine.flush()
            self.sync()
            self.disturb(regime)
            t0 = time.perf_counter_ns()
            floor(0)
            floors.append(time.perf_counter_ns() - t0)
            self.sync()
            self.disturb(regime)

        ids = regime or ids_kind  # a regime's rows take list ids
        base = dict(
            call=direction, path=path, dir=direction, ids=ids, checks="engine", blocks=n, bytes=n * self.width,
            regime=regime,
        )  # fmt: skip
        before = dict(engine.path_counts)
        try:
            stats = measure(call, engine.flush, idle, self.cfg.reps, self.cfg.warm)
        except ValueError as e:  # refused before any byte moved (GPU-tensor ids on some path, say)
            engine.flush()
            return self.row(**base, status="refused", note=str(e).splitlines()[0][:200])
        except Exception as e:  # recorded, and the other rows go on
            what = f"engine {direction} path={path} ids={ids_kind} blocks={n}"
            FAILURES.append(what)
            print(f"FAILED: {what}", flush=True)
            traceback.print_exc()
            return self.row(**base, status="failed", note=f"{type(e).__name__}: {e}".splitlines()[0][:200])
        paired = statistics.median(floors[self.cfg.warm :]) / 1e3
        return self.row(
            **base, picked=picked(before, engine.path_counts), paired_copy_host_p50_us=paired,
            host_vs_paired_copy=stats["host_p50_us"] / paired, **stats,
        )  # fmt: skip

    def poll_flush_rows(self, engine, path: str, n: int) -> list[dict]:
        calls = self.draw(n)
        cfg = self.cfg
        poll_host, poll_done, flush_host = [], [], []
        gc.disable()
        try:
            for i in range(cfg.warm + cfg.reps):
                engine.flush()
                self.sync()
                g, h = calls[i]
                start = time.perf_counter_ns()
                tid = engine.store(g, h)
                t0 = time.perf_counter_ns()
                reported = tid in engine.poll().stores
                t1 = time.perf_counter_ns()
                deadline = time.monotonic() + SERVE_TIMEOUT
                while not reported:
                    reported = tid in engine.poll().stores
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"poll() did not report store {tid} within {SERVE_TIMEOUT} s")
                t2 = time.perf_counter_ns()
                # The same store again, and flush() with it in flight.
                engine.flush()
                self.sync()
                engine.store(g, h)
                t3 = time.perf_counter_ns()
                engine.flush()
                t4 = time.perf_counter_ns()
                if i >= cfg.warm:
                    poll_host.append(t1 - t0)
                    poll_done.append(t2 - start)
                    flush_host.append(t4 - t3)
        finally:
            gc.enable()
        base = dict(path=path, dir="store", ids="after store", checks="engine", blocks=n, bytes=n * self.width)
        flush = summary(flush_host, flush_host)
        return [
            self.row(call="poll", **base, **summary(poll_host, poll_done)),
            self.row(call="flush", **base, bw=False, **flush),
        ]

    def idle_rows(self, engine, path: str) -> list[dict]:
        engine.flush()
        self.sync()
        base = dict(path=path, dir="-", ids="idle", checks="-", blocks=0, bytes=0)
        rows = []
        for name, fn in (("poll", engine.poll), ("flush", engine.flush)):
            stats = measure(lambda i, fn=fn: fn(), nothing, nothing, self.cfg.reps, self.cfg.warm)
            rows.append(self.row(call=name, **base, **(stats | dict(done_p50_us=None, done_p90_us=None))))
        return rows

    def settle(self, engine) -> None:
        """Untimed 16-block store/flush pairs for ``cfg.settle_s`` seconds (see SETTLE_S)."""
        g, h = self.draw(16)[0]
        deadline = time.perf_counter() + self.cfg.settle_s
        while time.perf_counter() < deadline:
            engine.store(g, h)
            engine.flush()

    def engine_rows(self, path: str) -> list[dict]:
        began = time.perf_counter()
        engine = self.engine(path)
        made = time.perf_counter() - began
        rows = []
        try:
            self.settle(engine)
            for n in BLOCKS:  # this engine's floor, measured next to its rows (see add_baselines)
                for direction in ("store", "load"):
                    rows.append(self.copy_baseline(direction, n * self.width) | dict(blocks=n, path=path))
            for n in BLOCKS:
                for direction in ("store", "load"):
                    for ids_kind in self.cfg.ids_kinds(engine=True):
                        rows.append(self.transfer_row(engine, path, direction, ids_kind, n))
                rows += self.poll_flush_rows(engine, path, n)
            for regime in self.cfg.regimes:  # each after the same disturbance as its own floor
                for n in BLOCKS:
                    for direction in ("store", "load"):
                        floor = self.copy_baseline(direction, n * self.width, regime=regime)
                        rows.append(floor | dict(blocks=n, path=path))
                        rows.append(self.transfer_row(engine, path, direction, "list", n, regime))
            rows += self.idle_rows(engine, path)
        finally:
            engine.close()
        print(f"  engine path={path}: done (construction {made:.2f} s)", flush=True)
        return rows

    # --- ple_ops.OffloadRuntime ----------------------------------------------------------

    def ple_rows(self) -> list[dict]:
        cfg = self.cfg
        dev = cfg.device
        count = cfg.warm + cfg.reps
        gen = torch.Generator().manual_seed(7)
        steps = [torch.randint(0, cfg.ple_vocab, (cfg.ple_tokens,), generator=gen) for _ in range(count)]
        hidden = torch.zeros(cfg.ple_tokens, cfg.ple_dim, device=dev)
        ids = torch.zeros(cfg.ple_tokens, dtype=torch.long, device=dev)
        nbytes = cfg.ple_bytes
        base = dict(family="ple", path="-", dir="load", checks="-", blocks=cfg.ple_tokens, bytes=nbytes)
        rows = [
            self.copy_baseline("load", nbytes, family="ple") | dict(blocks=cfg.ple_tokens),
            self.ple_torch_baseline(steps) | base | dict(call="torch", ids="cpu"),
        ]
        factory = functools.partial(make_ple_model, cfg.ple_layers, cfg.ple_vocab, cfg.ple_dim)
        began = time.perf_counter()
        with ple_ops.OffloadRuntime(factory, max_tokens=cfg.ple_tokens, device=dev, step_timeout=SERVE_TIMEOUT) as rt:
            print(f"  OffloadRuntime started in {time.perf_counter() - began:.2f} s", flush=True)
            t = {k: [] for k in ("prep_h", "prep_d", "fwd_h", "fwd_d", "rel_h", "rel_d")}
            served = rt.served_steps()
            gc.disable()
            try:
                for i in range(count):  # eager steps (also the warm-up every capture needs)
                    self.sync()
                    t0 = time.perf_counter_ns()
                    rt.prepare(steps[i])
                    t1 = time.perf_counter_ns()
                    wait_served(rt, served + i + 1)
                    t2 = time.perf_counter_ns()
                    rt.model(hidden, ids)
                    tf = time.perf_counter_ns()
                    self.sync()
                    t3 = time.perf_counter_ns()
                    rt.release()
                    t4 = time.perf_counter_ns()
                    self.sync()
                    t5 = time.perf_counter_ns()
                    if i >= cfg.warm:
                        t["prep_h"].append(t1 - t0)
                        t["prep_d"].append(t2 - t0)
                        t["fwd_h"].append(tf - t2)
                        t["fwd_d"].append(t3 - t2)
                        t["rel_h"].append(t4 - t3)
                        t["rel_d"].append(t5 - t3)
            finally:
                gc.enable()
            rows.append(self.row(call="prepare", ids="eager", **base, **summary(t["prep_h"], t["prep_d"]), bw=False))
            rows.append(self.row(call="forward", ids="eager", **base, **summary(t["fwd_h"], t["fwd_d"]), bw=False))
            rows.append(self.row(call="release", ids="eager", **base, **summary(t["rel_h"], t["rel_d"]), bw=False))
            if cfg.cuda:
                rows += self.replay_rows(rt, steps, hidden, ids, base)
        return rows

    def ple_torch_baseline(self, steps: list[torch.Tensor]) -> dict:
        """What a user would write with the tables in host memory: index_select each layer's rows
        into one page-locked buffer, one copy_ to the GPU."""
        cfg = self.cfg
        tables = [ple_table(layer, cfg.ple_vocab, cfg.ple_dim) for layer in range(cfg.ple_layers)]
        stage = quiet_pinned((cfg.ple_layers, cfg.ple_tokens, cfg.ple_dim), torch.float32)
        rows = torch.empty(cfg.ple_layers, cfg.ple_tokens, cfg.ple_dim, device=cfg.device)

        def call(i):
            for layer, table in enumerate(tables):
                torch.index_select(table, 0, steps[i], out=stage[layer])
            rows.copy_(stage, non_blocking=True)

        return self.row(**measure(call, self.sync, self.sync, cfg.reps, cfg.warm))

    def replay_rows(self, rt, steps, hidden, ids, base) -> list[dict]:
        """A step captured in a CUDA graph (the eager steps before were its warm-up; captured with
        no step prepared), then prepare() / replay() / release(enqueue=False) each step."""
        cfg = self.cfg
        self.sync()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            rt.model(hidden, ids)
            rt.release()  # inside a capture: records the flag resets, touches no step
        self.sync()
        t = {k: [] for k in ("prep", "replay", "replay_d", "rel", "step", "step_d")}
        gc.disable()
        try:
            for i in range(cfg.warm + cfg.reps):
                self.sync()
                t0 = time.perf_counter_ns()
                rt.prepare(steps[i])
                t1 = time.perf_counter_ns()
                graph.replay()
                t2 = time.perf_counter_ns()
                rt.release(enqueue=False)
                t3 = time.perf_counter_ns()
                self.sync()
                t4 = time.perf_counter_ns()
                if i >= cfg.warm:
                    t["prep"].append(t1 - t0)
                    t["replay"].append(t2 - t1)
                    t["replay_d"].append(t4 - t1)
                    t["rel"].append(t3 - t2)
                    t["step"].append(t3 - t0)
                    t["step_d"].append(t4 - t0)
        finally:
            gc.enable()
        del graph
        return [
            self.row(call="prepare", ids="replay", **base, **summary(t["prep"], None)),
            self.row(call="replay", ids="replay", **base, **summary(t["replay"], t["replay_d"]), bw=False),
            self.row(call="release", ids="replay", **base, **summary(t["rel"], None)),
            self.row(call="step", ids="replay", **base, **summary(t["step"], t["step_d"])),
        ]


def wait_served(rt, steps: int) -> None:
    deadline = time.monotonic() + SERVE_TIMEOUT
    while rt.served_steps() < steps:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the offload process did not serve step {steps} within {SERVE_TIMEOUT} s")


def picked(before: dict, after: dict) -> str:
    """Which paths served the calls between two snapshots of ``engine.path_counts``."""
    diff = {p: n - before.get(p, 0) for p, n in after.items() if n > before.get(p, 0)}
    if len(diff) <= 1:
        return next(iter(diff), "")
    total = sum(diff.values())
    return " + ".join(f"{p} {round(100 * n / total)}%" for p, n in sorted(diff.items(), key=lambda kv: -kv[1]))


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


HEADER = (
    "| call | path | dir | ids | checks | blocks | host p50 us | host p90 us | call-to-done us "
    "| host p50 / copy_ | host p50 / copy_ just before | host p50 / torch | copy_ done / done | torch done / done |"
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
        HEADER,
        "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
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
    colors = {"kernel": "tab:blue", "staged": "tab:green", "dma": "tab:orange", "auto": "tab:red"}
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


def save(rows: list[dict], out: Path, cfg: Config, note: str) -> str:
    write_csv(out / "host_cost.csv", rows, COLUMNS, digits=4, ignore_extra=True)
    table = markdown(rows, cfg, note)
    (out / "host_cost.md").write_text(table)
    if can_plot(out / "host_cost.png"):
        guard("plot", plot, rows, out / "host_cost.png")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_REPS} calls per figure instead of {REPS}")
    parser.add_argument("--reps", type=int, default=None, help="calls per figure (after the warm-up)")
    args = parser.parse_args()
    if args.reps is not None and args.reps < 1:
        parser.error("--reps must be at least 1")
    cfg = make_config(args)
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    where = torch.cuda.get_device_name(cfg.device) if cfg.cuda else "CPU (no CUDA: the tiny smoke configuration)"
    bench = Bench(cfg)
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
    table = save(rows, args.out, cfg, note)
    print("\n" + table, flush=True)
    print(f"host_cost.py took {time.perf_counter() - began:.1f} s", flush=True)
    if FAILURES:
        print("failed: " + "; ".join(FAILURES), flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
