"""The engine's three ways to move blocks between the GPU cache and the packed host mirror.

Every path moves one :class:`Blocks` (GPU block ``gpu_ids[i]`` <-> mirror row ``host_ids[i]``)
and has the same two members: ``enqueue(blocks, ready)``, which orders the transfer after the
``ready`` event, launches it and returns the event that completes with it, and ``copy_engines``,
whether it leaves the SMs to the model. :mod:`kv_ops.crossover` measures them on the engine's own
shape; the engine picks one per call and launches it once.

* :class:`KernelPath` -- the Triton kernel reads and writes the mirror over PCIe (zero-copy) on
  a few SMs. No per-block cost: the choice for small, latency-bound transfers.
* :class:`StagedPath` -- a kernel gathers the scattered per-layer blocks into packed rows of a GPU
  ring (device to device, at TB/s), and the copy engines move each packed row, or run of rows,
  as one descriptor of ``block_bytes`` or more. Loads are the reverse.
* :class:`DirectDmaPath` -- the copy engines move each region's block (or run of blocks) straight
  between the cache and the mirror. One descriptor per block for a cross-layer cache (one region,
  packed like the mirror); one per region and block otherwise.

On the GPU a path sets itself up when it is made: its copy kernels are bound and the staged
ring is allocated, so a serving engine pays for them (and runs out of memory, if it must) at
start, never on a transfer in the middle of serving. On the CPU (an engine over CPU tensors)
each path runs synchronously through the same plans: :func:`kv_ops.dma.run_on_host` executes
what the copy engines would.

The mirror is one page-locked uint8 tensor ``[num_host_blocks, block_bytes]``: row ``h`` holds
host block ``h`` of every region side by side, in region order -- the rows ``gather_blocks``
writes. The kernel and direct paths see it as per-region column views of it.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import dma, kernels, reference
from .validation import error_counter

# Ring slots per direction: with four, a store's gather of chunk i+1 (and i+2) runs while the
# copy engines drain chunk i, and calls issued back to back keep the pipeline full.
RING_SLOTS = 4
# Programs of the staging gather and scatter. Device-to-device, 32 programs move about 1 TB/s on
# the H200 (benchmarks/engine.py: 32,000 SM-us per GB): the SMs work 5.5% of the time the link
# needs for the same bytes. A probe measured 8 programs at 23% and all SMs at 3.5%, which takes
# 4x the SMs from the model while they run.
STAGE_PROGRAMS = 32


class Direction(enum.Enum):
    STORE = "store"  # GPU cache -> host mirror
    LOAD = "load"  # host mirror -> GPU cache


@dataclass(frozen=True)
class Blocks:
    """One transfer: GPU block ``gpu_ids[i]`` <-> mirror row ``host_ids[i]``, ids checked.

    ``gpu_ids`` and ``host_ids`` are int64 CPU tensors of equal length. ``runs`` is
    :func:`kv_ops.dma.run_starts` of the pairs (start and length of each stretch in which both ids
    go up by one), found on first use and kept for the choice and the plans.
    """

    direction: Direction
    gpu_ids: torch.Tensor
    host_ids: torch.Tensor

    @classmethod
    def of(cls, direction: Direction, gpu_ids: torch.Tensor, host_ids: torch.Tensor) -> "Blocks":
        return cls(direction, gpu_ids, host_ids)

    @functools.cached_property
    def runs(self) -> tuple[torch.Tensor, torch.Tensor]:
        return dma.run_starts(self.gpu_ids, self.host_ids)

    @property
    def count(self) -> int:
        return self.gpu_ids.numel()

    @functools.cached_property
    def num_runs(self) -> int:
        """How many runs ``runs`` has, counted with fewer operations (auto's pick needs only this)."""
        if self.count < 2:
            return self.count
        breaks = (self.gpu_ids.diff() != 1) | (self.host_ids.diff() != 1)
        return int(torch.count_nonzero(breaks)) + 1

    def sides(self, gpu, host):
        """(src, dst, src_ids, dst_ids) for this direction, given the GPU and the host side."""
        if self.direction is Direction.STORE:
            return gpu, host, self.gpu_ids, self.host_ids
        return host, gpu, self.host_ids, self.gpu_ids


def mirror_views(mirror: torch.Tensor, widths: Sequence[int]) -> list[torch.Tensor]:
    """Region r's blocks in the mirror: columns ``[sum(widths[:r]), +widths[r])`` of every row."""
    views, column = [], 0
    for width in widths:
        views.append(mirror[:, column : column + width])
        column += width
    return views


def low_priority_streams(device: torch.device) -> dict[Direction, torch.cuda.Stream]:
    """One lowest-priority stream per direction: transfers yield to the model's kernels."""
    lowest, _ = torch.cuda.Stream.priority_range()  # numerically largest = lowest priority
    return {d: torch.cuda.Stream(device, priority=lowest) for d in Direction}


def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _ids_on(device: torch.device, ids: torch.Tensor) -> torch.Tensor:
    """``ids`` on ``device``, copied on the current stream (the allocator then reuses the memory
    only after the work enqueued on that stream, the kernel that reads it, has run)."""
    return ids.pin_memory().to(device, non_blocking=True)


class KernelPath:
    """The Triton block-copy kernel between the cache regions and the mirror's region views."""

    name = "kernel"
    copy_engines = False

    def __init__(self, regions: Sequence[torch.Tensor], mirror: torch.Tensor, streams: dict | None):
        self.regions = list(regions)
        self.views = mirror_views(mirror, [r.shape[1] for r in self.regions])
        self.streams = streams
        self.device = self.regions[0].device
        # Each direction's copy, bound once (on the GPU only: the CPU runs the reference copy).
        self._launch: dict[Direction, kernels.BoundCopy] = {}
        if streams is not None:
            self._launch[Direction.STORE] = kernels.BoundCopy(self.device, self.regions, self.views)
            self._launch[Direction.LOAD] = kernels.BoundCopy(self.device, self.views, self.regions)

    def enqueue(self, blocks: Blocks, ready: torch.cuda.Event | None) -> torch.cuda.Event | None:
        src, dst, src_ids, dst_ids = blocks.sides(self.regions, self.views)
        if self.streams is None:
            reference.copy_blocks(src, dst, src_ids, dst_ids)
            return None
        launch = self._launch[blocks.direction]
        stream = self.streams[blocks.direction]
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            ids = _ids_on(self.device, torch.stack([src_ids, dst_ids]))
            # The kernel directly: the engine checked the ids, so the op's checks add nothing.
            launch(None, ids[0], ids[1], blocks.count, error_counter(self.device))
            return _record(stream)


class DirectDmaPath:
    """The copy engines, region by region, straight between the cache and the mirror."""

    name = "dma"
    copy_engines = True

    def __init__(self, regions: Sequence[torch.Tensor], mirror: torch.Tensor, streams: dict | None):
        self.regions = list(regions)
        self.views = mirror_views(mirror, [r.shape[1] for r in self.regions])
        self.streams = streams

    def enqueue(self, blocks: Blocks, ready: torch.cuda.Event | None) -> torch.cuda.Event | None:
        src, dst, src_ids, dst_ids = blocks.sides(self.regions, self.views)
        # Runs merge into one copy only where a region's blocks are back to back on both sides:
        # a one-region (cross-layer) cache, whose mirror view is the whole mirror.
        plan = dma.plan_copies(src, dst, src_ids, dst_ids, blocks.runs)
        if self.streams is None:
            dma.run_on_host(plan)
            return None
        stream = self.streams[blocks.direction]
        stream.wait_event(ready)
        dma.launch(plan, stream)  # reads the source in stream order: after the wait
        return _record(stream)


class StagedPath:
    """Gather into a GPU ring of packed rows, then one copy-engine descriptor per row or run.

    Each direction has its own ring of :data:`RING_SLOTS` slots of ``chunk`` rows and its own
    kernel stream beside the engine's copy stream. A transfer is cut into chunks of ``chunk``
    pairs, dealt round-robin over the slots (across calls too):

    * store: kernel stream waits for ``ready`` and for the slot's last DMA, gathers the chunk into
      the slot; the copy stream waits for that gather and copies the slot's rows to the mirror,
      one descriptor per run of consecutive host ids;
    * load: the copy stream waits for the slot's last scatter and copies mirror rows into the
      slot (not ordered after ``ready``: the ring is the engine's own, so the copy overlaps the
      caller's compute); the kernel stream waits for that copy and, once, for ``ready``, then
      scatters the slot into the cache.

    A slot is reused only after the work that reads it (a store's DMA, a load's scatter) has
    finished: ordered by events on the GPU, never by the host waiting.

    Parameters
    ----------
    regions : sequence of Tensor
        The cache regions ``[num_blocks, width_r]`` (uint8), on one device.
    mirror : Tensor
        The packed mirror ``[num_host_blocks, sum(width_r)]`` (uint8, page-locked on CUDA).
    streams : dict of Direction to Stream, or None
        The engine's copy streams (None on the CPU).
    ring_bytes : int
        GPU memory of each direction's ring; a slot holds at least one row, and no more rows
        than a transfer can have.
    """

    name = "staged"
    copy_engines = True

    def __init__(self, regions: Sequence[torch.Tensor], mirror: torch.Tensor, streams: dict | None, ring_bytes: int):
        self.regions = list(regions)
        self.mirror = mirror
        self.streams = streams
        self.device = self.regions[0].device
        row_bytes = mirror.shape[1]
        most_pairs = max(mirror.shape[0], self.regions[0].shape[0])
        self.chunk = max(1, min(ring_bytes // (RING_SLOTS * row_bytes), -(-most_pairs // RING_SLOTS)))
        self._free: dict[Direction, list[torch.cuda.Event | None]] = {d: [None] * RING_SLOTS for d in Direction}
        self._next = {d: 0 for d in Direction}
        # Each direction's ring. On the GPU, made now with the bound gather and scatter; on the
        # CPU, on first use (an engine there picks the kernel path's reference copy unless told).
        self._rings: dict[Direction, torch.Tensor] = {}
        self._gather = self._scatter = None
        # Where the gathers and scatters run, beside the engine's copy streams (None on the CPU).
        self.kernel_streams = None
        if streams is not None:
            self.kernel_streams = low_priority_streams(self.device)
            for d in Direction:
                self._ring(d)
            self._gather = kernels.BoundCopy(self.device, self.regions, None, num_programs=STAGE_PROGRAMS)
            self._scatter = kernels.BoundCopy(self.device, None, self.regions, num_programs=STAGE_PROGRAMS)

    @property
    def ring_bytes(self) -> int:
        """GPU bytes of one direction's ring."""
        return RING_SLOTS * self.chunk * self.mirror.shape[1]

    def enqueue(self, blocks: Blocks, ready: torch.cuda.Event | None) -> torch.cuda.Event | None:
        if blocks.count == 0:
            if self.streams is None:
                return None
            # On the stream where this direction's staged work ends (a load's last scatter), so
            # that the engine's issue order across paths still holds after an empty call.
            d = blocks.direction
            stream = self.kernel_streams[d] if d is Direction.LOAD else self.streams[d]
            stream.wait_event(ready)
            return _record(stream)
        d = blocks.direction
        ring = self._ring(d)
        # Slots for every chunk up front, so that the whole transfer is planned in one pass.
        slots = [self._take_slot(d) for _ in range(0, blocks.count, self.chunk)]
        plans = self._plans(blocks, ring, slots[0])
        if self.streams is None:
            for (start, stop), slot, plan in zip(self._bounds(blocks), slots, plans):
                staged = ring[slot * self.chunk : slot * self.chunk + stop - start]
                if d is Direction.STORE:
                    reference.gather_blocks(self.regions, blocks.gpu_ids[start:stop], staged)
                    dma.run_on_host(plan)
                else:
                    dma.run_on_host(plan)
                    reference.scatter_blocks(staged, blocks.gpu_ids[start:stop], self.regions)
            return None
        kernel, copy, free = self.kernel_streams[d], self.streams[d], self._free[d]
        errors = error_counter(self.device)
        # One stream context for the whole transfer (each costs host time); the copies and
        # events name their streams explicitly.
        with torch.cuda.stream(kernel):
            kernel.wait_event(ready)  # store: after the blocks' writers; load: after their readers
            gpu_ids = _ids_on(self.device, blocks.gpu_ids)
            for (start, stop), slot, plan in zip(self._bounds(blocks), slots, plans):
                staged = ring[slot * self.chunk : slot * self.chunk + stop - start]
                ids = gpu_ids[start:stop]
                if d is Direction.STORE:
                    if free[slot] is not None:
                        kernel.wait_event(free[slot])  # the slot's last DMA has read it
                    self._gather(staged, ids, None, stop - start, errors)
                    copy.wait_event(_record(kernel))
                    dma.launch(plan, copy)  # slot rows -> mirror rows, one descriptor per run
                    free[slot] = _record(copy)
                else:
                    # Into the ring without waiting for ``ready``: the ring is the engine's own, so
                    # the copy overlaps the caller's compute; only the scatter waits for it.
                    if free[slot] is not None:
                        copy.wait_event(free[slot])  # the slot's last scatter has read it
                    dma.launch(plan, copy)
                    kernel.wait_event(_record(copy))
                    self._scatter(staged, None, ids, stop - start, errors)
                    free[slot] = _record(kernel)
        return free[slots[-1]]

    def _ring(self, direction: Direction) -> torch.Tensor:
        ring = self._rings.get(direction)
        if ring is None:
            ring = torch.empty((RING_SLOTS * self.chunk, self.mirror.shape[1]), dtype=torch.uint8, device=self.device)
            self._rings[direction] = ring
        return ring

    def _take_slot(self, direction: Direction) -> int:
        slot = self._next[direction]
        self._next[direction] = (slot + 1) % RING_SLOTS
        return slot

    def _bounds(self, blocks: Blocks):
        return [(start, min(start + self.chunk, blocks.count)) for start in range(0, blocks.count, self.chunk)]

    def _plans(self, blocks: Blocks, ring: torch.Tensor, first_slot: int) -> list[dma.Plan]:
        """Each chunk's copies between its ring slot and the mirror, planned in one pass.

        The chunks take consecutive slots from ``first_slot`` on, wrapping around the ring, so
        pair i sits in ring row ``(first_slot * chunk + i) % ring_rows``. A run of consecutive
        host ids within a chunk is one descriptor: ``mirror[h0 : h0 + n] <-> ring[r0 : r0 + n]``.
        """
        host, n, chunk, row = blocks.host_ids, blocks.count, self.chunk, self.mirror.shape[1]
        # Few tensor operations, in place where possible: on the host each costs microseconds,
        # and this runs every call.
        begins = torch.ones(n + 1, dtype=torch.bool)  # [n] stays True: the end of the last run
        torch.ne(host.diff(), 1, out=begins[1:n])
        begins[:n:chunk] = True  # a run never crosses into the next chunk's slot (nor the ring's end)
        edges = begins.nonzero().view(-1)
        first = edges[:-1]
        sizes = edges.diff().mul_(row)
        ring_at = first.add(first_slot * chunk).remainder_(ring.shape[0]).mul_(row).add_(ring.data_ptr())
        mirror_at = host[first].mul_(row).add_(self.mirror.data_ptr())
        dsts, srcs = (mirror_at, ring_at) if blocks.direction is Direction.STORE else (ring_at, mirror_at)
        if n <= chunk:
            return [dma.Plan(dsts, srcs, sizes)]
        # Where each chunk's descriptors begin: the runs are in pair order, and every chunk's
        # first pair begins a run.
        cut = torch.searchsorted(first, torch.arange(0, n, chunk)).tolist() + [first.numel()]
        return [dma.Plan(dsts[a:b], srcs[a:b], sizes[a:b]) for a, b in zip(cut[:-1], cut[1:])]


Path = KernelPath | StagedPath | DirectDmaPath
PATH_CLASSES = (KernelPath, StagedPath, DirectDmaPath)
PATH_NAMES = tuple(c.name for c in PATH_CLASSES)
# Which paths leave the SMs to the model: auto prefers them within its tolerance.
COPY_ENGINES = {c.name: c.copy_engines for c in PATH_CLASSES}


def make_paths(
    regions: Sequence[torch.Tensor],
    mirror: torch.Tensor,
    streams: dict | None,
    ring_bytes: int,
    names: Sequence[str] = PATH_NAMES,
) -> dict[str, Path]:
    """The paths ``names`` over ``regions`` and ``mirror``, by name (an engine makes the ones it
    may pick, which on the GPU allocates the staged ring; auto's measurement makes all three)."""
    makers = {
        KernelPath.name: lambda: KernelPath(regions, mirror, streams),
        StagedPath.name: lambda: StagedPath(regions, mirror, streams, ring_bytes),
        DirectDmaPath.name: lambda: DirectDmaPath(regions, mirror, streams),
    }
    return {name: make() for name, make in makers.items() if name in names}


__all__ = [
    "Direction",
    "Blocks",
    "KernelPath",
    "StagedPath",
    "DirectDmaPath",
    "Path",
    "PATH_NAMES",
    "COPY_ENGINES",
    "make_paths",
    "low_priority_streams",
    "mirror_views",
    "RING_SLOTS",
    "STAGE_PROGRAMS",
]
