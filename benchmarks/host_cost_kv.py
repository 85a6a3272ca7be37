"""host_cost.py's kv_ops rows: the host time inside copy_blocks, gather_blocks and scatter_blocks,
and inside every ``OffloadEngine`` path's store, load, poll and flush."""

from __future__ import annotations

import gc
import statistics
import time
import traceback
import warnings

import kv_ops

from common import FAILURES, picked  # this script's own directory
from host_cost_bench import BLOCKS, SERVE_TIMEOUT, Bench, measure, nothing, summary


class KvBench(Bench):
    """The ops' and the engine's rows, over :class:`Bench`'s cache and baselines."""

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
        # seconds later, but hardly between two calls a copy apart.
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
