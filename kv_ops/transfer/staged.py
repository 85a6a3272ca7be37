"""The staged path: a kernel gathers blocks into a GPU ring of packed rows, the copy engines move the rows."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from .. import kernels, reference
from ..cuda.driver import driver_context, record_event, wait_event
from ..validation import error_counter
from . import dma
from .blocks import Blocks, Direction, EventPath, Events, host_tensor, host_views
from .ids import IdBlock, Pool
from .staging_ring import RING_SLOTS, StagingRing

# Programs of the staging gather and scatter: device to device, 32 programs keep the SMs busy for
# a small part of the time the link needs for the same bytes (benchmarks/engine.py measures it),
# where fewer take longer and all of them take every SM from the model (docs/design.md).
STAGE_PROGRAMS = 32
# Up to this many pairs the staged path plans its descriptors in plain Python (a dozen numpy calls
# cost more than the loop), above it in numpy.
SMALL_PLAN = 64


def _stage(launcher: dma.Launcher, graph: kernels.GraphedCopy, block: IdBlock, sides: Sequence) -> None:
    """Write ``[n, *sides]`` into ``graph``'s id block on ``launcher``'s stream.

    Host sides go through the page-locked ``block`` (one copy for the count and every host side
    that follows it); a side already on the GPU is copied device to device. Either way the copy
    is stream-ordered after the replay that last read the graph's block.
    """
    n = len(sides[0])
    words, pinned, device = block.words, block.address, graph.address
    words[0] = n
    start, at = 0, 1  # the first word not yet copied in, and where the next side goes
    for ids in sides:
        if isinstance(ids, np.ndarray):
            words[at : at + n] = ids
        else:
            if at > start:
                launcher.copy(device + 8 * start, pinned + 8 * start, 8 * (at - start))
            launcher.copy(device + 8 * at, ids.data_ptr(), 8 * n)
            start = at + n
        at += n
    if at > start:
        launcher.copy(device + 8 * start, pinned + 8 * start, 8 * (at - start))


class StagedPath(EventPath):
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

    On the GPU each slot's gather and scatter is a CUDA graph over its own id block
    (:class:`kv_ops.kernels.GraphedCopy`). A slot is reused only after the work that reads it (a
    store's DMA, a load's scatter) has finished: ordered by one event per slot on the GPU, never
    by the host waiting. The rings, the slot cursor, the kernel streams and those events are a
    :class:`~kv_ops.transfer.staging_ring.StagingRing` (``staging``), one per engine: every KV
    group's staged path holds the same one.

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
    events : dict of Direction to Events, or None
        Where it takes completion events from (its own when None).
    views : sequence of Tensor, or None
        Each region's columns of the mirror, where ``regions`` are a KV group's.
    share : StagedPath, or None
        Another staged path of the same mirror, whose ring this one uses instead of making one.
    """

    name = "staged"
    copy_engines = True
    # The id sides it plans on the host: the ring's descriptors follow the host ids; the gather
    # reads the GPU ids on the GPU.
    host_planned = frozenset({"host_ids"})

    def __init__(
        self,
        regions: Sequence[torch.Tensor],
        mirror: torch.Tensor,
        streams: dict | None,
        ring_bytes: int,
        events=None,
        views: Sequence[torch.Tensor] | None = None,
        share: StagedPath | None = None,
    ):
        self.regions = list(regions)
        self.mirror = mirror
        self.streams = streams
        self._events = events or {d: Events() for d in Direction}
        self.device = self.regions[0].device
        self._pieces = _pieces(mirror, self.regions, host_views(mirror, self.regions, views))
        # A packed row that is a whole mirror row (every region, in mirror order) keeps the
        # descriptor per run of consecutive host ids; a group's row is one per (block, piece).
        self.whole_row = self._pieces[2].tolist() == [mirror.shape[1]]
        # Another group's staged path of this mirror: one ring, its streams and slots, for all.
        if share is not None:
            self.staging = share.staging
        else:
            self.staging = StagingRing(mirror, self.regions[0].shape[0], self.device, streams, ring_bytes)
        self.chunk = self.staging.chunk
        if streams is not None:
            self._make_graphs()

    def _make_graphs(self) -> None:
        """Bind the gather and scatter and capture each slot's graphs (GPU only)."""
        errors = error_counter(self.device)
        bound = {
            Direction.STORE: kernels.BoundCopy(self.device, self.regions, None, num_programs=STAGE_PROGRAMS),
            Direction.LOAD: kernels.BoundCopy(self.device, None, self.regions, num_programs=STAGE_PROGRAMS),
        }
        self._errors = errors
        rows = self.staging.slot_rows
        # Per direction and slot: graphs of the slot's gather (or scatter) fed from host ids,
        # pooled (a twin is rewritten only after the replay that read it has run; public: tests see
        # the pools grow).
        self.host_fed = {
            d: [
                Pool(
                    functools.partial(kernels.GraphedCopy, bound[d], self.chunk, errors, rows(d, slot), from_host=True)
                )
                for slot in range(RING_SLOTS)
            ]
            for d in Direction
        }
        # For GPU ids: each slot's graph fed device to device, and the pool of count blocks.
        # Made now: making a graph synchronises with the legacy stream, which a call must not.
        self._device_fed = {
            d: [
                [kernels.GraphedCopy(bound[d], self.chunk, errors, rows(d, slot)) for slot in range(RING_SLOTS)],
                Pool(functools.partial(IdBlock, 1 + self.chunk), initial=1),
            ]
            for d in Direction
        }

    def close(self) -> None:
        """Wait for the gathers and scatters on the ring's kernel streams (the engine synchronizes
        its copy streams): after an interrupted flush they must not outlive the memory they use."""
        self.staging.close()

    @property
    def ring_bytes(self) -> int:
        """GPU bytes of one direction's ring."""
        return self.staging.ring_bytes

    def enqueue(self, blocks: Blocks, ready: torch.cuda.Event | None) -> torch.cuda.Event | None:
        d = blocks.direction
        if blocks.count == 0:
            if self.streams is None:
                return None
            # On the stream where this direction's staged work ends (a load's last scatter), so
            # that the engine's issue order across paths still holds after an empty call. From the
            # direction's Events like every other completion: the engine gives it back there.
            staging = self.staging
            stream, launch = (
                (staging.kernel_streams[d], staging.kernel_launchers[d])
                if d is Direction.LOAD
                else (self.streams[d], staging.copy_launchers[d])
            )
            with driver_context(self.device):
                wait_event(launch.handle, ready)
                return self._events[d].record(stream, launch.handle)
        ring = self.ring(d)
        # Slots for every chunk up front, so that the whole transfer is planned in one pass.
        slots = [self.staging.take_slot(d) for _ in range(0, blocks.count, self.chunk)]
        plans = self.plans(blocks, ring, slots[0])
        bounds = self._bounds(blocks)
        if self.streams is None:
            gpu_ids = host_tensor(blocks.gpu_ids)
            for (start, stop), slot, plan in zip(bounds, slots, plans):
                staged = ring[slot * self.chunk : slot * self.chunk + stop - start]
                if d is Direction.STORE:
                    reference.gather_blocks(self.regions, gpu_ids[start:stop], staged)
                    dma.run_on_host(plan)
                else:
                    dma.run_on_host(plan)
                    reference.scatter_blocks(staged, gpu_ids[start:stop], self.regions)
            return None
        with driver_context(self.device):  # the raw driver calls below act on this thread's context
            return self._enqueue(blocks, ready, bounds, slots, plans)

    def _enqueue(self, blocks: Blocks, ready, bounds, slots, plans) -> torch.cuda.Event:
        d = blocks.direction
        staging = self.staging
        kernel, copy = staging.kernel_streams[d], self.streams[d]
        kernel_launch, copy_launch = staging.kernel_launchers[d], staging.copy_launchers[d]
        free, handoff = staging.slot_free[d], staging.handoff[d]
        gpu_ids = blocks.gpu_ids
        k, c = kernel_launch.handle, copy_launch.handle  # raw stream handles, for the driver calls
        on_host = isinstance(gpu_ids, np.ndarray)
        if not on_host:
            wait_event(k, blocks.ids_ready)  # GPU ids: after the work that wrote them
            graphs, blocks_pool = self._device_fed[d]
        taken = []

        def gather_or_scatter(slot: int, start: int, stop: int) -> None:
            # The chunk's ids into a graph of this slot, then its replay on the kernel stream.
            if on_host:
                pool = self.host_fed[d][slot]
                graph = pool.take()
                words = graph.words
                words[0] = stop - start
                words[1 : 1 + stop - start] = gpu_ids[start:stop]
                taken.append((pool, graph))
            else:
                graph, block = graphs[slot], blocks_pool.take()
                _stage(kernel_launch, graph, block, [gpu_ids[start:stop]])
                taken.append((blocks_pool, block))
            graph.replay(k)

        for i, ((start, stop), slot, plan) in enumerate(zip(bounds, slots, plans)):
            if d is Direction.STORE:
                if i == 0:
                    wait_event(k, ready)  # after the blocks' writers
                wait_event(k, free[slot])  # the slot's last DMA has read it
                gather_or_scatter(slot, start, stop)
                record_event(handoff, k)
                wait_event(c, handoff)
                copy_launch(plan)  # slot rows -> mirror rows, one descriptor per run
                record_event(free[slot], c)
            else:
                # Into the ring without waiting for ``ready``: the ring is the engine's own, so
                # the copy overlaps the caller's compute; only the scatter waits for it.
                wait_event(c, free[slot])  # the slot's last scatter has read it
                copy_launch(plan)
                record_event(handoff, c)
                wait_event(k, handoff)
                if i == 0:
                    wait_event(k, ready)  # after the blocks' readers
                gather_or_scatter(slot, start, stop)
                record_event(free[slot], k)
        done = self._events[d].record(*((copy, c) if d is Direction.STORE else (kernel, k)))
        for pool, item in taken:
            pool.give(item, done)
        return done

    def ring(self, direction: Direction) -> torch.Tensor:
        """The direction's ring of packed rows (made on first use on the CPU). Public, with
        :meth:`plans` and :meth:`small_plans`, so that tests check the two planners agree."""
        return self.staging.ring(direction)

    def _bounds(self, blocks: Blocks):
        return [(start, min(start + self.chunk, blocks.count)) for start in range(0, blocks.count, self.chunk)]

    def small_plans(self, host: list[int], ring: torch.Tensor, first_slot: int, direction) -> list[dma.Plan]:
        """:meth:`plans` for a few pairs, in plain Python: a dozen numpy calls cost more there."""
        chunk, row, rows = self.chunk, self.mirror.shape[1], ring.shape[0]
        ring_base, mirror_base = ring.data_ptr(), self.mirror.data_ptr()
        plans, ring_at, mirror_at, sizes = [], [], [], []
        previous = None
        for i, h in enumerate(host):
            if i % chunk == 0 and i:
                plans.append((ring_at, mirror_at, sizes))
                ring_at, mirror_at, sizes = [], [], []
            if i % chunk == 0 or h != previous + 1:
                ring_at.append((first_slot * chunk + i) % rows * row + ring_base)
                mirror_at.append(h * row + mirror_base)
                sizes.append(row)
            else:
                sizes[-1] += row
            previous = h
        plans.append((ring_at, mirror_at, sizes))
        out = []
        for ring_at, mirror_at, sizes in plans:
            r, m = np.array(ring_at, dtype=np.int64), np.array(mirror_at, dtype=np.int64)
            dsts, srcs = (m, r) if direction is Direction.STORE else (r, m)
            out.append(dma.Plan(dsts, srcs, np.array(sizes, dtype=np.int64)))
        return out

    def plans(self, blocks: Blocks, ring: torch.Tensor, first_slot: int) -> list[dma.Plan]:
        """Each chunk's copies between its ring slot and the mirror, planned in one pass.

        The chunks take consecutive slots from ``first_slot`` on, wrapping around the ring, so
        pair i sits in ring row ``(first_slot * chunk + i) % ring_rows``. A run of consecutive
        host ids within a chunk is one descriptor: ``mirror[h0 : h0 + n] <-> ring[r0 : r0 + n]``.
        """
        host, n, chunk, row = blocks.host_ids, blocks.count, self.chunk, self.mirror.shape[1]
        if not self.whole_row:
            return self._piece_plans(host, n, ring, first_slot, blocks.direction)
        if n <= SMALL_PLAN:
            return self.small_plans(host.tolist(), ring, first_slot, blocks.direction)
        begins = np.ones(n + 1, dtype=bool)  # [n] stays True: the end of the last run
        np.not_equal(np.diff(host), 1, out=begins[1:n])
        begins[:n:chunk] = True  # a run never crosses into the next chunk's slot (nor the ring's end)
        edges = np.flatnonzero(begins)
        first = edges[:-1]
        sizes = np.diff(edges) * row
        ring_at = (first + first_slot * chunk) % ring.shape[0] * row + ring.data_ptr()
        mirror_at = host[first] * row + self.mirror.data_ptr()
        dsts, srcs = (mirror_at, ring_at) if blocks.direction is Direction.STORE else (ring_at, mirror_at)
        if n <= chunk:
            return [dma.Plan(dsts, srcs, sizes)]
        # Where each chunk's descriptors begin: the runs are in pair order, and every chunk's
        # first pair begins a run.
        cut = np.searchsorted(first, np.arange(0, n, chunk)).tolist() + [first.size]
        return [dma.Plan(dsts[a:b], srcs[a:b], sizes[a:b]) for a, b in zip(cut[:-1], cut[1:])]

    def _piece_plans(self, host: np.ndarray, n: int, ring: torch.Tensor, first_slot: int, direction) -> list[dma.Plan]:
        """:meth:`plans` for a group's packed rows, which fill only some columns of a mirror row:
        one descriptor per (pair, piece), a piece being columns that are side by side in both
        the packed row and the mirror row. Pair i sits in ring row ``(first_slot * chunk + i) %
        ring_rows`` as in :meth:`plans`; no run spans two rows, as other columns lie between."""
        ring_cols, mirror_cols, widths = self._pieces
        chunk, row, k = self.chunk, self.mirror.shape[1], widths.size
        rows = (np.arange(first_slot * chunk, first_slot * chunk + n, dtype=np.int64) % ring.shape[0]) * row
        ring_at = ((rows + ring.data_ptr())[:, None] + ring_cols).ravel()
        mirror_at = ((host * row + self.mirror.data_ptr())[:, None] + mirror_cols).ravel()
        sizes = np.tile(widths, n)
        dsts, srcs = (mirror_at, ring_at) if direction is Direction.STORE else (ring_at, mirror_at)
        return [
            dma.Plan(dsts[a * k : b * k], srcs[a * k : b * k], sizes[a * k : b * k])
            for a, b in ((a, min(a + chunk, n)) for a in range(0, n, chunk))
        ]


def _pieces(mirror: torch.Tensor, regions: Sequence[torch.Tensor], views: Sequence[torch.Tensor]) -> tuple:
    """(packed-row columns, mirror-row columns, widths) as int64 arrays, one entry per run of
    regions whose columns follow each other on both sides: where each region's block sits in a
    packed row (side by side, in order) and in a mirror row (its view's columns)."""
    pieces: list[list[int]] = []
    packed = 0
    for region, view in zip(regions, views):
        width = region.shape[1]
        column = view.data_ptr() - mirror.data_ptr()
        if pieces and pieces[-1][0] + pieces[-1][2] == packed and pieces[-1][1] + pieces[-1][2] == column:
            pieces[-1][2] += width
        else:
            pieces.append([packed, column, width])
        packed += width
    ring_cols, mirror_cols, widths = (np.array(c, dtype=np.int64) for c in zip(*pieces))
    return ring_cols, mirror_cols, widths


__all__ = ["StagedPath", "RING_SLOTS", "STAGE_PROGRAMS", "SMALL_PLAN"]
