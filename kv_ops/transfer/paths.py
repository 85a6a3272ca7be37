"""The engine's path contract (:class:`TransferPath`), its kernel and direct-DMA paths, and the registry of all three.

The mirror paths, which :mod:`kv_ops.transfer.crossover` measures on the engine's own shape and
the engine picks from per call, launching the pick once:

* :class:`KernelPath` -- the Triton kernel reads and writes the mirror over PCIe (zero-copy) on
  a few SMs. No per-block cost: the choice for small, latency-bound transfers.
* :class:`~kv_ops.transfer.staged.StagedPath` -- a kernel gathers the scattered per-layer blocks
  into packed rows of a GPU ring (device to device), and the copy engines move each packed row,
  or run of rows, as one descriptor of ``block_bytes`` or more. Loads are the reverse.
* :class:`DirectDmaPath` -- the copy engines move each region's block (or run of blocks) straight
  between the cache and the mirror. One descriptor per block for a cross-layer cache (one region,
  packed like the mirror); one per region and block otherwise.

On the GPU a path sets itself up when it is made (copy kernels bound and captured into CUDA
graphs over id blocks of their own, :class:`kv_ops.kernels.GraphedCopy`; the staged ring
allocated), so a serving engine pays for them, and runs out of memory if it must, at start and
never in the middle of serving. Per transfer a path then does only what depends on it. On the
CPU each path runs synchronously through the same plans (:func:`kv_ops.transfer.dma.run_on_host`
executes what the copy engines would).

The mirror is one page-locked uint8 tensor ``[num_host_blocks, block_bytes]``: row ``h`` holds
host block ``h`` of every region side by side, in region order (the rows ``gather_blocks``
writes). The kernel and direct paths see it as per-region column views of it.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from .. import kernels, reference
from ..cuda import host_memory
from ..cuda.driver import driver_context, wait_event
from ..validation import error_counter
from . import dma
from .blocks import (
    Blocks,
    Direction,
    EventPath,
    Events,
    host_tensor,
    host_views,
    low_priority_streams,
    mirror_views,
    recorded,
)
from .ids import IdBlock, Pool
from .staged import RING_SLOTS, SMALL_PLAN, STAGE_PROGRAMS, StagedPath

# Pairs one replay of the kernel path's graph moves; a larger call replays it once per this many
# (its id block is 1 + 2 x this many int64: 256 KiB on the GPU and per pooled host block).
REPLAY_PAIRS = 1 << 14
# The kernel path's graphs copy their whole id block in from the host on every replay, so there is
# one set per size: a call takes the smallest that holds its pairs.
REPLAY_BUCKETS = (64, 1024, REPLAY_PAIRS)


@runtime_checkable
class TransferPath(Protocol):
    """What :class:`~kv_ops.transfer.engine.OffloadEngine` calls on a path, and nothing more.

    A path moves one :class:`Blocks` (GPU block ``gpu_ids[i]`` <-> host block ``host_ids[i]``).
    :class:`KernelPath`, :class:`StagedPath`, :class:`DirectDmaPath` and the disk tier's
    :class:`~kv_ops.transfer.disk.DiskPath` satisfy it, as does the layer-wise loads' path
    (:class:`kv_ops.LayerwiseLoads`), for loads only: the engine never picks it, it is handed
    to :meth:`~kv_ops.transfer.engine.OffloadEngine.load_through`, and ``copy_engines`` there
    says whether its mechanism leaves the SMs to the model (auto's tolerance never reads it).
    """

    #: Its key in the engine's ``path_counts``.
    name: str
    #: What the engine's errors call it (``path='kernel'``, ``the disk tier``).
    label: str
    #: Whether it leaves the SMs to the model: auto prefers such paths within its tolerance.
    copy_engines: bool
    #: The id sides (``"gpu_ids"``, ``"host_ids"``) it plans on the host, which the engine
    #: therefore refuses as GPU tensors.
    host_planned: frozenset
    #: Whether it waits on ``ready`` after ``enqueue`` returns (an I/O thread), so that it needs
    #: an event of its own rather than the engine's one reused event.
    fresh_ready: bool

    def enqueue(self, blocks: Blocks, ready: torch.cuda.Event | None):
        """Order the transfer after ``ready``, launch it, and return what completes with it: an
        event, or anything with an event's ``query()`` and ``synchronize()`` (None: complete
        already)."""

    def reported(self, direction: Direction, done) -> BaseException | None:
        """Once ``done`` has completed and its transfer is reported: the error that ended the
        transfer (None: it moved its bytes). The path may reuse ``done`` after this."""

    def close(self) -> None:
        """After the engine's last flush: stop what the path runs and release what it holds."""


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

    def __init__(
        self, regions: Sequence[torch.Tensor], mirror: torch.Tensor, streams: dict | None, events=None, views=None
    ):
        self.regions = list(regions)
        self.views = host_views(mirror, self.regions, views)
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
            reference.copy_blocks(src, dst, host_tensor(src_ids), host_tensor(dst_ids))
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

    def __init__(
        self, regions: Sequence[torch.Tensor], mirror: torch.Tensor, streams: dict | None, events=None, views=None
    ):
        self.regions = list(regions)
        self.views = host_views(mirror, self.regions, views)
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
    views: Sequence[torch.Tensor] | None = None,
    share: StagedPath | None = None,
) -> dict[str, Path]:
    """The paths ``names`` over ``regions`` and ``mirror``, by name (an engine makes the ones it
    may pick, which on the GPU allocates the staged ring; auto's measurement makes all three).
    ``events`` (per direction, :class:`Events`) is where they take completion events from.

    ``views`` are the mirror columns of each region, where ``regions`` are a KV group's (some
    regions, or the first bytes of a region's block) rather than every region in mirror order;
    such paths move only those bytes. ``share`` is a staged path of the same mirror whose ring,
    streams and slots the new staged path uses instead of allocating its own."""
    makers = {
        KernelPath.name: lambda: KernelPath(regions, mirror, streams, events, views),
        StagedPath.name: lambda: StagedPath(regions, mirror, streams, ring_bytes, events, views, share),
        DirectDmaPath.name: lambda: DirectDmaPath(regions, mirror, streams, events, views),
    }
    return {name: make() for name, make in makers.items() if name in names}


__all__ = [
    "TransferPath",
    "Direction",
    "Blocks",
    "Events",
    "EventPath",
    "KernelPath",
    "StagedPath",
    "DirectDmaPath",
    "Path",
    "PATH_CLASSES",
    "PATH_NAMES",
    "COPY_ENGINES",
    "make_paths",
    "low_priority_streams",
    "mirror_views",
    "recorded",
    "RING_SLOTS",
    "SMALL_PLAN",
    "STAGE_PROGRAMS",
    "REPLAY_PAIRS",
]
