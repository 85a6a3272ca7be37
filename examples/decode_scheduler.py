"""The decode loop's scheduler: the workload's sequences in fixed batch slots, a pool of GPU KV
blocks too small for all of them, preemption to the offload engine and resumption from it."""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch

import kv_ops

from decode_graph import StepBuffer
from decode_model import Config


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
    single_run_preemptions: int = 0  # preemptions stored to one run of consecutive host blocks
    stored_bytes: int = 0
    loaded_bytes: int = 0
    store_seconds: float = 0.0  # from the call to the end of the flush
    load_seconds: float = 0.0  # the same, of load-then-step's loads (layer-wise loads have no flush)
    # Per flushed transfer, both directions: seconds inside the engine's store/load call (host
    # work), and from the call to the end of its flush.
    call_times: list[float] = field(default_factory=list)
    flush_times: list[float] = field(default_factory=list)
    # Per store (a preemption): its (gpu_ids, host_ids), and seconds inside engine.store; and the
    # same stores replayed back to back on the engine after the run (see decode_loop.warm_stores).
    stores: list[tuple[list[int], list[int]]] = field(default_factory=list)
    store_call_times: list[float] = field(default_factory=list)
    warm_store_call_times: list[float] = field(default_factory=list)
    warm_store_flush_times: list[float] = field(default_factory=list)
    # Per layer-wise load: seconds inside LayerwiseLoads.start (host work; the copies go on).
    start_times: list[float] = field(default_factory=list)
    # Per step that resumed a sequence: from the call that loads its blocks (start or load; with
    # the step's own transfers, staged while the step before ran: the step's launch) to the end
    # of the step (its tokens on the host).
    resume_step_times: list[float] = field(default_factory=list)
    # With the step's own transfers (kv_ops.StepTransfers), per step: the blocks it stored and
    # loaded, and the seconds from its launch to its end; and per stage (run while the step
    # before ran), its host time.
    step_transfers: list[tuple[int, int, float]] = field(default_factory=list)
    stage_times: list[float] = field(default_factory=list)
    paths: dict[str, int] = field(default_factory=dict)  # transfers per engine path (kernel, dma, layerwise)


class Scheduler:
    """Decodes ``seqs`` with at most ``gpu_blocks`` KV blocks on the GPU.

    When a running sequence needs a block and none is free, another running sequence is
    preempted: its blocks are stored to the engine (host memory or disk), the store is flushed,
    and the blocks are freed. Its host blocks come from a :class:`kv_ops.HostBlockAllocator`: one
    run of consecutive ids whenever the free host space holds one, so the store and the later load
    move few pieces. A preempted sequence resumes once its blocks, plus one block for each running
    sequence, fit: it is given whatever blocks are free (other ids than before), its block table
    is rewritten, and it goes on where it stopped. Its blocks are loaded by
    :meth:`load_resumed`, just before the step that first reads them: with ``loads`` (a
    :class:`kv_ops.LayerwiseLoads` of ``engine``) layer by layer, each layer of the step waiting
    for its own blocks; without, by load, flush, then step.

    With ``transfers`` (a :class:`kv_ops.StepTransfers` of ``engine``) the step itself stores the
    preempted blocks and loads the resumed ones, first thing: the scheduler only stages their ids
    (:meth:`load_resumed`), and a preempted sequence's blocks are free for this very step (its
    stores run before anything writes them). A resumed sequence's host blocks go back to the
    allocator after the step, once it has read them. The loop then plans each step while the step
    before runs, as an asynchronous scheduler does: :meth:`advance` with no tokens, :meth:`plan`,
    :meth:`load_resumed`, and :meth:`fill` once the tokens are on the host. Nothing a plan decides
    depends on a token's value, and the stage waits only until the running step has read the ids
    staged for it, which is that step's first op.
    """

    def __init__(
        self,
        cfg: Config,
        seqs: list[Sequence],
        gpu_blocks: int,
        engine: kv_ops.OffloadEngine | None,
        loads: kv_ops.LayerwiseLoads | None = None,
        transfers: kv_ops.StepTransfers | None = None,
    ):
        if gpu_blocks < cfg.max_blocks:
            raise ValueError(f"{gpu_blocks} GPU blocks cannot hold one sequence of {cfg.max_blocks} blocks")
        for given, what in ((loads, "LayerwiseLoads"), (transfers, "StepTransfers")):
            if given is not None and given.engine is not engine:
                raise ValueError(f"the {what} must belong to this run's engine")
        if loads is not None and transfers is not None:
            raise ValueError("resume by LayerwiseLoads or by StepTransfers, not both")
        self.cfg, self.seqs, self.engine, self.loads, self.transfers = cfg, seqs, engine, loads, transfers
        self.storing: list[tuple[list[int], list[int]]] = []  # this step's (gpu, host) stores, staged
        # Per staged step, oldest first: the host blocks it loads from, freed once it has run (the
        # next step may be staged before the last one has finished).
        self.read_host: deque[list[int]] = deque()
        self.staged = (0, 0)  # blocks the next step stores and loads (with transfers)
        self.free = list(range(gpu_blocks, 0, -1))  # block 0 is the null block, never handed out
        self.host = kv_ops.HostBlockAllocator(engine.num_host_blocks) if engine is not None else None
        self.preempted: list[Sequence] = []  # oldest first
        self.resuming: list[tuple[Sequence, list[int], list[int]]] = []  # this step's (seq, host, gpu)
        # Layer-wise loads in flight: transfer id -> the host blocks it reads. They go back to
        # the allocator only once the engine reports the transfer (a store into them before that
        # could overwrite bytes still on their way to the GPU).
        self.loading: dict[int, list[int]] = {}
        self.traffic = KVTraffic()
        # Two, taken in turn: a step's inputs are planned while the step before runs, whose
        # asynchronous copy may still read the other.
        self.buffers = [StepBuffer(cfg, pin=torch.cuda.is_available()) for _ in range(2)]
        self.planned: list[Sequence] = []  # the rows of the last plan
        self.sampling: list[Sequence] = []  # advanced without their sampled token (advance(None))

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
                self.host.free(host)

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
        if self.engine is None:
            raise RuntimeError("out of KV blocks with nowhere to preempt to")
        if self.host.num_free < len(seq.blocks) and self.loading:
            self._reclaim(self.engine.flush())  # host blocks still held by layer-wise loads
        try:
            host = self.host.allocate(len(seq.blocks)).tolist()
        except kv_ops.OutOfHostBlocksError as e:
            raise RuntimeError(f"out of KV blocks with nowhere to preempt to ({e})") from None
        if self.transfers is not None:
            self.storing.append((list(seq.blocks), host))  # staged by load_resumed, run by the step
        else:
            self.traffic.store_seconds += self._wait_for(
                f"storing the blocks of sequence {seq.index}", lambda: self.engine.store(seq.blocks, host)
            )
            self.traffic.store_call_times.append(self.traffic.call_times[-1])
        self.traffic.stores.append((list(seq.blocks), host))
        self.traffic.stored_bytes += len(host) * self.engine.block_bytes
        self.traffic.preemptions += 1
        self.traffic.single_run_preemptions += host[-1] - host[0] + 1 == len(host)  # allocate's ids ascend
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
        """Load the blocks of the sequences :meth:`plan` resumed, as one transfer (with
        ``transfers``: stage them, and this step's stores); call it just before the step that
        first reads them. Returns whether there were any."""
        if self.transfers is not None:
            return self._stage()
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
            self.host.free(host)
        return True

    def _stage(self) -> bool:
        """The step's stores and loads, staged for the step to run."""
        store = ([g for gs, _ in self.storing for g in gs], [h for _, hs in self.storing for h in hs])
        load = ([h for _, hs, _ in self.resuming for h in hs], [g for _, _, gs in self.resuming for g in gs])
        self.staged = (len(store[0]), len(load[0]))
        self.storing, self.resuming = [], []
        self.read_host.append(load[0])
        if self.staged == (0, 0):
            return False
        start = time.perf_counter()
        self.transfers.stage(store=store, load=load)
        self.traffic.stage_times.append(time.perf_counter() - start)
        return bool(load[0])

    def collect(self) -> None:
        """After a step: take back the host blocks of the layer-wise loads that have landed (with
        ``transfers``: those the step loaded from)."""
        if self.read_host and (read := self.read_host.popleft()):
            self.host.free(read)
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
        self.planned = []
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
        self.buffers.reverse()
        inputs = self.buffers[0].reset()
        self.planned = rows
        for seq in rows:
            i, p = seq.index, seq.done
            inputs.tokens[i] = seq.tokens[p] if seq.tokens[p] is not None else 0  # None: see fill()
            inputs.positions[i] = p
            inputs.seq_lens[i] = p + 1
            inputs.block_table[i, : len(seq.blocks)] = torch.tensor(seq.blocks)
            inputs.slot_block[i] = seq.blocks[p // cfg.block_size]
            inputs.slot_offset[i] = p % cfg.block_size
        return self.buffers[0]

    def advance(self, next_tokens: torch.Tensor | None) -> list[tuple[int, int]]:
        """Account for a step; returns the (sequence, position) of every row that ran.

        With ``next_tokens=None``, for a step still running: a sequence that samples a token gets
        a placeholder (its length, so whether it is finished, does not depend on the token's
        value), so the next step can be planned now; :meth:`fill` writes the tokens once known."""
        ran = []
        for seq in self.running():
            ran.append((seq.index, seq.done))
            seq.done += 1
            if seq.done == len(seq.tokens):  # the last known token was processed: sample the next
                seq.tokens.append(None if next_tokens is None else int(next_tokens[seq.index]))
                if next_tokens is None:
                    self.sampling.append(seq)
            if seq.finished:
                self.free += reversed(seq.blocks)
                seq.blocks = []
        return ran

    def fill(self, next_tokens: torch.Tensor) -> None:
        """The sampled tokens of the step that :meth:`advance` accounted for with none, into their
        sequences and into the inputs :meth:`plan` made since (rows that read them are waiting)."""
        planned = {id(seq) for seq in self.planned}
        inputs = self.buffers[0].inputs
        for seq in self.sampling:
            token = seq.tokens[-1] = int(next_tokens[seq.index])
            if id(seq) in planned and seq.done == len(seq.tokens) - 1:
                inputs.tokens[seq.index] = token
        self.sampling = []


def blocks_needed(cfg: Config) -> int:
    return sum(math.ceil((s.total - 1) / cfg.block_size) for s in make_sequences(cfg))


def pressure_blocks(cfg: Config) -> int:
    """About 60% of what the workload needs at once: several preemptions, never a deadlock."""
    return max(cfg.max_blocks + 1, int(blocks_needed(cfg) * 0.6))


@dataclass
class Run:
    tokens: list[list[int]]
    logits: dict[tuple[int, int], torch.Tensor]  # (sequence, position) -> logits row (reference only)
    step_seconds: list[float]
    traffic: KVTraffic
    # Replayed steps' host time per piece (decode_graph.Step.host_times): prepare, replay, release.
    host_times: dict[str, list[float]] = field(default_factory=dict)
