"""The staged layer-wise copies: per layer, copy engines into a GPU ring slot, then a short scatter kernel.

The scatter needs the SMs for a small part of the link time, which the gaps between the step's
kernels give; the copy engines need none, and in a slot of packed layer rows a layer's regions
that sit side by side in the mirror row move as one piece and a run of consecutive host ids as
one 2-D copy, whatever the GPU ids (docs/design.md).

Per layer and chunk of :attr:`StagedLayers.chunk` pairs, round-robin over :data:`SLOTS` slots of
one ring (``ring_bytes`` of GPU memory): the engine's load stream waits until the slot's last
scatter has read it, copies the chunk's pieces of the mirror into the slot and hands over with
an event; a kernel stream of its own waits for that, (once per start) for ``ready``, fills the
slot's scatter graph's id block from the start's ids, replays it, and records the slot free.
Layer ``i``'s landed flag is written after its last scatter. The ids of a start go in with one
copy into a pooled device block, on the kernel stream before the first scatter.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import kernels, reference
from ..cuda import host_memory
from ..cuda.driver import record_event, wait_event, write_value
from ..validation import error_counter
from . import dma
from .blocks import recorded
from .ids import IdBlock, Pool
from .staged import STAGE_PROGRAMS

# Slots of the ring: the copy engines may run this many (layer, chunk) copies ahead of the
# scatters, which wait for gaps between the model's kernels.
SLOTS = 4
RING_BYTES = 128 << 20  # the default ring; a slot holds one layer's pieces of a chunk of pairs
# A run of consecutive host ids at least this long moves as one 2-D copy per piece instead of one
# descriptor per block: a 2-D copy costs the host several descriptors' time, so shorter runs are
# cheaper as descriptors (figures: docs/measurements.md, benchmarks/layerwise_parts.py).
RUN_2D = 8


@dataclass(frozen=True)
class Piece:
    """Columns ``[mirror, +width)`` of a mirror row land at ``[slot, +width)`` of a slot row."""

    mirror: int
    slot: int
    width: int


def pieces(mirror_columns: list[int], widths: list[int]) -> list[Piece]:
    """A layer's regions, in the layer's order, as pieces: neighbours in the mirror row merge."""
    out: list[Piece] = []
    at = 0
    for column, width in zip(mirror_columns, widths):
        if out and out[-1].mirror + out[-1].width == column:
            last = out[-1]
            out[-1] = Piece(last.mirror, last.slot, last.width + width)
        else:
            out.append(Piece(column, at, width))
        at += width
    return out


@dataclass(frozen=True)
class Layout:
    """Every layer's pieces, flattened once per :class:`StagedLayers` for :func:`plan`: piece
    ``j`` of the table belongs to layer ``layer[j]``, lands at column ``slot[j]`` of that layer's
    slot rows (``stride[j]`` bytes each) and comes from column ``mirror[j]`` of a mirror row,
    ``width[j]`` bytes; layer ``l``'s pieces are ``[first[l], first[l + 1])``, in its order."""

    pieces: list[list[Piece]]
    layer_bytes: list[int]
    layer: np.ndarray
    slot: np.ndarray
    mirror: np.ndarray
    width: np.ndarray
    stride: np.ndarray
    first: list[int]


def layout(layer_pieces: list[list[Piece]], layer_bytes: list[int]) -> Layout:
    """The :class:`Layout` of these layers' pieces and slot-row widths."""
    flat = [(layer, p) for layer, ps in enumerate(layer_pieces) for p in ps]

    def column(value) -> np.ndarray:
        return np.array([value(layer, p) for layer, p in flat], dtype=np.int64)

    first = np.cumsum([0] + [len(ps) for ps in layer_pieces]).tolist()
    return Layout(
        layer_pieces,
        list(layer_bytes),
        column(lambda layer, p: layer),
        column(lambda layer, p: p.slot),
        column(lambda layer, p: p.mirror),
        column(lambda layer, p: p.width),
        column(lambda layer, p: layer_bytes[layer]),
        first,
    )


@dataclass
class ChunkPlan:
    """One (layer, chunk): pairs ``[start, stop)`` of the start go through ``slot``; ``copies``
    are the 1-D descriptors, ``strided`` the 2-D copies."""

    layer: int
    start: int
    stop: int
    slot: int
    copies: dma.Plan
    strided: list[dma.Copy2D]


def plan(
    host: np.ndarray,
    table: Layout,
    chunk: int,
    mirror: int,
    row: int,
    ring: int,
    slot_bytes: int,
    first_slot: int,
) -> list[ChunkPlan]:
    """Every (layer, chunk) of a start of ``host`` ids, in issue order (layer by layer).

    Pair ``i`` sits in row ``i % chunk`` of its chunk's slot; slot ``(first_slot + k) % SLOTS``
    takes the ``k``-th (layer, chunk). Runs of consecutive host ids within a chunk of at least
    :data:`RUN_2D` pairs become one 2-D copy per piece (mirror rows ``row`` apart, slot rows
    a layer's bytes apart); the other pairs one descriptor per piece. Pure: addresses in, plans
    out. Each chunk's descriptors for every layer at once, in three numpy broadcasts over
    (piece, pair): a plan per layer cost most of a small start's host time.
    """
    n = host.size
    if n == 0:
        return []
    short, runs = _runs(host, chunk)
    source = host * row + mirror  # each pair's mirror row
    layers = len(table.pieces)
    chunks = -(-n // chunk)
    # The k-th (layer, chunk) is layer * chunks + c: each layer's slot for chunk c, as a column.
    layer_slots = (first_slot + np.arange(layers, dtype=np.int64) * chunks) % SLOTS
    per_chunk = []
    for c, lo in enumerate(range(0, n, chunk)):
        hi = min(n, lo + chunk)
        rows = np.flatnonzero(short[lo:hi])
        mine = [(s - lo, length, int(source[s])) for s, length in runs if lo <= s < hi]
        slots = (layer_slots + c) % SLOTS
        copies = None
        if rows.size:
            # [piece, pair]: row-major, so a layer's descriptors are one contiguous slice.
            base = (ring + slots[table.layer] * slot_bytes + table.slot)[:, None]
            dsts = base + rows[None, :] * table.stride[:, None]
            srcs = source[rows + lo][None, :] + table.mirror[:, None]
            sizes = np.repeat(table.width, rows.size).reshape(dsts.shape)
            copies = (dsts, srcs, sizes)
        per_chunk.append((lo, hi, slots.tolist(), mine, copies))
    out = []
    for layer, (layer_p, width) in enumerate(zip(table.pieces, table.layer_bytes)):
        a, b = table.first[layer], table.first[layer + 1]
        for lo, hi, slots, mine, copies in per_chunk:
            slot = slots[layer]
            if copies is None:
                descriptors = _NO_COPIES
            else:
                descriptors = dma.Plan(*(x[a:b].reshape(-1) for x in copies))
            base = ring + slot * slot_bytes
            strided = [
                dma.Copy2D(base + p.slot + r * width, width, s + p.mirror, row, p.width, length)
                for r, length, s in mine
                for p in layer_p
            ]
            out.append(ChunkPlan(layer, lo, hi, slot, descriptors, strided))
    return out


def _runs(host: np.ndarray, chunk: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Which pairs of ``host`` ids go one descriptor each (``short``), and the (start, length) of
    every run of at least :data:`RUN_2D` consecutive ids within a chunk, which go as one 2-D copy."""
    n = host.size
    begins = np.ones(n + 1, dtype=bool)
    np.not_equal(np.diff(host), 1, out=begins[1:n])
    begins[:n:chunk] = True  # a run never crosses into the next chunk
    edges = np.flatnonzero(begins)
    starts, lengths = edges[:-1], np.diff(edges)
    long = lengths >= RUN_2D
    short = np.ones(n, dtype=bool)
    runs = list(zip(starts[long].tolist(), lengths[long].tolist()))
    for s, length in runs:
        short[s : s + length] = False
    return short, runs


_NO_COPIES = dma.Plan(*(np.empty(0, dtype=np.int64) for _ in range(3)))


class StagedLayers:
    """The ring, its scatter graphs and its streams for one :class:`LayerwiseLoads`."""

    def __init__(self, loads, ring_bytes: int):
        engine = loads.engine
        self.device = engine.device
        gpu, mirror = engine.regions, engine.mirror_regions
        base = engine.mirror.data_ptr()
        self.regions = [[gpu[n] for n in group] for group in loads.layers]
        widths = [[gpu[n].shape[1] for n in group] for group in loads.layers]
        self.layer_bytes = [sum(w) for w in widths]
        self.pieces = [
            pieces([mirror[n].data_ptr() - base for n in group], w) for group, w in zip(loads.layers, widths)
        ]
        self.layout = layout(self.pieces, self.layer_bytes)
        most = max(self.layer_bytes)
        self.chunk = max(1, min(ring_bytes // (SLOTS * most), engine.num_blocks))
        self.slot_bytes = self.chunk * most
        self.ring = torch.empty(SLOTS * self.slot_bytes, dtype=torch.uint8, device=self.device)
        self.row = engine.block_bytes
        self._mirror = base
        self._next_slot = 0
        self.words_per_chunk = 1 + self.chunk  # a scatter's id block: [n, GPU ids]
        self.max_chunks = -(-engine.num_blocks // self.chunk)
        self.copy_stream = None
        if self.device.type != "cuda":
            return
        self.copy_stream = engine.load_stream
        lowest, _ = torch.cuda.Stream.priority_range()
        self.kernel_stream = torch.cuda.Stream(self.device, priority=lowest)  # as the engine's own streams
        self._copy = dma.Launcher(self.copy_stream)
        self._kernel = dma.Launcher(self.kernel_stream)
        errors = error_counter(self.device)
        # Per layer and slot, the scatter from that slot into the layer's regions, captured once.
        self.graphs = []
        for regions, lb in zip(self.regions, self.layer_bytes):
            bound = kernels.BoundCopy(self.device, None, regions, num_programs=STAGE_PROGRAMS)
            self.graphs.append(
                [kernels.GraphedCopy(bound, self.chunk, errors, self.slot_view(s, lb)) for s in range(SLOTS)]
            )
        words = self.max_chunks * self.words_per_chunk
        self._ids = Pool(lambda: _StartIds(words, self.device), initial=2)
        # Recorded once now, so that each exists and every later record is one driver call.
        self._free = [recorded(self.copy_stream) for _ in range(SLOTS)]
        self._handoff = recorded(self.copy_stream)

    def slot_view(self, slot: int, layer_bytes: int) -> torch.Tensor:
        """Slot ``slot`` as ``[chunk, layer_bytes]`` packed rows of one layer."""
        at = slot * self.slot_bytes
        return self.ring[at : at + self.chunk * layer_bytes].view(self.chunk, layer_bytes)

    def plan(self, host: np.ndarray) -> list[ChunkPlan]:
        plans = plan(
            host,
            self.layout,
            self.chunk,
            self._mirror,
            self.row,
            self.ring.data_ptr(),
            self.slot_bytes,
            self._next_slot,
        )
        self._next_slot = (self._next_slot + len(plans)) % SLOTS
        return plans

    def run_on_host(self, host: np.ndarray, gpu: np.ndarray) -> None:
        """The same plans, executed at once on the CPU (an engine over CPU tensors)."""
        ids = torch.from_numpy(gpu)
        for p in self.plan(host):
            dma.run_on_host(p.copies)
            for copy in p.strided:
                dma.run_2d_on_host(copy)
            rows = self.slot_view(p.slot, self.layer_bytes[p.layer])[: p.stop - p.start]
            reference.scatter_blocks(rows, ids[p.start : p.stop], self.regions[p.layer])

    def enqueue(
        self, host: np.ndarray, gpu: np.ndarray, ready, landed, generation: int, done_events
    ) -> torch.cuda.Event:
        """Issue a start: every (layer, chunk)'s copies and scatter, and after each layer's last
        scatter ``generation`` written at that layer's flag address (``landed[layer]``); returns
        the start's completion event (from ``done_events``, the engine's load-direction
        :class:`~kv_ops.transfer.paths.Events`). The caller has bound the device's context
        (:class:`~kv_ops.cuda.driver.driver_context`), as ``LayerwiseLoads`` does for every mechanism."""
        plans = self.plan(host)
        chunk, per = self.chunk, self.words_per_chunk
        ids = self._ids.take()
        chunks = id_blocks(ids.host.words, gpu, chunk)
        c, k = self._copy.handle, self._kernel.handle
        wait_event(k, ready)  # every scatter overwrites GPU blocks: after their readers
        # The ids in, on the kernel stream: after the scatters of the start that last used
        # this pooled block (same stream), before this start's first scatter.
        self._kernel.copy(ids.address, ids.host.address, 8 * chunks * per)
        for i, p in enumerate(plans):
            wait_event(c, self._free[p.slot])  # the slot's last scatter has read it
            self._copy(p.copies)
            for copy in p.strided:
                self._copy.copy_2d(copy)
            record_event(self._handoff, c)
            wait_event(k, self._handoff)
            # The chunk's [n, GPU ids] into the graph's block: its last replay, on this
            # stream, has read the block already.
            graph = self.graphs[p.layer][p.slot]
            block = ids.address + 8 * per * (p.start // chunk)
            self._kernel.copy(graph.address, block, 8 * (1 + p.stop - p.start))
            graph.replay(k)
            record_event(self._free[p.slot], k)
            if i + 1 == len(plans) or plans[i + 1].layer != p.layer:
                write_value(k, landed[p.layer], generation)  # the layer's last scatter: its blocks are in
        done = done_events.record(self.kernel_stream, k)
        self._ids.give(ids, done)
        return done

    def close(self) -> None:
        if self.copy_stream is not None:
            self.kernel_stream.synchronize()


def id_blocks(words: np.ndarray, gpu: np.ndarray, chunk: int) -> int:
    """Write the scatters' id blocks of a start into ``words``: block ``c`` (``1 + chunk`` words
    from ``c * (1 + chunk)``) holds chunk ``c``'s pair count, then its GPU ids. Returns the number
    of chunks. In place, no allocation: it runs once per start."""
    per = 1 + chunk
    full, rest = divmod(gpu.size, chunk)
    blocks = words[: full * per].reshape(full, per)
    blocks[:, 0] = chunk
    blocks[:, 1:] = gpu[: full * chunk].reshape(full, chunk)
    if rest:
        last = words[full * per : (full + 1) * per]
        last[0] = rest
        last[1 : 1 + rest] = gpu[full * chunk :]
    return full + (rest > 0)


class _StartIds:
    """A start's scatter id blocks (:func:`id_blocks`): page-locked, and their copy on the GPU."""

    def __init__(self, words: int, device: torch.device):
        self.host = IdBlock(words)
        self.block = host_memory.lasting_copy(torch.zeros(words, dtype=torch.int64), device)
        self.address = self.block.data_ptr()


__all__ = [
    "StagedLayers",
    "Piece",
    "Layout",
    "ChunkPlan",
    "pieces",
    "layout",
    "plan",
    "id_blocks",
    "SLOTS",
    "RING_BYTES",
    "RUN_2D",
]
