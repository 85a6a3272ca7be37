"""The main job: decode with a model whose per-layer embeddings live off the GPU and whose KV
blocks are preempted to host memory (or disk) and back, with a step that is compiled
(``fullgraph=True``), captured in a CUDA graph, and AOT-saved and reloaded in a fresh process.

The model is a small decoder in the style of Gemma-3n with fixed random weights: a token
embedding; N layers of RMSNorm, grouped-query attention over a paged KV cache (a block table,
16 tokens per block) and a gated MLP; and a per-layer embedding (PLE) added in every layer, one
table ``[vocab, layers x ple_dim]`` looked up once per step. The PLE table is served by one of
two transports: ``process`` (``ple_ops.OffloadRuntime``: a CPU process computes the rows, the
graph waits on a flag and pulls them) or ``gather`` (``ple_ops.gather_from_host``: the table sits
in page-locked host memory and one zero-copy kernel in the graph gathers the rows).

What it checks, exiting non-zero on any mismatch:

* the run with KV memory pressure (sequences preempted to the ``kv_ops.OffloadEngine`` and
  loaded back into other GPU blocks) and the run of the AOT artifact in a fresh process give
  logits bitwise equal to the run without pressure, for every sequence at every position;
  a resumed sequence's blocks are loaded layer by layer by the step that first reads them
  (``kv_ops.LayerwiseLoads``: every layer waits only for its own blocks), and once more, for the
  report, by load, flush, then step;
* every layer's ``kv_ops.wait_layer`` ran at every host run of the compiled (or loaded) step;
* the same model with its PLE table on the GPU gives the same tokens (the largest logit
  difference is reported: Inductor may round a fused table lookup differently);
* every other transport asked for gives the same tokens.

Usage::

    python examples/decode_loop.py                          # small on CPU, Gemma-3n widths on a GPU
    python examples/decode_loop.py --ple-transport gather   # one transport only
    python examples/decode_loop.py --disk /nvme/kv          # preempt through the disk tier too
    python examples/decode_loop.py --resume flush           # process B resumes by load, flush, step

The last line is ``decode loop: tokens match`` or ``decode loop: MISMATCH ...``.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import kv_ops
import kv_ops.tools.aot
import ple_ops

# The LayerwiseLoads every layer's wait_layer names. The graph carries only this string, so each
# process (the AOT-loading one too) makes its own instance of this name before it runs the step.
LOADS = "decode_loop.resume"
RESUME_MODES = ("layerwise", "flush")

# --- the model ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """Model widths and the workload: ``batch`` sequences decoded together, each with a prompt of
    ``prompt`` tokens and ``total`` tokens in the end (both drawn from the closed ranges)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    ple_dim: int
    batch: int
    prompt: tuple[int, int]
    total: tuple[int, int]
    block_size: int = 16

    @property
    def max_blocks(self) -> int:
        """Blocks one sequence needs at most (its last token is sampled, never written)."""
        return math.ceil((self.total[1] - 1) / self.block_size)


CONFIGS = {
    # CI's CPU: seconds per compile, under two minutes in all.
    "small": Config(
        vocab=512,
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=16,
        mlp=128,
        ple_dim=16,
        batch=4,
        prompt=(3, 9),
        total=(40, 60),
    ),
    # The "realistic widths": Gemma-3n E2B's hidden, MLP and PLE sizes, 8 layers, 8 sequences.
    "gemma": Config(
        vocab=32768,
        hidden=2048,
        layers=8,
        heads=16,
        kv_heads=8,
        head_dim=128,
        mlp=8192,
        ple_dim=256,
        batch=8,
        prompt=(8, 32),
        total=(160, 256),
    ),
}


def _weight(seed: int, *shape: int, scale: float) -> nn.Parameter:
    # One generator per tensor: both processes of the process transport, and the placeholder
    # build that skips the PLE table, get the same weights whatever else they built before.
    gen = torch.Generator().manual_seed(seed)
    return nn.Parameter(torch.randn(*shape, generator=gen) * scale, requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, seed: int):
        super().__init__()
        self.weight = _weight(seed, dim, scale=0.1)
        with torch.no_grad():
            self.weight.add_(1.0)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Linear(nn.Module):
    def __init__(self, fan_in: int, fan_out: int, seed: int):
        super().__init__()
        self.weight = _weight(seed, fan_out, fan_in, scale=fan_in**-0.5)

    def forward(self, x):
        return F.linear(x, self.weight)


class PerLayerEmbedding(ple_ops.PleOffloadLayer):
    """Gemma-3n's per-layer embedding: rows ``[n, layers x ple_dim]`` of one table, a pure lookup."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.table = _weight(7, cfg.vocab, cfg.layers * cfg.ple_dim, scale=1.0)

    def forward_impl(self, input_ids):
        return self.table[input_ids.to(self.table.device)]

    def lookup_table(self):
        return self.table


class Slots(NamedTuple):
    """Where each batch row's token sits in the paged KV cache (all int64, one row per slot)."""

    positions: torch.Tensor  # [B] position of the token in its sequence
    seq_lens: torch.Tensor  # [B] tokens visible to attention, this one included
    block_table: torch.Tensor  # [B, max_blocks] GPU block of each logical block
    slot_block: torch.Tensor  # [B] block this token's K and V are written to
    slot_offset: torch.Tensor  # [B] row within that block


def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[B, heads, head_dim]`` at ``positions`` ``[B]``."""
    half = x.shape[-1] // 2
    inv_freq = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angle = positions[:, None].to(torch.float32) * inv_freq
    cos, sin = angle.cos()[:, None, :].to(x.dtype), angle.sin()[:, None, :].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    """Grouped-query attention over a paged KV cache ``[2, num_blocks, block_size, kv_heads, head_dim]``."""

    def __init__(self, cfg: Config, seed: int):
        super().__init__()
        self.cfg = cfg
        self.q = Linear(cfg.hidden, cfg.heads * cfg.head_dim, seed)
        self.k = Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, seed + 1)
        self.v = Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, seed + 2)
        self.o = Linear(cfg.heads * cfg.head_dim, cfg.hidden, seed + 3)

    def forward(self, x, slots: Slots):
        cfg, batch = self.cfg, x.shape[0]
        q = rotate(self.q(x).view(batch, cfg.heads, cfg.head_dim), slots.positions)
        k = rotate(self.k(x).view(batch, cfg.kv_heads, cfg.head_dim), slots.positions)
        v = self.v(x).view(batch, cfg.kv_heads, cfg.head_dim)
        # This token's K and V go into its slot first, so that it attends to itself below.
        self.kv_cache[:, slots.slot_block, slots.slot_offset] = torch.stack([k, v])
        keys = self.kv_cache[0][slots.block_table].flatten(1, 2)  # [B, max_blocks * block_size, kv_heads, D]
        values = self.kv_cache[1][slots.block_table].flatten(1, 2)
        q = q.view(batch, cfg.kv_heads, cfg.heads // cfg.kv_heads, cfg.head_dim)
        scores = torch.einsum("bhgd,bthd->bhgt", q, keys) * cfg.head_dim**-0.5
        # Masked positions get exactly zero weight, so whatever finite bytes sit in blocks a row
        # does not own (other sequences', the null block) cannot change its result by one bit.
        visible = torch.arange(keys.shape[1], device=x.device)[None, :] < slots.seq_lens[:, None]
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        out = torch.einsum("bhgt,bthd->bhgd", scores.softmax(dim=-1), values)
        return self.o(out.reshape(batch, cfg.heads * cfg.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Config, index: int):
        super().__init__()
        self.index = index
        seed = 1000 * (index + 1)
        self.attn_norm = RMSNorm(cfg.hidden, seed)
        self.attn = Attention(cfg, seed + 10)
        self.mlp_norm = RMSNorm(cfg.hidden, seed + 20)
        self.gate = Linear(cfg.hidden, cfg.mlp, seed + 21)
        self.up = Linear(cfg.hidden, cfg.mlp, seed + 22)
        self.down = Linear(cfg.mlp, cfg.hidden, seed + 23)
        self.ple_gate = Linear(cfg.hidden, cfg.ple_dim, seed + 30)
        self.ple_proj = Linear(cfg.ple_dim, cfg.hidden, seed + 31)
        self.ple_norm = RMSNorm(cfg.hidden, seed + 32)

    def forward(self, h, slots: Slots):
        # Before the attention writes this token's K and V into its cache and reads the blocks:
        # the stream waits until this layer's blocks of a resumed sequence have landed (layer
        # i+1's may still be on the way). It takes h, the previous layer's output, so that the
        # compiler cannot hoist it above that layer, and declares the cache mutated, so that no
        # read or write of the cache moves above it. With no load started it waits on completed
        # events (on the CPU it only counts: the engine copied at start).
        h = kv_ops.wait_layer(h, LOADS, self.index, [self.attn.kv_cache])
        h = h + self.attn(self.attn_norm(h), slots)
        x = self.mlp_norm(h)
        return h + self.down(F.gelu(self.gate(x), approximate="tanh") * self.up(x))

    def add_per_layer(self, h, rows):
        """Gemma-3n's per-layer input: this layer's embedding rows ``[B, ple_dim]``, gated by the
        hidden state, projected back and added."""
        gated = F.gelu(self.ple_gate(h), approximate="tanh") * rows
        return h + self.ple_norm(self.ple_proj(gated))


class DecoderLM(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.embed = _weight(1, cfg.vocab, cfg.hidden, scale=1.0)
        self.per_layer = PerLayerEmbedding(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, 2)
        self.lm_head = Linear(cfg.hidden, cfg.vocab, 3)

    def attach_kv_cache(self, num_blocks: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Give every layer a zeroed cache (finite bytes everywhere); returns them by layer name."""
        cfg = self.cfg
        caches = {}
        for i, layer in enumerate(self.layers):
            cache = torch.zeros(2, num_blocks, cfg.block_size, cfg.kv_heads, cfg.head_dim, device=device)
            layer.attn.register_buffer("kv_cache", cache, persistent=False)
            caches[f"layers.{i}"] = cache
        return caches

    def forward(self, tokens, slots: Slots):
        cfg = self.cfg
        h = self.embed[tokens]
        rows = None
        for i, layer in enumerate(self.layers):
            h = layer(h, slots)
            if rows is None:
                # Asked for after layer 0's attention and MLP (they are the op's dependency), so
                # the offload process computes the rows while the GPU runs them.
                rows = self.per_layer(h, tokens).view(-1, cfg.layers, cfg.ple_dim)
            h = layer.add_per_layer(h, rows[:, i])
        return self.lm_head(self.norm(h))

    def release_offloaded(self) -> None:
        self.per_layer.release_offloaded()


def make_model(cfg: Config) -> DecoderLM:
    """The model factory both processes of the process transport call (module level: picklable)."""
    return DecoderLM(cfg).eval()


def decode_step(model: DecoderLM, tokens, positions, seq_lens, block_table, slot_block, slot_offset):
    """One decode step of every batch row: logits and the greedy next tokens. The model is the
    first argument (the AOT recipe, kv_ops.tools.aot), and the graph holds the PLE flag resets."""
    logits = model(tokens, Slots(positions, seq_lens, block_table, slot_block, slot_offset))
    model.release_offloaded()
    return logits, logits.argmax(dim=-1)


# --- the step: compiled, captured, with its PLE transaction ------------------------------------


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
        # Times the step's code ran on the host (eager calls and the capture; a replay runs
        # none): what every layer's LayerwiseLoads.waits must equal if the graph kept its waits.
        self.host_runs = 0
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
        # Asynchronous from pinned memory; the caller rewrites it only after the .cpu() below.
        self.static.flat.copy_(host.flat, non_blocking=True)
        if self.runtime is not None:
            self.runtime.prepare(host.inputs.tokens)
        if self.graph is not None:
            self.graph.replay()
            logits, next_tokens = self.outputs
        else:
            logits, next_tokens = self.fn(self.model, *self.static.inputs)
            self.host_runs += 1
        if self.runtime is not None:
            self.runtime.release(enqueue=False)  # the resets are in the step itself
        return logits, next_tokens.cpu()


# --- the scheduler: batch slots, a block pool too small, preemption --------------------------


@dataclass
class Sequence:
    index: int  # its batch slot, for its whole life: a row's result never depends on its slot,
    #             but keeping it makes that one less thing to trust
    tokens: list[int]  # prompt, then generated tokens
    prompt_len: int
    total: int
    done: int = 0  # tokens whose K and V are in the cache
    blocks: list[int] = field(default_factory=list)  # GPU blocks while running
    host_blocks: list[int] | None = None  # host (or disk) blocks while preempted

    @property
    def finished(self) -> bool:
        return len(self.tokens) == self.total


def make_sequences(cfg: Config, seed: int = 0) -> list[Sequence]:
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(cfg.batch):
        prompt_len = int(torch.randint(cfg.prompt[0], cfg.prompt[1] + 1, (), generator=gen))
        total = int(torch.randint(cfg.total[0], cfg.total[1] + 1, (), generator=gen))
        prompt = torch.randint(1, cfg.vocab, (prompt_len,), generator=gen).tolist()
        seqs.append(Sequence(i, prompt, prompt_len, total))
    return seqs


@dataclass
class KVTraffic:
    preemptions: int = 0
    resumptions: int = 0
    stored_bytes: int = 0
    loaded_bytes: int = 0
    store_seconds: float = 0.0  # from the call to the end of the flush
    load_seconds: float = 0.0  # the same, of load-then-step's loads (layer-wise loads have no flush)
    # Per flushed transfer, both directions: seconds inside the engine's store/load call (host
    # work), and from the call to the end of its flush.
    call_times: list[float] = field(default_factory=list)
    flush_times: list[float] = field(default_factory=list)
    # Per layer-wise load: seconds inside LayerwiseLoads.start (host work; the copies go on).
    start_times: list[float] = field(default_factory=list)
    # Per step that resumed a sequence: from the call that loads its blocks (start, or load)
    # to the end of the step (its tokens on the host).
    resume_step_times: list[float] = field(default_factory=list)
    paths: dict[str, int] = field(default_factory=dict)  # transfers per engine path (kernel, dma, layerwise)


class Scheduler:
    """Decodes ``seqs`` with at most ``gpu_blocks`` KV blocks on the GPU.

    When a running sequence needs a block and none is free, another running sequence is
    preempted: its blocks are stored to the engine (host memory or disk), the store is flushed,
    and the blocks are freed. A preempted sequence resumes once its blocks, plus one block for
    each running sequence, fit: it is given whatever blocks are free (other ids than before), its
    block table is rewritten, and it goes on where it stopped. Its blocks are loaded by
    :meth:`load_resumed`, just before the step that first reads them: with ``loads`` (a
    :class:`kv_ops.LayerwiseLoads` of ``engine``) layer by layer, each layer of the step waiting
    for its own blocks; without, by load, flush, then step.
    """

    def __init__(
        self,
        cfg: Config,
        seqs: list[Sequence],
        gpu_blocks: int,
        engine: kv_ops.OffloadEngine | None,
        loads: kv_ops.LayerwiseLoads | None = None,
    ):
        if gpu_blocks < cfg.max_blocks:
            raise ValueError(f"{gpu_blocks} GPU blocks cannot hold one sequence of {cfg.max_blocks} blocks")
        if loads is not None and loads.engine is not engine:
            raise ValueError("the LayerwiseLoads must belong to this run's engine")
        self.cfg, self.seqs, self.engine, self.loads = cfg, seqs, engine, loads
        self.free = list(range(gpu_blocks, 0, -1))  # block 0 is the null block, never handed out
        self.free_host = list(range(engine.num_host_blocks - 1, -1, -1)) if engine is not None else []
        self.preempted: list[Sequence] = []  # oldest first
        self.resuming: list[tuple[Sequence, list[int], list[int]]] = []  # this step's (seq, host, gpu)
        # Layer-wise loads in flight: transfer id -> the host blocks it reads. They go back to
        # free_host only once the engine reports the transfer (a store into them before that
        # could overwrite bytes still on their way to the GPU).
        self.loading: dict[int, list[int]] = {}
        self.traffic = KVTraffic()
        self.buffer = StepBuffer(cfg, pin=torch.cuda.is_available())

    def running(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished and s.host_blocks is None]

    def _needs_block(self, seq: Sequence) -> bool:
        return seq.done == len(seq.blocks) * self.cfg.block_size

    def _reclaim(self, report: kv_ops.Completed) -> None:
        """Free the host blocks of the layer-wise loads ``report`` says are done (any poll or
        flush may be the one that reports them)."""
        if report.failed:
            raise RuntimeError(f"KV transfers failed: {report.failed}")
        for tid in report.loads:
            host = self.loading.pop(tid, None)  # None: a flushed load, freed by its caller
            if host is not None:
                self.free_host += reversed(host)

    def _wait_for(self, what: str, transfer) -> float:
        """Issue one engine transfer and flush it: the blocks are reused (a store) or read (a load)
        right after. Returns the seconds from the call to the end of the flush."""
        start = time.perf_counter()
        transfer()
        self.traffic.call_times.append(time.perf_counter() - start)
        report = self.engine.flush()
        if report.failed:
            raise RuntimeError(f"{what} failed: {report.failed}")
        self._reclaim(report)
        self.traffic.flush_times.append(time.perf_counter() - start)
        return self.traffic.flush_times[-1]

    def _preempt(self, seq: Sequence) -> None:
        if any(seq is s for s, _, _ in self.resuming):
            # Cannot happen: a sequence resumes only with a free block left for every running
            # sequence, so nothing is preempted in the plan that resumed it. Were it preempted,
            # its store would read GPU blocks whose load has not started.
            raise RuntimeError(f"sequence {seq.index} preempted before its resumed blocks were loaded")
        if self.engine is not None and len(self.free_host) < len(seq.blocks) and self.loading:
            self._reclaim(self.engine.flush())  # host blocks still held by layer-wise loads
        if self.engine is None or len(self.free_host) < len(seq.blocks):
            raise RuntimeError("out of KV blocks with nowhere to preempt to")
        host = [self.free_host.pop() for _ in seq.blocks]
        self.traffic.store_seconds += self._wait_for(
            f"storing the blocks of sequence {seq.index}", lambda: self.engine.store(seq.blocks, host)
        )
        self.traffic.stored_bytes += len(host) * self.engine.block_bytes
        self.traffic.preemptions += 1
        self.free += reversed(seq.blocks)
        seq.blocks, seq.host_blocks = [], host
        self.preempted.append(seq)

    def _resume(self, seq: Sequence) -> None:
        blocks = [self.free.pop() for _ in seq.host_blocks]
        # A copy: plan() may append this step's new block to seq.blocks, which has nothing to load.
        self.resuming.append((seq, seq.host_blocks, list(blocks)))  # loaded by load_resumed()
        self.traffic.loaded_bytes += len(blocks) * self.engine.block_bytes
        self.traffic.resumptions += 1
        seq.blocks, seq.host_blocks = blocks, None
        self.preempted.remove(seq)

    def load_resumed(self) -> bool:
        """Load the blocks of the sequences :meth:`plan` resumed, as one transfer; call it just
        before the step that first reads them. Returns whether there were any."""
        if not self.resuming:
            return False
        host = [h for _, hs, _ in self.resuming for h in hs]
        gpu = [g for _, _, gs in self.resuming for g in gs]
        self.resuming = []
        start = time.perf_counter()
        if self.loads is not None:
            # Before the step (the replay), never after: a captured wait sees the events'
            # records as of the replay's launch. The copies are ordered after the work already
            # on this stream (the last step, which may have read these GPU blocks for another
            # sequence), and each layer of the step waits only for its own.
            tid = self.loads.start(host, gpu)
            self.traffic.start_times.append(time.perf_counter() - start)
            self.loading[tid] = host
        else:
            self.traffic.load_seconds += self._wait_for("loading resumed blocks", lambda: self.engine.load(host, gpu))
            self.free_host += reversed(host)
        return True

    def collect(self) -> None:
        """After a step: take back the host blocks of the layer-wise loads that have landed."""
        if self.loading:
            self._reclaim(self.engine.poll())

    def finish(self) -> None:
        """At the end of a run: nothing in flight on the engine, which the next run reuses."""
        if self.engine is not None:
            self._reclaim(self.engine.flush())
        if self.loading:
            raise RuntimeError(f"layer-wise loads {sorted(self.loading)} were never reported")

    def plan(self) -> StepBuffer | None:
        """The next step's inputs, after resuming and preempting; None when every sequence is done."""
        cfg = self.cfg
        for seq in list(self.preempted):
            need = len(seq.host_blocks) + (seq.done % cfg.block_size == 0) + len(self.running())
            if len(self.free) < need:
                break  # in order: the oldest preempted sequence goes first
            self._resume(seq)
        for seq in self.running():
            if seq.host_blocks is None and self._needs_block(seq):
                while not self.free:
                    victims = [s for s in self.running() if s is not seq and s.blocks]
                    self._preempt(max(victims, key=lambda s: s.index) if victims else seq)
                if seq.host_blocks is None:
                    seq.blocks.append(self.free.pop())
        rows = self.running()
        if not rows and not self.preempted:
            return None
        if not rows:
            raise RuntimeError(f"no sequence can run: {len(self.free)} free blocks, {len(self.preempted)} preempted")
        inputs = self.buffer.reset()
        for seq in rows:
            i, p = seq.index, seq.done
            inputs.tokens[i] = seq.tokens[p]
            inputs.positions[i] = p
            inputs.seq_lens[i] = p + 1
            inputs.block_table[i, : len(seq.blocks)] = torch.tensor(seq.blocks)
            inputs.slot_block[i] = seq.blocks[p // cfg.block_size]
            inputs.slot_offset[i] = p % cfg.block_size
        return self.buffer

    def advance(self, next_tokens: torch.Tensor) -> list[tuple[int, int]]:
        """Account for a finished step; returns the (sequence, position) of every row that ran."""
        ran = []
        for seq in self.running():
            ran.append((seq.index, seq.done))
            seq.done += 1
            if seq.done == len(seq.tokens):  # the last known token was processed: sample the next
                seq.tokens.append(int(next_tokens[seq.index]))
            if seq.finished:
                self.free += reversed(seq.blocks)
                seq.blocks = []
        return ran


# --- a run --------------------------------------------------------------------------------------


@dataclass
class Run:
    tokens: list[list[int]]
    logits: dict[tuple[int, int], torch.Tensor]  # (sequence, position) -> logits row (reference only)
    step_seconds: list[float]
    traffic: KVTraffic


def decode(
    step: Step,
    caches,
    cfg: Config,
    gpu_blocks: int,
    engine=None,
    loads=None,
    keep_logits=False,
    compare_to=None,
    label="",
):
    """Decode the workload with ``step``; with ``compare_to``, check every row bitwise as it comes.
    With ``loads``, resumed sequences are loaded layer by layer by the step itself."""
    for cache in caches.values():
        cache.zero_()  # finite bytes in every block, whatever ran before
    seqs = make_sequences(cfg)
    sched = Scheduler(cfg, seqs, gpu_blocks, engine, loads)
    logits_rows: dict[tuple[int, int], torch.Tensor] = {}
    mismatches: list[tuple[int, int]] = []
    times = []
    total = sum(s.total - 1 for s in seqs)
    shown = 0
    while (inputs := sched.plan()) is not None:
        start = time.perf_counter()
        resumed = sched.load_resumed()
        stepped = time.perf_counter()
        logits, next_tokens = step(inputs)
        end = time.perf_counter()  # next_tokens are on the host: the step has finished
        times.append(end - stepped)
        if resumed:
            sched.traffic.resume_step_times.append(end - start)
        sched.collect()
        ran = sched.advance(next_tokens)
        if keep_logits or compare_to is not None:
            for seq, pos in ran:
                row = logits[seq]
                if keep_logits:
                    logits_rows[(seq, pos)] = row.clone()
                if compare_to is not None and not torch.equal(row, compare_to[(seq, pos)]):
                    mismatches.append((seq, pos))
        done = sum(s.done for s in seqs)
        if done * 10 // total > shown:  # a plain progress line every tenth
            shown = done * 10 // total
            print(f"  {label}: {done}/{total} tokens", file=sys.stderr, flush=True)
    sched.finish()
    if mismatches:
        raise Mismatch(f"{label}: {len(mismatches)} logits rows differ from the reference, first {mismatches[:3]}")
    return Run([s.tokens for s in seqs], logits_rows, times, sched.traffic)


class Mismatch(Exception):
    pass


def blocks_needed(cfg: Config) -> int:
    return sum(math.ceil((s.total - 1) / cfg.block_size) for s in make_sequences(cfg))


def pressure_blocks(cfg: Config) -> int:
    """About 60% of what the workload needs at once: several preemptions, never a deadlock."""
    return max(cfg.max_blocks + 1, int(blocks_needed(cfg) * 0.6))


def make_engine(caches, cfg: Config, disk: str | None) -> kv_ops.OffloadEngine:
    """An engine with room for every block of the workload, warmed up as a server would at start:
    the first transfer of each direction compiles its copy kernel (a tenth of a second), and each
    new size of id list costs a page-locked allocation. The caches hold nothing yet (a run zeroes
    them before it starts), so any blocks will do."""
    num_blocks = next(iter(caches.values())).shape[1]
    block_bytes = kv_ops.block_bytes(kv_ops.infer_regions(caches, num_blocks))
    engine = kv_ops.OffloadEngine(caches, num_blocks, capacity_bytes=blocks_needed(cfg) * block_bytes, disk_dir=disk)
    for count in range(1, cfg.max_blocks + 1):
        ids = list(range(1, count + 1))
        engine.store(ids, [i - 1 for i in ids])
        engine.flush()
        engine.load([i - 1 for i in ids], ids)
        engine.flush()
    return engine


# --- transports: building the model each one needs --------------------------------------------


class Built(NamedTuple):
    model: DecoderLM
    caches: dict[str, torch.Tensor]
    runtime: ple_ops.OffloadRuntime | None
    engine: kv_ops.OffloadEngine  # host memory: the pressure runs' and the LayerwiseLoads'
    loads: kv_ops.LayerwiseLoads  # named LOADS: every run's waits resolve to it

    def close(self) -> None:
        self.loads.close()
        self.engine.close()
        if self.runtime is not None:
            self.runtime.close()


def build(transport: str, cfg: Config, device: torch.device) -> Built:
    """``process``: PLE table in an offload process; ``gather``: in page-locked host memory;
    ``gpu``: on the GPU (the local model, the reference for tokens).

    Every model gets a host-memory engine and the LayerwiseLoads its layers wait on, made before
    the step is compiled, warmed up and captured: the waits need a live instance of the name
    in every run (with no pressure nothing is started, and they find completed events), and a
    captured graph waits on the events of the instance that was live at its capture."""
    runtime = None
    if transport == "process":
        runtime = ple_ops.OffloadRuntime(functools.partial(make_model, cfg), max_tokens=cfg.batch, device=device)
        model = runtime.model
    elif transport == "gather":
        model = ple_ops.gather_from_host(make_model(cfg), device)
    else:
        model = make_model(cfg).to(device)
    caches = model.attach_kv_cache(blocks_needed(cfg) + 1, device)
    try:
        engine = make_engine(caches, cfg, None)
        loads = kv_ops.LayerwiseLoads(engine, LOADS)  # one layer per cache tensor: layers.0, layers.1, ...
    except BaseException:
        if runtime is not None:
            runtime.close()
        raise
    for count in range(1, cfg.max_blocks + 1):  # as make_engine's warm-up, for the layer-wise path
        loads.start(list(range(count)), list(range(1, count + 1)))
    engine.flush()
    return Built(model, caches, runtime, engine, loads)


def compiled_step(built: Built, cfg: Config, device: torch.device, save_to: str | None = None) -> Step:
    example = StepBuffer(cfg, device).inputs
    if save_to is None:
        fn = torch.compile(decode_step, fullgraph=True)
    else:
        fn = kv_ops.tools.aot.compile_step(decode_step, built.model, *example)
        fn.save_compiled_function(save_to)
    return Step(fn, built.model, cfg, device, built.runtime)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --- the two processes ---------------------------------------------------------------------------


def pressure_runs(step: Step, built: Built, cfg: Config, runs, disk: str | None, compare_to, label: str):
    """Decode under KV pressure once per ``(tier, mode)`` of ``runs``, every row checked bitwise;
    returns ``(tier, mode, Run)`` each, with the engine paths that run used."""
    out = []
    for tier, mode in runs:
        # The disk tier loads, flushes, then steps: LayerwiseLoads reads a host-memory engine's
        # mirror and refuses a disk engine (ValueError).
        engine = make_engine(built.caches, cfg, disk) if tier == "disk" else built.engine
        try:
            before = dict(engine.path_counts)
            run = decode(
                step,
                built.caches,
                cfg,
                pressure_blocks(cfg),
                engine,
                built.loads if mode == "layerwise" else None,
                compare_to=compare_to,
                label=f"{label}, KV pressure, {tier}, resume {mode}",
            )
            run.traffic.paths = {k: n - before.get(k, 0) for k, n in engine.path_counts.items()}
        finally:
            if engine is not built.engine:
                engine.close()
        out.append((tier, mode, run))
    return out


def pressure_plan(args, both: bool) -> list[tuple[str, str]]:
    """The pressure runs: host memory resuming by ``--resume`` (and by the other mode too, for
    the report's comparison, when ``both``), then the disk tier if asked for."""
    modes = [args.resume] + ([m for m in RESUME_MODES if m != args.resume] if both else [])
    return [("host memory", m) for m in modes] + ([("disk", "flush")] if args.disk else [])


def check_waits(built: Built, step: Step) -> tuple[str, bool]:
    """Whether every layer's wait ran at every host run of the step (so the compiled or loaded
    graph, and the capture, kept a wait in each layer), and a line that says so."""
    waits = built.loads.waits.tolist()
    ok = waits == [step.host_runs] * len(waits)
    verdict = "every layer's wait ran at each" if ok else "MISMATCH: not every layer's wait ran at each"
    return f"layer-wise waits: {verdict} of the step's {step.host_runs} host runs (waits per layer {waits})", ok


def reload_and_decode(args, cfg: Config, device: torch.device) -> int:
    """Process B: a fresh runtime and engine, its own LayerwiseLoads of the same name (the loaded
    graph carries only the name), the AOT artifact, the pressure runs, bitwise check."""
    reference = torch.load(args.expect)
    expected = {key: row.to(device) for key, row in reference["logits"].items()}
    built = build(args.ple_transport[0], cfg, device)
    try:
        step = Step(kv_ops.tools.aot.load_step(args.artifact), built.model, cfg, device, built.runtime)
        runs = pressure_runs(step, built, cfg, pressure_plan(args, both=False), args.disk, expected, "B, AOT-loaded")
        waits, waits_ok = check_waits(built, step)
    except Mismatch as e:
        print(f"AOT reload: MISMATCH {e}", flush=True)
        return 1
    finally:
        built.close()
    ok = waits_ok
    for tier, mode, run in runs:
        same = run.tokens == reference["tokens"]
        ok = ok and same
        print(
            f"AOT reload in a fresh process ({tier}, resume {mode}): {len(reference['logits'])} logits rows bitwise "
            f"equal, {run.traffic.preemptions} preemptions, {run.traffic.paths.get('layerwise', 0)} layer-wise "
            f"loads, tokens {'match' if same else 'MISMATCH'}",
            flush=True,
        )
    print(f"AOT reload: {waits}", flush=True)
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), help="default: gemma on a GPU, small on the CPU")
    parser.add_argument(
        "--ple-transport",
        choices=["process", "gather"],
        action="append",
        help="PLE transports to run (repeatable); the first one also runs the pressure and "
        "AOT checks. Default: process, then gather",
    )
    parser.add_argument(
        "--disk", help="also preempt KV blocks to a file in this directory (resumed by load, flush, then step)"
    )
    parser.add_argument(
        "--resume",
        choices=RESUME_MODES,
        default="layerwise",
        help="how a resumed sequence's blocks come back from host memory: layer by layer inside the step "
        "that reads them (default), or load, flush, then step. Process B runs this one; the main process "
        "runs both, this one first, for the report",
    )
    parser.add_argument("--role", choices=["main", "load"], default="main", help=argparse.SUPPRESS)
    parser.add_argument("--artifact", help=argparse.SUPPRESS)
    parser.add_argument("--expect", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.ple_transport = args.ple_transport or ["process", "gather"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = CONFIGS[args.config or ("gemma" if device.type == "cuda" else "small")]
    torch.set_grad_enabled(False)  # inference: compiled and loaded steps run without autograd
    # TF32 matmuls on a GPU: the step's speed is what the PLE transports are measured against.
    # The checks still hold bitwise: every run computes on the same inputs with the same kernels.
    torch.set_float32_matmul_precision("high")
    if device.type == "cpu":
        import warnings

        warnings.filterwarnings("ignore", message=".*CUDA is not available.*")  # pinned_empty's fallback
    if args.role == "load":
        return reload_and_decode(args, cfg, device)
    return run_demo(args, cfg, device)


def run_demo(args, cfg: Config, device: torch.device) -> int:
    primary = args.ple_transport[0]
    print(
        f"decode loop on {device}: {cfg.layers} layers, hidden {cfg.hidden}, {cfg.batch} sequences of "
        f"{cfg.total[0]}-{cfg.total[1]} tokens, PLE table {cfg.vocab} x {cfg.layers * cfg.ple_dim}",
        flush=True,
    )
    failures: list[str] = []
    results: dict[str, Run] = {}
    with tempfile.TemporaryDirectory(prefix="decode-loop-") as tmp:
        artifact, expect = os.path.join(tmp, "step.aot"), os.path.join(tmp, "reference.pt")

        # 1. The primary transport: compiled ahead of time and saved, then the reference run (no
        #    pressure) and the runs with preemption, all bitwise: in host memory resuming layer by
        #    layer and by load-then-step (the report compares them), then the disk tier if asked.
        built = build(primary, cfg, device)
        pressured: list[tuple[str, str, Run]] = []
        try:
            start = time.perf_counter()
            step = compiled_step(built, cfg, device, save_to=artifact)
            print(
                f"compiled, saved and captured the {primary}-transport step in {time.perf_counter() - start:.0f} s",
                flush=True,
            )
            reference = decode(
                step, built.caches, cfg, blocks_needed(cfg), keep_logits=True, label=f"{primary}, no pressure"
            )
            results[primary] = reference
            torch.save(
                {"logits": {k: v.cpu() for k, v in reference.logits.items()}, "tokens": reference.tokens}, expect
            )
            plan = pressure_plan(args, both=True)
            for tier, mode, run in pressure_runs(step, built, cfg, plan, args.disk, reference.logits, primary):
                kv = run.traffic
                print(
                    f"KV pressure ({pressure_blocks(cfg)} of {blocks_needed(cfg)} blocks, {tier}, resume {mode}): "
                    f"{kv.preemptions} preemptions, {kv.resumptions} resumptions, {kv.paths.get('layerwise', 0)} "
                    "layer-wise loads, every logits row bitwise equal",
                    flush=True,
                )
                if run.tokens != reference.tokens:  # implied by the logits; checked all the same
                    failures.append(f"KV pressure, {tier}, resume {mode}: tokens differ")
                pressured.append((tier, mode, run))
            waits, waits_ok = check_waits(built, step)
            print(waits, flush=True)
            if not waits_ok:
                failures.append(f"{primary}: {waits}")
        except Mismatch as e:
            failures.append(str(e))
        finally:
            built.close()

        # 2. Process B: a fresh process loads the artifact and decodes under pressure.
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--role",
            "load",
            "--artifact",
            artifact,
            "--expect",
            expect,
            "--config",
            next(k for k, v in CONFIGS.items() if v == cfg),
            "--ple-transport",
            primary,
        ]
        cmd += ["--resume", args.resume] + (["--disk", args.disk] if args.disk else [])
        if subprocess.run(cmd, timeout=1800).returncode != 0:
            failures.append("the AOT-loaded step in a fresh process did not reproduce the reference")

    # 3. The PLE table on the GPU, and the other transports: same tokens.
    max_diff = 0.0
    for transport in ["gpu"] + args.ple_transport[1:]:
        built = build(transport, cfg, device)
        try:
            step = compiled_step(built, cfg, device)
            run = decode(
                step,
                built.caches,
                cfg,
                blocks_needed(cfg),
                keep_logits=transport == "gpu",
                label=f"{transport} transport" if transport != "gpu" else "PLE table on the GPU",
            )
            waits, waits_ok = check_waits(built, step)
        finally:
            built.close()
        if not waits_ok:
            failures.append(f"{transport}: {waits}")
        results[transport] = run
        if run.tokens != reference.tokens:
            failures.append(f"{transport}: tokens differ from the {primary} transport's")
        if transport == "gpu":
            max_diff = max((run.logits[k] - v).abs().max().item() for k, v in reference.logits.items())
    report(cfg, device, results, pressured, max_diff)
    if failures:
        print("decode loop: MISMATCH " + "; ".join(failures))
        return 1
    print("decode loop: tokens match")
    return 0


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def _us(values: list[float]) -> str:
    """Median (max) in microseconds."""
    return f"{percentile(values, 0.5) * 1e6:.0f} ({max(values) * 1e6:.0f})" if values else "-"


def report(cfg: Config, device: torch.device, results: dict[str, Run], pressured, max_diff: float) -> None:
    """The table the README quotes: step time per PLE placement as a ratio to the table in the
    model, tokens/s, the memory moved off the GPU; the KV traffic of each pressure run; and the
    resume-step time with layer-wise loads against load-then-step."""
    table_bytes = cfg.vocab * cfg.layers * cfg.ple_dim * 4
    print(f"\nlargest logit difference against the model that holds its PLE table: {max_diff:.3g}")
    print(f"{device.type.upper()} memory the offloaded PLE table no longer takes: {_size(table_bytes)}")
    base = percentile(results["gpu"].step_seconds, 0.5)
    print(f"\n| PLE table ({device.type}) | step p50 (us) | step p90 (us) | p50 ratio | tokens/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in ["gpu", "process", "gather"]:
        if name not in results:
            continue
        t = results[name].step_seconds
        label = {"gpu": "in the model", "process": "offload process", "gather": "host gather"}[name]
        print(
            f"| {label} | {percentile(t, 0.5) * 1e6:.0f} | {percentile(t, 0.9) * 1e6:.0f} | "
            f"{percentile(t, 0.5) / base:.3f} | {cfg.batch * len(t) / sum(t):.0f} |"
        )
    if device.type == "cpu":
        print("(on the CPU the offload process and this one share two cores and spin: times say nothing)")
    if not pressured:
        return
    link = None
    if device.type == "cuda":
        from kv_ops.tools import doctor

        link = doctor.measure_link(device)
    print()
    for tier, mode, run in pressured:
        kv = run.traffic
        store = kv.stored_bytes / max(kv.store_seconds, 1e-9) / 1e9
        load = kv.loaded_bytes / max(kv.load_seconds, 1e-9) / 1e9
        if mode == "layerwise":
            loaded = f"loaded {_size(kv.loaded_bytes)} layer by layer inside the resume steps (no flush: timed below)"
        else:
            loaded = f"loaded {_size(kv.loaded_bytes)} at {load:.2f} GB/s (the same)"
        print(
            f"KV pressure, {tier}, resume {mode}: {kv.preemptions} preemptions, {kv.resumptions} resumptions; "
            f"stored {_size(kv.stored_bytes)} at {store:.2f} GB/s (call to flush, wall clock), {loaded}; "
            f"paths {kv.paths}"
        )
        line = (
            f"  per flushed transfer, median (max) of {len(kv.flush_times)}: {_us(kv.flush_times)} us from call to "
            f"flush, of which {_us(kv.call_times)} us inside the engine's store/load call (host work before the "
            "copy is enqueued)"
        )
        if kv.start_times:
            line += f"; per layer-wise load, {_us(kv.start_times)} us inside LayerwiseLoads.start"
        print(line)
        if link is not None:
            ratios = f"store {store / link.d2h_gbps:.2f}" + (
                f", load {load / link.h2d_gbps:.2f}" if mode == "flush" else ""
            )
            print(
                f"  as a ratio to the link doctor measured ({link.d2h_gbps:.1f} GB/s to host, {link.h2d_gbps:.1f} to "
                f"GPU): {ratios}"
            )
    resumes = {mode: run for tier, mode, run in pressured if tier == "host memory"}
    if len(resumes) < 2:
        return
    if not all(run.traffic.resume_step_times for run in resumes.values()):
        print("\nresume steps: no sequence resumed in host memory, nothing to compare")
        return
    print(
        "\nresume steps (host memory, same engine, workload and process): from the call that loads a resumed "
        "sequence's blocks to the end of the step that first reads them (its tokens on the host)"
    )
    print(f"\n| resume ({device.type}) | resumed steps | median (us) | max (us) | median ratio |")
    print("| --- | ---: | ---: | ---: | ---: |")
    flushed = percentile(resumes["flush"].traffic.resume_step_times, 0.5)
    for mode, label in [("layerwise", "layer-wise loads, then the step"), ("flush", "load, flush, then the step")]:
        t = resumes[mode].traffic.resume_step_times
        print(
            f"| {label} | {len(t)} | {percentile(t, 0.5) * 1e6:.0f} | {max(t) * 1e6:.0f} | "
            f"{percentile(t, 0.5) / flushed:.3f} |"
        )
    if device.type == "cpu":
        print(
            "(on the CPU LayerwiseLoads.start copies at call time and the waits only count, so both rows do the "
            "same work in another order, on a spinning offload process: times say nothing)"
        )


if __name__ == "__main__":
    sys.exit(main())
