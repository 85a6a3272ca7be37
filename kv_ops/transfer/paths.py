"""The engine's three ways to move blocks between the GPU cache and the packed host mirror.

Every path moves one :class:`Blocks` (GPU block ``gpu_ids[i]`` <-> mirror row ``host_ids[i]``)
and has the members the engine uses, and no others:

* ``enqueue(blocks, ready)`` orders the transfer after the ``ready`` event, launches it and
  returns what completes with it: an event, or anything with an event's ``query()`` and
  ``synchronize()`` (None: complete already);
* ``reported(direction, done)``, once ``done`` has completed and its transfer is reported: the
  error that ended the transfer (None: it moved its bytes); the path may reuse ``done`` after it;
* ``close()``, after the engine's last flush: stop what the path runs and holds;
* ``name`` (its key in ``path_counts``), ``label`` (what the engine's errors call it),
  ``copy_engines`` (whether it leaves the SMs to the model), ``host_planned`` (the id sides it
  plans on the host, which the engine therefore refuses as GPU tensors) and ``fresh_ready``
  (whether it waits on ``ready`` after ``enqueue`` returns, so that it needs an event of its own).

The three here answer ``reported``, ``close``, ``label`` and ``fresh_ready`` alike
(:class:`EventPath`); the disk tier (:class:`kv_ops.transfer.disk.DiskPath`) and the layer-wise
loads are paths too.
:mod:`kv_ops.transfer.crossover` measures these three on the engine's own shape; the engine picks
one per call and launches it once.

* :class:`KernelPath` -- the Triton kernel reads and writes the mirror over PCIe (zero-copy) on
  a few SMs. No per-block cost: the choice for small, latency-bound transfers.
* :class:`StagedPath` -- a kernel gathers the scattered per-layer blocks into packed rows of a GPU
  ring (device to device, at TB/s), and the copy engines move each packed row, or run of rows,
  as one descriptor of ``block_bytes`` or more. Loads are the reverse.
* :class:`DirectDmaPath` -- the copy engines move each region's block (or run of blocks) straight
  between the cache and the mirror. One descriptor per block for a cross-layer cache (one region,
  packed like the mirror); one per region and block otherwise.

On the GPU a path sets itself up when it is made: its copy kernels are bound and captured into
CUDA graphs that read their ids from blocks of their own (:class:`kv_ops.kernels.GraphedCopy`),
and the staged ring is allocated, so a serving engine pays for them (and runs out of memory, if
it must) at start, never on a transfer in the middle of serving. Per transfer a path then does
only what depends on it: the ids written where a graph reads them, one replay per chunk, the
plan's descriptors (numpy, or plain Python for a few pairs), and its events recorded and waited
on with one driver call each. On the CPU (an engine over CPU tensors)
each path runs synchronously through the same plans: :func:`kv_ops.dma.run_on_host` executes
what the copy engines would.

The mirror is one page-locked uint8 tensor ``[num_host_blocks, block_bytes]``: row ``h`` holds
host block ``h`` of every region side by side, in region order -- the rows ``gather_blocks``
writes. The kernel and direct paths see it as per-region column views of it.
"""

from __future__ import annotations

import bisect
import enum
import functools
from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

from .. import host_memory, kernels, reference
from ..driver import driver_context, record_event, wait_event
from ..validation import error_counter
from . import dma
from .ids import IdBlock, Pool

# Ring slots per direction: with four, a store's gather of chunk i+1 (and i+2) runs while the
# copy engines drain chunk i, and calls issued back to back keep the pipeline full.
RING_SLOTS = 4
# Programs of the staging gather and scatter. Device-to-device, 32 programs move about 1 TB/s on
# the H200 (benchmarks/engine.py: 32,000 SM-us per GB): the SMs work 5.5% of the time the link
# needs for the same bytes. A probe measured 8 programs at 23% and all SMs at 3.5%, which takes
# 4x the SMs from the model while they run.
STAGE_PROGRAMS = 32
# Pairs one replay of the kernel path's graph moves; a larger call replays it once per this many
# (its id block is 1 + 2 x this many int64: 256 KiB on the GPU and per pooled host block).
REPLAY_PAIRS = 1 << 14
# The kernel path's graphs copy their whole id block in from the host on every replay, so there is
# one set per size: a call takes the smallest that holds its pairs.
REPLAY_BUCKETS = (64, 1024, REPLAY_PAIRS)
# Up to this many pairs the staged path plans its descriptors in plain Python (a dozen numpy calls
# cost more than the loop), above it in numpy.
SMALL_PLAN = 64


class Direction(enum.Enum):
    STORE = "store"  # GPU cache -> host mirror
    LOAD = "load"  # host mirror -> GPU cache


class Blocks:
    """One transfer: GPU block ``gpu_ids[i]`` <-> mirror row ``host_ids[i]``, ids checked.

    Each side is a 1-D int64 numpy array, or an int64 tensor on the engine's GPU, which the host
    never reads (the kernel path takes both sides there, the staged path ``gpu_ids``); then
    ``ids_ready`` is an event after the work that wrote them. ``runs`` is
    :func:`kv_ops.dma.run_starts` of the pairs and ``num_runs`` their count, found on first use.
    """

    __slots__ = ("direction", "gpu_ids", "host_ids", "ids_ready", "__dict__")

    def __init__(self, direction: Direction, gpu_ids, host_ids, ids_ready: torch.cuda.Event | None = None):
        self.direction = direction
        self.gpu_ids = gpu_ids
        self.host_ids = host_ids
        self.ids_ready = ids_ready

    @classmethod
    def of(cls, direction: Direction, gpu_ids, host_ids) -> "Blocks":
        """From host ids of any form (CPU tensors, arrays), as int64 numpy arrays."""
        return cls(direction, dma.host_array(gpu_ids), dma.host_array(host_ids))

    @property
    def count(self) -> int:
        return len(self.gpu_ids)

    @property
    def on_host(self) -> bool:
        """Both sides are host arrays (the copy-engine plans need them)."""
        return isinstance(self.gpu_ids, np.ndarray) and isinstance(self.host_ids, np.ndarray)

    @functools.cached_property
    def runs(self) -> tuple[np.ndarray, np.ndarray]:
        return dma.run_starts(self.gpu_ids, self.host_ids)

    @functools.cached_property
    def num_runs(self) -> int:
        """How many runs ``runs`` has, counted with fewer operations (auto's pick needs only this)."""
        return dma.count_runs(self.gpu_ids, self.host_ids)

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


def recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


class Events:
    """One direction's completion events, reused once reported.

    The engine gives an event back when :meth:`OffloadEngine.poll` has seen it fire; a path then
    records it again with one driver call instead of making a new one. Whoever still holds an
    old reference (the engine's last transfer) can only over-wait on a later record, never
    under-wait, and every wait points at work issued before it. An id pool's reuse check must
    not over-wait (it would grow the pool, which synchronizes): it reads the event's
    ``records``.
    """

    def __init__(self):
        self._free: deque[torch.cuda.Event] = deque()

    def record(self, stream: torch.cuda.Stream, handle) -> torch.cuda.Event:
        """An event recorded now on ``stream`` (``handle``: its raw handle). Its ``records`` counts
        its records, so that a :class:`kv_ops.transfer.ids.Pool` holding it can tell that the
        record it waited for has run (see there)."""
        if self._free:
            event = self._free.pop()
            record_event(event, handle)
            event.records += 1
            return event
        event = recorded(stream)
        event.records = 1
        return event

    def give(self, event: torch.cuda.Event) -> None:
        self._free.append(event)


class EventPath:
    """What the three paths (and the layer-wise loads) answer alike: each waits on ``ready``
    before ``enqueue`` returns, and each transfer completes with an event from ``_events`` (the
    engine's :class:`Events`, per direction), which goes back there once reported."""

    fresh_ready = False  # the wait is enqueued before enqueue returns: the engine's one reused event serves
    _events: dict[Direction, Events]

    @property
    def label(self) -> str:
        return f"path={self.name!r}"

    def reported(self, direction: Direction, done: torch.cuda.Event | None) -> None:
        # Never an error: a launch that fails raises in enqueue, a device fault in the event's query.
        if done is not None:
            self._events[direction].give(done)

    def close(self) -> None:
        """Nothing to stop: the engine synchronizes its own copy streams."""


def _host_tensor(ids) -> torch.Tensor:
    """Host ids for the CPU's reference copies (a view of the array, no copy)."""
    return torch.from_numpy(ids)


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


class KernelPath(EventPath):
    """The Triton block-copy kernel between the cache regions and the mirror's region views.

    On the GPU each direction's copy is captured into CUDA graphs that read the count and the
    ids from a device block of their own (:class:`kv_ops.kernels.GraphedCopy`). With host ids
    (the usual case) a graph copies its block in from a page-locked twin, so a transfer writes
    the ids into the twin and replays the graph: one driver call. The graphs come in
    :data:`REPLAY_BUCKETS` sizes and are pooled (:class:`kv_ops.transfer.ids.Pool`): a twin is rewritten
    only after the replay that read it has run. GPU ids need no block: the kernel is launched
    with them as they are, one launch per transfer.
    """

    name = "kernel"
    copy_engines = False
    # The id sides it plans on the host: none, its kernel reads both sides' ids on the GPU.
    host_planned = frozenset()

    def __init__(self, regions: Sequence[torch.Tensor], mirror: torch.Tensor, streams: dict | None, events=None):
        self.regions = list(regions)
        self.views = mirror_views(mirror, [r.shape[1] for r in self.regions])
        self.streams = streams
        self.device = self.regions[0].device
        self._events = events or {d: Events() for d in Direction}
        if streams is not None:
            # No more pairs than a call can have: stores have distinct host ids, loads distinct GPU ids.
            self.capacity = min(REPLAY_PAIRS, max(mirror.shape[0], self.regions[0].shape[0]))
            self.buckets = sorted({min(b, self.capacity) for b in REPLAY_BUCKETS})
            self._errors = errors = error_counter(self.device)
            self._copies = {
                Direction.STORE: kernels.BoundCopy(self.device, self.regions, self.views),
                Direction.LOAD: kernels.BoundCopy(self.device, self.views, self.regions),
            }
            # Per direction and bucket: pooled graphs fed from host ids (public: tests see the pools grow).
            self.host_fed = {
                d: [
                    Pool(functools.partial(kernels.GraphedCopy, self._copies[d], b, errors, from_host=True))
                    for b in self.buckets
                ]
                for d in Direction
            }
            self._launchers = {d: dma.Launcher(streams[d]) for d in Direction}
            # GPU ids are launched with as they are; a host side beside them comes in through a
            # page-locked block to a device block of its direction, made now (outside any graph
            # pool), as the kernel for aligned int64 ids (what ids.take hands over) is compiled
            # now: not on the first such call in the middle of serving.
            self._host_side = {}
            for d in Direction:
                ids = host_memory.lasting_copy(torch.zeros(self.capacity, dtype=torch.int64), self.device)
                self._host_side[d] = (Pool(functools.partial(IdBlock, self.capacity), initial=1), ids, ids.data_ptr())
                self._copies[d].launch_kernel(None, ids, ids, 0, errors, 1, False, streams[d])

    def enqueue(self, blocks: Blocks, ready: torch.cuda.Event | None) -> torch.cuda.Event | None:
        src, dst, src_ids, dst_ids = blocks.sides(self.regions, self.views)
        if self.streams is None:
            reference.copy_blocks(src, dst, _host_tensor(src_ids), _host_tensor(dst_ids))
            return None
        with driver_context(self.device):  # the raw driver calls below act on this thread's context
            if blocks.on_host:
                return self._enqueue_host_ids(blocks.direction, ready, src_ids, dst_ids)
            return self._enqueue_gpu_ids(blocks, ready, src_ids, dst_ids)

    def _enqueue_host_ids(self, d: Direction, ready, src_ids: np.ndarray, dst_ids: np.ndarray) -> torch.cuda.Event:
        handle = self._launchers[d].handle
        pools, taken = self.host_fed[d], []
        n, step = len(src_ids), self.capacity
        wait_event(handle, ready)  # the graph's own id copy, and the kernel, come after the caller
        for lo in range(0, n, step):
            m = min(step, n - lo)
            pool = pools[bisect.bisect_left(self.buckets, m)]
            graph = pool.take()
            words = graph.words
            words[0] = m
            words[1 : 1 + m] = src_ids[lo : lo + m]
            words[1 + m : 1 + 2 * m] = dst_ids[lo : lo + m]
            graph.replay(handle)
            taken.append((pool, graph))
        done = self._events[d].record(self.streams[d], handle)
        for pool, graph in taken:
            pool.give(graph, done)
        return done

    def _enqueue_gpu_ids(self, blocks: Blocks, ready, src_ids, dst_ids) -> torch.cuda.Event:
        d = blocks.direction
        stream, launcher = self.streams[d], self._launchers[d]
        handle = launcher.handle
        wait_event(handle, blocks.ids_ready)  # GPU ids: after the work that wrote them
        if ready is not blocks.ids_ready:  # the same event unless the caller passed after=
            wait_event(handle, ready)  # and the copy after the caller
        copy, n = self._copies[d], blocks.count
        if not isinstance(src_ids, np.ndarray) and not isinstance(dst_ids, np.ndarray):
            # One launch that reads the ids where they are (the engine keeps them alive until
            # the transfer is reported): no id block to fill, no graph.
            copy(None, src_ids, dst_ids, n, self._errors, stream)
            return self._events[d].record(stream, handle)
        # One side is host ids: they go to the device first, through a pooled page-locked block
        # (rewritten once the copy that read it ran) into this direction's device block
        # (rewritten only by later work on this stream, after the kernel that read it).
        staging, device_ids, address = self._host_side[d]
        host_src = isinstance(src_ids, np.ndarray)
        host, gpu = (src_ids, dst_ids) if host_src else (dst_ids, src_ids)
        taken = []
        for lo in range(0, n, self.capacity):
            m = min(self.capacity, n - lo)
            block = staging.take()
            taken.append(block)
            block.words[:m] = host[lo : lo + m]
            launcher.copy(address, block.address, 8 * m)
            part = gpu if m == n else gpu[lo : lo + m]
            sides = (device_ids, part) if host_src else (part, device_ids)
            copy(None, *sides, m, self._errors, stream)
        done = self._events[d].record(stream, handle)
        for block in taken:
            staging.give(block, done)
        return done


class DirectDmaPath(EventPath):
    """The copy engines, region by region, straight between the cache and the mirror."""

    name = "dma"
    copy_engines = True
    # The id sides it plans on the host: both, every descriptor is planned there.
    host_planned = frozenset({"gpu_ids", "host_ids"})

    def __init__(self, regions: Sequence[torch.Tensor], mirror: torch.Tensor, streams: dict | None, events=None):
        self.regions = list(regions)
        self.views = mirror_views(mirror, [r.shape[1] for r in self.regions])
        self.streams = streams
        self._events = events or {d: Events() for d in Direction}
        # Runs merge into one copy only where a region's blocks are back to back on both sides:
        # a one-region (cross-layer) cache, whose mirror view is the whole mirror.
        self._planners = {
            Direction.STORE: dma.Planner(self.regions, self.views),
            Direction.LOAD: dma.Planner(self.views, self.regions),
        }
        self._launchers = {d: dma.Launcher(streams[d]) for d in Direction} if streams is not None else None
        self.device = self.regions[0].device

    def enqueue(self, blocks: Blocks, ready: torch.cuda.Event | None) -> torch.cuda.Event | None:
        _, _, src_ids, dst_ids = blocks.sides(self.regions, self.views)
        d = blocks.direction
        plan = self._planners[d].plan(src_ids, dst_ids)
        if self.streams is None:
            dma.run_on_host(plan)
            return None
        launcher = self._launchers[d]
        with driver_context(self.device):
            wait_event(launcher.handle, ready)
            launcher(plan)  # reads the source in stream order: after the wait
            return self._events[d].record(self.streams[d], launcher.handle)


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
    by the host waiting.

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
    # The id sides it plans on the host: the ring's descriptors follow the host ids; the gather
    # reads the GPU ids on the GPU.
    host_planned = frozenset({"host_ids"})

    def __init__(
        self, regions: Sequence[torch.Tensor], mirror: torch.Tensor, streams: dict | None, ring_bytes: int, events=None
    ):
        self.regions = list(regions)
        self.mirror = mirror
        self.streams = streams
        self._events = events or {d: Events() for d in Direction}
        self.device = self.regions[0].device
        row_bytes = mirror.shape[1]
        most_pairs = max(mirror.shape[0], self.regions[0].shape[0])
        self.chunk = max(1, min(ring_bytes // (RING_SLOTS * row_bytes), -(-most_pairs // RING_SLOTS)))
        self._next = {d: 0 for d in Direction}
        # Each direction's ring. On the GPU, made now with its graphs; on the CPU, on first use
        # (an engine there picks the kernel path's reference copy unless told).
        self._rings: dict[Direction, torch.Tensor] = {}
        # Where the gathers and scatters run, beside the engine's copy streams (None on the CPU).
        self.kernel_streams = None
        if streams is not None:
            self.kernel_streams = low_priority_streams(self.device)
            errors = error_counter(self.device)
            bound = {
                Direction.STORE: kernels.BoundCopy(self.device, self.regions, None, num_programs=STAGE_PROGRAMS),
                Direction.LOAD: kernels.BoundCopy(self.device, None, self.regions, num_programs=STAGE_PROGRAMS),
            }
            self._bound = bound
            self._errors = errors
            # Per direction and slot: graphs of the slot's gather (or scatter) fed from host ids,
            # pooled (a twin is rewritten only after the replay that read it has run; public: tests see
            # the pools grow).
            self.host_fed = {
                d: [
                    Pool(
                        functools.partial(
                            kernels.GraphedCopy, bound[d], self.chunk, errors, self._slot_rows(d, slot), from_host=True
                        )
                    )
                    for slot in range(RING_SLOTS)
                ]
                for d in Direction
            }
            # For GPU ids: each slot's graph fed device to device, and the pool of count blocks.
            # Made now: making a graph synchronises with the legacy stream, which a call must not.
            self._device_fed = {
                d: [
                    [
                        kernels.GraphedCopy(bound[d], self.chunk, errors, self._slot_rows(d, slot))
                        for slot in range(RING_SLOTS)
                    ],
                    Pool(functools.partial(IdBlock, 1 + self.chunk), initial=1),
                ]
                for d in Direction
            }
            self._copy = {d: dma.Launcher(streams[d]) for d in Direction}
            self._kernel = {d: dma.Launcher(self.kernel_streams[d]) for d in Direction}
            # Per direction and slot: recorded after the work that last read the slot. Per
            # direction: the hand-off from one stream to the other, waited on right after each
            # record. Each recorded once now (on an idle stream), so that it exists and every
            # later record is one driver call.
            self._free = {d: [recorded(streams[d]) for _ in range(RING_SLOTS)] for d in Direction}
            self._handoff = {d: recorded(streams[d]) for d in Direction}

    def close(self) -> None:
        """Wait for the gathers and scatters on its own kernel streams (the engine synchronizes its
        copy streams): after an interrupted flush they must not outlive the memory they use."""
        for stream in (self.kernel_streams or {}).values():
            stream.synchronize()

    @property
    def ring_bytes(self) -> int:
        """GPU bytes of one direction's ring."""
        return RING_SLOTS * self.chunk * self.mirror.shape[1]

    def _slot_rows(self, direction: Direction, slot: int) -> torch.Tensor:
        return self.ring(direction)[slot * self.chunk : (slot + 1) * self.chunk]

    def enqueue(self, blocks: Blocks, ready: torch.cuda.Event | None) -> torch.cuda.Event | None:
        d = blocks.direction
        if blocks.count == 0:
            if self.streams is None:
                return None
            # On the stream where this direction's staged work ends (a load's last scatter), so
            # that the engine's issue order across paths still holds after an empty call. From the
            # direction's Events like every other completion: the engine gives it back there.
            stream, launch = (
                (self.kernel_streams[d], self._kernel[d]) if d is Direction.LOAD else (self.streams[d], self._copy[d])
            )
            with driver_context(self.device):
                wait_event(launch.handle, ready)
                return self._events[d].record(stream, launch.handle)
        ring = self.ring(d)
        # Slots for every chunk up front, so that the whole transfer is planned in one pass.
        slots = [self._take_slot(d) for _ in range(0, blocks.count, self.chunk)]
        plans = self.plans(blocks, ring, slots[0])
        bounds = self._bounds(blocks)
        if self.streams is None:
            gpu_ids = _host_tensor(blocks.gpu_ids)
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
        kernel, copy = self.kernel_streams[d], self.streams[d]
        kernel_launch, copy_launch = self._kernel[d], self._copy[d]
        free, handoff = self._free[d], self._handoff[d]
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
    events: dict | None = None,
) -> dict[str, Path]:
    """The paths ``names`` over ``regions`` and ``mirror``, by name (an engine makes the ones it
    may pick, which on the GPU allocates the staged ring; auto's measurement makes all three).
    ``events`` (per direction, :class:`Events`) is where they take completion events from."""
    makers = {
        KernelPath.name: lambda: KernelPath(regions, mirror, streams, events),
        StagedPath.name: lambda: StagedPath(regions, mirror, streams, ring_bytes, events),
        DirectDmaPath.name: lambda: DirectDmaPath(regions, mirror, streams, events),
    }
    return {name: make() for name, make in makers.items() if name in names}


__all__ = [
    "Direction",
    "Blocks",
    "Events",
    "EventPath",
    "KernelPath",
    "StagedPath",
    "DirectDmaPath",
    "Path",
    "PATH_NAMES",
    "COPY_ENGINES",
    "make_paths",
    "low_priority_streams",
    "mirror_views",
    "recorded",
    "RING_SLOTS",
    "STAGE_PROGRAMS",
    "REPLAY_PAIRS",
]
