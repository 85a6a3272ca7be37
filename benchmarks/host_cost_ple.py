"""host_cost.py's ple_ops rows: the host time inside ``OffloadRuntime``'s prepare, forward and
release, eager and around a captured step's replay."""

from __future__ import annotations

import functools
import gc
import time

import torch
from torch import nn

import ple_ops

from host_cost_bench import SERVE_TIMEOUT, Bench, measure, quiet_pinned, summary

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


class PleBench(Bench):
    """``ple_ops.OffloadRuntime``'s rows, beside :class:`Bench`'s baselines."""

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
