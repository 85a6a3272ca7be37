"""The decode step as the loop runs it: compiled (or AOT-loaded), captured in a CUDA graph on a GPU,
with the PLE step transaction around each replay."""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from decode_model import Config, DecoderLM


class StepInputs(NamedTuple):
    """One step's inputs (int64), in decode_step's argument order."""

    tokens: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B]
    block_table: torch.Tensor  # [B, max_blocks]
    slot_block: torch.Tensor  # [B]
    slot_offset: torch.Tensor  # [B]


class StepBuffer:
    """A step's inputs as views of one flat int64 tensor, so that they move in one copy.

    ``reset()`` makes every row idle: token 0 at position 0 of the null block 0, which no
    sequence owns (idle rows write there, and nobody reads what they write).
    """

    def __init__(self, cfg: Config, device: torch.device | str = "cpu", pin: bool = False):
        b, m = cfg.batch, cfg.max_blocks
        self.flat = torch.empty(5 * b + b * m, dtype=torch.int64, device=device, pin_memory=pin)
        rows = self.flat[: 5 * b].view(5, b)
        self.inputs = StepInputs(rows[0], rows[1], rows[2], self.flat[5 * b :].view(b, m), rows[3], rows[4])
        self.reset()

    def reset(self) -> StepInputs:
        self.flat.zero_()
        self.inputs.seq_lens.fill_(1)
        return self.inputs


class Step:
    """A compiled (or AOT-loaded) decode step of one model, captured in a CUDA graph on a GPU.

    The graph reads fixed input tensors, so a step copies its inputs there and replays. Why a
    ``torch.cuda.CUDAGraph`` per batch size rather than ``mode="reduce-overhead"``: the same
    capture serves the freshly compiled step and the AOT-loaded one; the KV cache is mutated in
    place with no cudagraph-trees rule on input mutation; and the PLE transaction is explicit:
    warm up with a prepared step, capture with none (nothing runs during capture, so a prepared
    step's flags would go unconsumed), then ``prepare`` / replay / ``release(enqueue=False)``.
    """

    def __init__(self, fn, model: DecoderLM, cfg: Config, device: torch.device, runtime=None):
        self.fn, self.model, self.runtime = fn, model, runtime
        self.static = StepBuffer(cfg, device)
        self.graph = None
        self._running = None  # the launched step's outputs (logits, next tokens), until finish()
        # Times the step's code ran on the host (eager calls and the capture; a replay runs
        # none): what every layer's LayerwiseLoads.waits must equal if the graph kept its waits.
        self.host_runs = 0
        # Host time of each piece of a replayed step (perf_counter seconds), what the PLE
        # transaction adds on the host: prepare, the replay's launch, release(enqueue=False);
        # and "gpu", from an event recorded just before the launch (the GPU is idle then) to one
        # after it: the launch's own latency plus the graph's GPU time. What the step takes
        # beyond that is host time on the critical path (the input copy's call, prepare, the
        # sync's return), so what one step pays over another splits into the two.
        self.host_times: dict[str, list[float]] = {"prepare": [], "replay": [], "release": [], "gpu": []}
        # Recorded outside the timed pieces; read after the step's sync, so never waited on.
        self._gpu_span = (
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            if device.type == "cuda"
            else None
        )
        idle = StepBuffer(cfg)
        for _ in range(2):  # Inductor's kernels compile (and on a GPU tune) on their first calls
            self(idle)
        if device.type == "cuda":
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.outputs = fn(model, *self.static.inputs)
            self.host_runs += 1

    def __call__(self, host: StepBuffer) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one step; returns the logits (on the model's device) and the next tokens (CPU)."""
        self.launch(host)
        return self.finish()

    def launch(self, host: StepBuffer) -> None:
        """Start one step and return while it runs (on a GPU); :meth:`finish` waits for it. The
        caller leaves ``host`` alone until then: its copy to the graph's inputs is asynchronous."""
        self.static.flat.copy_(host.flat, non_blocking=True)
        t0 = time.perf_counter()
        if self.runtime is not None:
            self.runtime.prepare(host.inputs.tokens)
        t1 = launch = time.perf_counter()
        if self.graph is not None and self._gpu_span is not None:
            # Outside the timed pieces: this record is the measurement's own cost (timed inside
            # prepare's, it added tens of microseconds in the loop), and both tables' steps pay it alike.
            self._gpu_span[0].record()
            launch = time.perf_counter()
        if self.graph is not None:
            self.graph.replay()
            outputs = self.outputs
        else:
            outputs = self.fn(self.model, *self.static.inputs)
            self.host_runs += 1
        t2 = time.perf_counter()
        if self.runtime is not None:
            self.runtime.release(enqueue=False)  # the resets are in the step itself
        t3 = time.perf_counter()
        if self.graph is not None:
            if self._gpu_span is not None:
                self._gpu_span[1].record()
            if self.runtime is not None:
                self.host_times["prepare"].append(t1 - t0)
                self.host_times["release"].append(t3 - t2)
            self.host_times["replay"].append(t2 - launch)
        self._running = outputs

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for the step :meth:`launch` started: its logits (on the model's device) and next
        tokens (CPU). The logits stay valid until the next launch."""
        logits, next_tokens = self._running
        next_tokens = next_tokens.cpu()  # after the replay on this stream: both events have run
        if self.graph is not None and self._gpu_span is not None:
            self.host_times["gpu"].append(self._gpu_span[0].elapsed_time(self._gpu_span[1]) / 1e3)
        return logits, next_tokens

    def take_host_times(self) -> dict[str, list[float]]:
        """The pieces' host times since the last call (and start anew)."""
        times, self.host_times = self.host_times, {k: [] for k in self.host_times}
        return times
