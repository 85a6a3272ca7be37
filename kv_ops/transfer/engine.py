"""OffloadEngine: stores and loads KV blocks between the GPU cache and a packed host mirror.

The mirror is one page-locked uint8 tensor ``[num_host_blocks, block_bytes]``: row ``h`` holds host
block ``h`` of every region side by side, in region order (the rows ``gather_blocks`` writes, and
the disk tier's file slots).

The engine owns one low-priority copy stream per direction. Each call orders its transfer after
an event (by default recorded on the caller's current stream, or ``after=``), so a store reads
blocks only after the compute that wrote them, and a load overwrites blocks only after their
readers (the two races vLLM shipped). Completion is tracked per direction by events in issue
order, so a transfer id is reported done only after its copy finished, and every earlier one of
that direction too (a high-water mark).

Each call checks its ids once, picks one path once and launches it once (:mod:`kv_ops.transfer.paths`):
the zero-copy kernel, the staged path (gather into a GPU ring, then the copy engines), or direct
DMA. With ``path="auto"`` the pick follows what :mod:`kv_ops.transfer.crossover` measured for this
engine's shape on this device: one call's rate, host time included, for a call that has the engine
to itself; the sustained rate of back-to-back calls for one issued behind others in flight. The
disk tier is one more path behind the same interface (:class:`kv_ops.transfer.disk.DiskPath`),
the only one of a ``disk_dir`` engine: the engine submits, orders, collects, flushes and closes
every transfer the same way, whatever its path.

Lifecycle: :meth:`OffloadEngine.close` (or leaving a ``with`` block) first waits for every
transfer in flight, then frees the mirror or closes the disk tier's file and stops its thread;
any later call raises :class:`ClosedError`. An engine still open when the interpreter exits
is closed then, as :meth:`~OffloadEngine.close` does (:func:`_close_at_exit` says why). The disk
tier's file has no name from the moment it is open, so even a process killed with SIGKILL leaves
nothing in ``disk_dir``.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import numbers
import os
import weakref
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..cuda.arguments import positive_int
from ..cuda.capture import refuse_capture
from ..cuda.driver import current_stream_handle, driver_context, record_event
from ..cuda.host_memory import check_host_bytes, pinned_empty, register_host
from ..geometry import KVCacheTensorSpec, block_bytes, check_kv_caches, regions_of
from . import crossover as crossover_mod
from . import ids as ids_mod
from .blocks import Blocks, Direction, Events, low_priority_streams, mirror_views
from .disk import DiskPath, DiskTier, aligned
from .paths import COPY_ENGINES, PATH_NAMES, TransferPath, make_paths

PATHS = ("auto", *PATH_NAMES)
# GPU memory of each direction's staging ring, by default (the staged path's chunks pipeline
# through it; a ring never holds more rows than one transfer can have).
RING_BYTES = 128 << 20


class ClosedError(ValueError, RuntimeError):
    """A call on an object after its ``close()``: an :class:`OffloadEngine`, a
    :class:`kv_ops.LayerwiseLoads`, a :class:`kv_ops.StepTransfers`, or what is built on them.

    One type for every such object, so that one ``except`` clause covers them all. It is both a
    ``ValueError`` and a ``RuntimeError``, so that an ``except`` clause for either catches it too.
    """


# The engine's own name for it: the very same class, so either name catches it.
EngineClosedError = ClosedError


@dataclass
class Completed:
    """What :meth:`OffloadEngine.poll` found finished since the last poll, in issue order.

    ``failed`` maps the id of a transfer that did not complete (a disk-tier I/O error) to its
    error; such an id never appears in ``stores`` or ``loads``. A failed store leaves its host
    blocks (file slots), and a failed load its GPU blocks, with undefined contents; every other
    transfer is unaffected.
    """

    stores: list[int] = field(default_factory=list)
    loads: list[int] = field(default_factory=list)
    failed: dict[int, BaseException] = field(default_factory=dict)


class _Lane:
    """One direction: transfers in issue order, each with its path, what the path's ``enqueue``
    returned to complete with it (an event, or the disk tier's job; None: already complete),
    and what must live until it completes (GPU ids the transfer reads). The head is reported
    first, so nothing overtakes."""

    def __init__(self, direction: Direction):
        self.direction = direction
        self.pending: deque[tuple[int, TransferPath, object, object]] = deque()

    def add(self, tid: int, path: TransferPath, done, keep=None) -> None:
        self.pending.append((tid, path, done, keep))

    def poll(self, out: Completed, done_ids: list[int], wait: bool = False) -> None:
        while self.pending:
            tid, path, done, _ = self.pending[0]
            if done is not None and not done.query():
                if not wait:
                    return
                done.synchronize()
            self.pending.popleft()
            error = path.reported(self.direction, done)
            if error is None:
                done_ids.append(tid)
            else:
                out.failed[tid] = error


def resolve_groups(owner: str, groups, regions: Mapping[str, torch.Tensor]) -> dict[Hashable, tuple]:
    """``groups`` (group -> entries) as group -> ``((region name, bytes), ...)``, checked.

    An entry is a region name (its whole block), a layer name whose regions are ``layer.<g>``
    (each of them whole), or ``(region name, nbytes)``: the first ``nbytes`` of the region's
    block (a layer whose page is padded beyond its data). A ``ValueError`` names ``groups``, the
    group and the entry otherwise.
    """
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError(f"{owner}: groups must be a non-empty mapping of group to region names, got {groups!r}")
    known = ", ".join(map(repr, regions))
    out: dict[Hashable, tuple] = {}
    for key, entries in groups.items():
        if key is None:
            raise ValueError(f"{owner}: groups has the key None, which stands for a call without group")
        if isinstance(entries, (str, bytes)) or not isinstance(entries, Sequence) or not entries:
            raise ValueError(f"{owner}: groups[{key!r}] must be a non-empty list of region names, got {entries!r}")
        resolved: list[tuple[str, int]] = []
        for entry in entries:
            if isinstance(entry, str) and entry in regions:
                resolved.append((entry, regions[entry].shape[1]))
            elif isinstance(entry, str) and f"{entry}.0" in regions:  # a layer of several regions
                resolved += [(n, r.shape[1]) for n, r in regions.items() if n.rpartition(".")[0] == entry]
            elif isinstance(entry, tuple) and len(entry) == 2 and entry[0] in regions:
                name, nbytes = entry
                width = regions[name].shape[1]
                if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral) or not 0 < nbytes <= width:
                    raise ValueError(
                        f"{owner}: groups[{key!r}] entry {entry!r}: the bytes must be an integer in [1, {width}] "
                        f"(region {name!r}'s block), got {nbytes!r}"
                    )
                resolved.append((name, int(nbytes)))
            else:
                raise ValueError(
                    f"{owner}: groups[{key!r}] entry {entry!r} is no region (nor (region, nbytes)); the regions are {known}"
                )
        names = [name for name, _ in resolved]
        if len(set(names)) != len(names):
            raise ValueError(f"{owner}: groups[{key!r}] names a region twice: {entries!r}")
        out[key] = tuple(resolved)
    return out


def check_host_buffer(buffer, nbytes: int, disk_dir) -> None:
    """A ``ValueError`` naming ``host_buffer`` unless it is host memory the mirror can live in:
    a contiguous CPU uint8 tensor of at least ``nbytes`` bytes, and no ``disk_dir``."""
    if disk_dir is not None:
        raise ValueError("OffloadEngine: host_buffer holds the host mirror, but disk_dir was given: pass one of them")
    if not isinstance(buffer, torch.Tensor):
        raise ValueError(f"OffloadEngine: host_buffer must be a CPU uint8 tensor, got {type(buffer).__name__}")
    if buffer.device.type != "cpu":
        raise ValueError(f"OffloadEngine: host_buffer must be host memory, got a tensor on {buffer.device}")
    if buffer.dtype != torch.uint8:
        raise ValueError(f"OffloadEngine: host_buffer must be uint8, got {buffer.dtype}")
    if not buffer.is_contiguous():
        raise ValueError(f"OffloadEngine: host_buffer must be contiguous, got strides {buffer.stride()}")
    if buffer.numel() < nbytes:
        raise ValueError(
            f"OffloadEngine: host_buffer holds {buffer.numel()} bytes, but the mirror of capacity_bytes needs {nbytes}"
        )


def crossover_file_of(crossover_file: str | None, shape: int) -> str | None:
    """Where auto's measurement of an engine's ``shape``-th distinct group shape is kept: the
    file itself for the first, ``name.<shape>.ext`` beside it for the others (one file holds one
    shape's measurement)."""
    if crossover_file is None or shape == 0:
        return crossover_file
    stem, ext = os.path.splitext(crossover_file)
    return f"{stem}.{shape}{ext}"


class OffloadEngine:
    """Offload KV-cache blocks of one device to page-locked host memory and back.

    Parameters
    ----------
    kv_caches : mapping of str to Tensor
        The cache tensors, all on one device.
    num_blocks : int
        Blocks per region on the GPU side.
    capacity_bytes : int
        Host memory for the mirror. It holds ``capacity_bytes // block_bytes`` blocks, where
        ``block_bytes`` sums every region's block: no power-of-two rounding, and regions of
        different block sizes share the same block ids.
    specs : sequence of KVCacheTensorSpec, optional
        The layout; without it the layout is inferred (:func:`kv_ops.infer_regions`).
    disk_dir : str, optional
        Put the offloaded blocks in a file in this directory instead of host memory; then
        ``capacity_bytes`` sizes the file (slots of ``block_bytes`` rounded up to 4 KiB) and
        host ids are file slots. Every transfer then takes the disk tier (``path`` is not used;
        ``self.path`` is ``"disk"``), counted in ``path_counts["disk"]``. See
        :class:`kv_ops.transfer.disk.BlockFile`, :class:`DiskTier` and :class:`DiskPath`.
    disk_tag : str, optional
        Names this rank's or device's file; ``"<device>"`` (e.g. ``cuda0``) by default.
    page_cache : bool
        Buffered file I/O instead of ``O_DIRECT``.
    staging_slots, staging_blocks : int
        Page-locked staging buffers of the disk tier (two: double buffering) and blocks in each;
        positive integers (checked with or without ``disk_dir``).
    path : {"auto", "kernel", "staged", "dma"}
        How mirror transfers move (:mod:`kv_ops.transfer.paths`): per call by what was measured for this
        shape (``self.crossover``; ``self.crossover.table()`` shows it), the zero-copy kernel,
        gather into a GPU ring then the copy engines, or the copy engines straight between the
        cache and the mirror (one descriptor per block where the cache is one cross-layer
        region). ``auto`` on a CPU engine is the kernel path's reference copy. The disk tier
        packs its staging buffers with the kernel.
    ring_bytes : int
        GPU memory of each direction's staging ring (128 MiB by default; no more rows than a
        transfer can have), allocated here when ``path`` is ``"staged"`` or ``"auto"``.
    crossover_file : str, optional
        With ``path="auto"``: keep the measurement in this JSON file and reuse it while the
        device model, the regions' widths, the ring and torch stay the same. With ``groups`` of
        several shapes, the second shape's is kept in ``name.1.ext`` beside it, and so on.
    groups : mapping of group to list of region names, optional
        KV-cache groups, each moving only its own regions' bytes: then every :meth:`store` and
        :meth:`load` names its ``group`` and moves only those columns of the mirror rows and
        those regions' blocks, leaving every other region untouched on both sides (vLLM's hybrid
        models: a GPU block belongs to one group at a time). An entry is a region name (a key
        of ``self.regions``), a layer name whose regions are ``layer.0`` and ``layer.1``, or
        ``(region name, nbytes)`` for the first ``nbytes`` of its block. Chosen once: each
        group's paths (and, with ``auto``, the measurement of its widths) are made here, groups
        of equal entries share them, and every group's staged path shares one ring. A call then
        finds its group's paths with one dictionary lookup. Not with ``disk_dir``.
    host_buffer : Tensor, optional
        Host memory for the mirror that the caller allocated and keeps owning (a mapping the
        ranks of a machine share, :func:`kv_ops.cuda.host_memory.shared_host_buffer`): a contiguous
        CPU uint8 tensor of at least ``num_host_blocks * block_bytes`` bytes, whose first bytes
        become ``self.mirror``. On CUDA the engine registers it with the driver (unless it is
        page-locked already) and unregisters it on :meth:`close`; it never frees it. Not with
        ``disk_dir``.

    Raises
    ------
    ValueError
        Before anything is allocated: ``kv_caches`` not a non-empty mapping of names to CUDA or
        CPU tensors (meta tensors hold no bytes), ``num_blocks``, ``capacity_bytes``,
        ``ring_bytes``, ``staging_slots`` or ``staging_blocks`` not a positive integer, ``specs``
        that are not :class:`KVCacheTensorSpec`, an unknown ``path``, caches on several
        devices, a capacity that holds no block, or page-locked memory (the mirror, or the
        disk tier's staging buffers) beyond what this machine has available; ``groups`` that
        is not a non-empty mapping of non-empty lists of regions, or given with ``disk_dir``; a
        ``host_buffer`` that is not a contiguous CPU uint8 tensor large enough for the mirror.
    TypeError
        ``disk_dir`` or ``crossover_file`` that is not a path, ``page_cache`` that is not a bool.

    Notes
    -----
    One thread drives an engine: the calls are not safe to make concurrently. An engine dropped
    without :meth:`close` frees its mirror as any tensor; a disk tier's I/O thread and file are
    released once the engine is garbage collected (close it to know when). An engine still open
    when the interpreter exits normally is closed then, so every transfer in flight completes
    before the process ends, and it leaves nothing on disk or in ``/dev/shm``. Ids are 1-D: a list
    or tuple of ints, an int32/int64 numpy array, or an int32/int64 tensor on the CPU or the
    engine's device; anything else (floats, booleans, other integer dtypes, 2-D ids, meta
    tensors) is refused with ``ValueError`` naming the argument, before any byte moves.
    Host ids are checked on the host (numpy). GPU ids are never read by the host: the transfer
    copies them on its own stream after the caller's current stream, and the kernel skips and
    counts a pair with an invalid id (:func:`kv_ops.error_count`); only the kernel path (what
    ``auto`` picks for them) and, for ``gpu_ids``, the staged path take them.

    Examples
    --------
    >>> with OffloadEngine(kv_caches, num_blocks, capacity_bytes=64 << 30) as engine:  # 64 GiB
    ...     tid = engine.store(gpu_ids=[3, 4, 9], host_ids=[0, 1, 2])
    ...     engine.poll().stores          # [tid] once the copy has finished
    """

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        num_blocks: int,
        capacity_bytes: int,
        specs: Sequence[KVCacheTensorSpec] | None = None,
        disk_dir: str | None = None,
        disk_tag: str | None = None,
        page_cache: bool = False,
        staging_slots: int = 2,
        staging_blocks: int = 64,
        path: str = "auto",
        ring_bytes: int = RING_BYTES,
        crossover_file: str | None = None,
        groups: Mapping[Hashable, Sequence] | None = None,
        host_buffer: torch.Tensor | None = None,
    ):
        check_kv_caches("OffloadEngine", kv_caches)
        num_blocks = positive_int("OffloadEngine", "num_blocks", num_blocks)
        if path not in PATHS:
            raise ValueError(f"OffloadEngine: path must be one of {', '.join(map(repr, PATHS))}, got {path!r}")
        for what, value in (
            ("capacity_bytes", capacity_bytes),
            ("ring_bytes", ring_bytes),
            ("staging_slots", staging_slots),
            ("staging_blocks", staging_blocks),
        ):
            positive_int("OffloadEngine", what, value)
        for what, value in (("disk_dir", disk_dir), ("crossover_file", crossover_file)):
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise TypeError(
                    f"OffloadEngine: {what} must be a path (str or os.PathLike), got {type(value).__name__}"
                )
        if not isinstance(page_cache, (bool, np.bool_)):  # "no" would read as True
            raise TypeError(f"OffloadEngine: page_cache must be True or False, got {page_cache!r}")
        devices = {t.device for t in kv_caches.values()}
        if len(devices) != 1:
            raise ValueError(f"OffloadEngine: the KV caches must sit on one device, got {sorted(map(str, devices))}")
        (self.device,) = devices
        self.regions = regions_of("OffloadEngine", kv_caches, num_blocks, specs)
        self.num_blocks = num_blocks
        self.cache_names = list(kv_caches)  # the layers, in the caller's order
        self.block_bytes = block_bytes(self.regions)
        if groups is not None and disk_dir is not None:
            raise ValueError(
                "OffloadEngine: groups needs the host mirror, but disk_dir was given: the disk tier reads and "
                "writes whole 4 KiB-aligned file slots, so one group's bytes cannot move alone there"
            )
        # Per group, the (region name, bytes of its block) it moves; one group of every region
        # whole (key None) without groups.
        if groups is None:
            self.groups = {None: tuple((name, r.shape[1]) for name, r in self.regions.items())}
        else:
            self.groups = resolve_groups("OffloadEngine", groups, self.regions)
        self.group_bytes = {key: sum(width for _, width in entries) for key, entries in self.groups.items()}
        slot_bytes = aligned(self.block_bytes) if disk_dir is not None else self.block_bytes
        self.num_host_blocks = int(capacity_bytes) // slot_bytes
        if self.num_host_blocks < 1:
            raise ValueError(f"OffloadEngine: capacity_bytes {capacity_bytes} holds no block of {slot_bytes} bytes")
        # Page-locked memory cannot be swapped: more than the machine has is refused here, naming
        # the bytes, rather than as an ENOMEM from mmap or the driver.
        if host_buffer is not None:
            check_host_buffer(host_buffer, self.num_host_blocks * self.block_bytes, disk_dir)
        elif disk_dir is None:
            check_host_bytes("OffloadEngine", "capacity_bytes", self.num_host_blocks * self.block_bytes)
        else:
            check_host_bytes(
                "OffloadEngine",
                "staging_slots x staging_blocks (the disk tier's staging buffers)",
                int(staging_slots) * int(staging_blocks) * slot_bytes,
            )
        self._streams = low_priority_streams(self.device) if self.device.type == "cuda" else None
        self.path = path
        # The paths' completion events, reused once reported (a path gives its own back).
        self._events = {d: Events() for d in Direction}
        self._lanes = {d: _Lane(d) for d in Direction}
        self._ready_event = None
        if self._streams is not None:
            # Recorded once here, so that it exists: each call then records it with one driver call.
            self._ready_event = torch.cuda.Event()
            self._ready_event.record(self._streams[Direction.STORE])
        # Per direction, the path and completion event of the last transfer (see _transfer).
        self._last: dict[Direction, tuple[object, torch.cuda.Event | None]] = {}
        self._next_tid = 0  # taken only by a call that enqueued its transfer
        self._closed = False
        self._on_close: list = []  # see on_close()
        self.mirror: torch.Tensor | None = None
        self.mirror_regions: dict[str, torch.Tensor] | None = None
        self.disk: DiskTier | None = None  # the disk tier's file and I/O thread, for whoever inspects them
        self.paths: dict[str, TransferPath] = {}
        self._registration = None  # of an adopted host_buffer
        # Per group (None without groups): its paths and auto's measurement of its shape.
        self._routes: dict[Hashable, tuple[dict[str, TransferPath], crossover_mod.Crossover | None]] = {}
        if disk_dir is None:
            if host_buffer is None:
                self.mirror = pinned_empty((self.num_host_blocks, self.block_bytes))
            else:
                # Adopted, never freed here: registered for the GPU (unless page-locked already)
                # and unregistered on close.
                self._registration = register_host("OffloadEngine", host_buffer)
                self.mirror = host_buffer.view(-1)[: self.num_host_blocks * self.block_bytes].view(
                    self.num_host_blocks, self.block_bytes
                )
            # Each region's columns of the mirror, by the region's name.
            self.mirror_regions = dict(
                zip(self.regions, mirror_views(self.mirror, [r.shape[1] for r in self.regions.values()]))
            )
            # Groups with the same entries share one set of paths (vLLM's groups often overlay
            # the same tensors), and groups of the same widths one measurement.
            shapes = list(dict.fromkeys(self.groups.values()))
            crossovers: dict[tuple, crossover_mod.Crossover] = {}
            if self.device.type == "cuda" and path == "auto":
                # First: the measurement's scratch rings are then back in torch's cache when the
                # engine's own are allocated below.
                widths = list(dict.fromkeys(tuple(w for _, w in entries) for entries in shapes))
                for i, shape in enumerate(widths):
                    found = crossover_mod.crossover(
                        self.device, list(shape), ring_bytes, crossover_file_of(crossover_file, i)
                    )
                    found.plan_picks(COPY_ENGINES)  # not at the first call of each size
                    crossovers[shape] = found
            # Only the paths this engine may pick: on the GPU each binds its kernels now, and the
            # staged one allocates its ring (2 x ring_bytes), so that memory is taken at start;
            # every group's staged path shares the first one's ring.
            names = PATH_NAMES if path == "auto" else (path,)
            made: dict[tuple, tuple[dict[str, TransferPath], crossover_mod.Crossover | None]] = {}
            for entries in shapes:
                gpu = [self.regions[name][:, :width] for name, width in entries]
                host = [self.mirror_regions[name][:, :width] for name, width in entries]
                first = next(iter(made.values()), ({}, None))[0].get("staged")
                paths = make_paths(gpu, self.mirror, self._streams, ring_bytes, names, self._events, host, first)
                made[entries] = (paths, crossovers.get(tuple(w for _, w in entries)))
            self._routes = {key: made[entries] for key, entries in self.groups.items()}
            self.paths = next(iter(self._routes.values()))[0]
        else:
            tag = disk_tag or f"{self.device.type}{self.device.index or 0}"
            # Held only by this engine: once it is collected, so is the path, whose finalizer
            # then stops the I/O thread and closes the file.
            disk = DiskPath(
                self.regions,
                disk_dir,
                tag,
                self.block_bytes,
                self.num_host_blocks,
                page_cache,
                self._streams,
                int(staging_slots),
                int(staging_blocks),
            )
            self.paths = {disk.name: disk}
            self.path = disk.name  # every transfer takes it
            self.disk = disk.tier
            self._routes = {None: (self.paths, None)}
        # Transfers per path, for whoever tunes this: every mirror path (0 where it cannot be
        # picked), and the disk tier on a disk engine.
        self.path_counts = dict.fromkeys((*PATH_NAMES, *self.paths), 0)
        self._exit_key = next(_created)
        _open[self._exit_key] = self  # closed at exit unless closed before (see _close_at_exit)

    @property
    def crossover(self) -> crossover_mod.Crossover | None:
        """What ``auto`` measured for this engine's shape (the first group's, with ``groups``);
        None on a CPU engine or another ``path``. Assigning one makes every group pick by it."""
        routes = iter(self._routes.values())
        return next(routes, (None, None))[1]

    @crossover.setter
    def crossover(self, measured: crossover_mod.Crossover | None) -> None:
        self._routes = {key: (paths, measured) for key, (paths, _) in self._routes.items()}

    # --- the interface LayerwiseLoads builds on ----------------------------------------------
    # A mechanism that moves a load its own way (kv_ops.LayerwiseLoads) is one more path: it is
    # issued through load_through, on the engine's load stream, with the engine's completion
    # events, so it is ordered, counted and reported with every other load.

    def check_open(self, op: str) -> None:
        """Raise :class:`ClosedError` naming ``op``, the public call the user made (an engine's
        method, or what is built on the engine), once the engine is closed."""
        if self._closed:
            raise ClosedError(f"{op}: the engine is closed (close() was called); create a new engine")

    @property
    def load_stream(self) -> torch.cuda.Stream | None:
        """The engine's low-priority load copy stream (None on a CPU engine). Copies issued on it
        land in issue order with the engine's other loads."""
        return None if self._streams is None else self._streams[Direction.LOAD]

    @property
    def load_events(self) -> Events:
        """Where a load path takes its completion events from; the engine gives each back there
        (through the path's ``reported``) once the transfer is reported."""
        return self._events[Direction.LOAD]

    def load_through(self, path, host_ids, gpu_ids, after=None, *, op: str, instead: str) -> int:
        """One load issued on ``path`` and tracked as :meth:`load` tracks its own: the ids checked
        and taken in as :meth:`load` documents, ordered after ``after``, enqueued on ``path``
        (:class:`~kv_ops.transfer.paths.TransferPath`), reported by :meth:`poll` and counted in
        ``path_counts[path.name]`` (a key the caller adds once). ``path`` may instead be a function
        of the checked :class:`~kv_ops.transfer.blocks.Blocks` that returns the path, for a caller
        that picks its mechanism by the ids: a pick that differs from the last load's path is
        ordered after that load, as every change of path is. ``op`` names the caller in errors and
        ``instead`` is the advice given when a CUDA-graph capture is refused. Returns the
        transfer id."""
        return self._transfer(Direction.LOAD, gpu_ids, host_ids, after, path=path, op=op, instead=instead)

    # --- transfers ---------------------------------------------------------------------------

    def on_close(self, callback) -> None:
        """Call ``callback()`` at :meth:`close`, before the mirror goes: for what copies these
        blocks outside the engine (:class:`kv_ops.StepTransfers` drops what it has staged)."""
        self._on_close.append(callback)

    def order_after_transfers(self, stream: torch.cuda.Stream) -> None:
        """Make ``stream`` wait for every transfer issued so far: for copies of these blocks
        that do not go through the engine (:class:`kv_ops.StepTransfers`). Transfers of one
        direction complete in issue order (see :meth:`_transfer`), so the last one's event
        covers the others."""
        for direction, (_, done) in self._last.items():
            if not self._lanes[direction].pending:
                continue  # every transfer of this direction has been reported: nothing to wait for
            if isinstance(done, torch.cuda.Event):
                stream.wait_event(done)
            elif done is not None:  # the disk tier's completion: never on a mirror engine
                raise ValueError("OffloadEngine.order_after_transfers: a disk-tier transfer has no stream event")

    def _ready(self, op: str, after, fresh: bool) -> torch.cuda.Event | None:
        """The event the transfer waits for: ``after`` itself, or recorded now on ``after`` (a
        stream) or on the caller's current stream. Nothing blocks the caller's thread.

        The paths wait on it before this call returns, so one event serves every call: a wait
        holds the record before it, whatever is recorded afterwards. A path that waits later
        (``fresh_ready``: the disk tier, on its I/O thread) gets a ``fresh`` event of its own.
        """
        if self._streams is None:
            if after is not None:
                raise ValueError(f"{op}: after= orders GPU work; this engine's cache is on {self.device}")
            return None
        if isinstance(after, torch.cuda.Event):
            return after
        if after is None:
            if not fresh:  # the common case, in one driver call: no Stream object is made
                with driver_context(self.device):
                    record_event(self._ready_event, current_stream_handle(self.device.index))
                return self._ready_event
            stream = torch.cuda.current_stream(self.device)  # _transfer refused it if capturing
        elif not isinstance(after, torch.cuda.Stream):
            raise ValueError(
                f"{op}: after must be a torch.cuda.Event, a torch.cuda.Stream or None, got {type(after).__name__}"
            )
        elif after.device != self.device:
            raise ValueError(f"{op}: after is a stream of {after.device}, but the engine's cache is on {self.device}")
        else:
            # Waiting on an event recorded there would pull the engine's streams into the capture:
            # the copy would run at the graph's replays, not now, with none of this call's bookkeeping.
            refuse_capture(
                op,
                "after is a stream being captured into a CUDA graph",
                "order the transfer after the captured work once the graph is replayed (record an event after the replay)",
                stream=after,
            )
            stream = after
        ready = torch.cuda.Event() if fresh else self._ready_event
        ready.record(stream)
        return ready

    def _pick(self, blocks: Blocks, paths: dict[str, TransferPath], measured) -> TransferPath:
        name = self.path
        if name == "auto":
            name = None
            if not blocks.on_host:
                name = "kernel"  # the one path whose kernel reads both sides' ids
            elif measured is not None:
                # The runs are counted only where the pick depends on them.
                name = measured.pick(
                    blocks.direction, blocks.count, lambda: blocks.num_runs, COPY_ENGINES, self._alone()
                )
            name = name or "kernel"  # nothing measured (a CPU engine): the reference copy
        return paths[name]

    def _alone(self) -> bool:
        """Whether no transfer of this engine is in flight, in either direction: a call's host time
        is then all on its critical path, and auto picks by the single-call rates
        (:mod:`kv_ops.transfer.crossover`). Transfers of a direction complete in issue order, so
        its last one tells; a query only where some transfer is still unreported."""
        for direction, (_, done) in self._last.items():
            if done is not None and self._lanes[direction].pending and not done.query():
                return False
        return True

    def _refuse_gpu_ids(self, op: str, blocks: Blocks, path: TransferPath) -> None:
        """GPU ids are never read by the host (that would wait for the caller's stream): only a
        path whose kernel reads them takes them."""
        for what, ids in (("gpu_ids", blocks.gpu_ids), ("host_ids", blocks.host_ids)):
            if what in path.host_planned and not isinstance(ids, np.ndarray):
                raise ValueError(
                    f"{op}: {what} is a {ids.device} tensor, but {path.label} plans its copies on the host, which "
                    "would have to wait for the GPU to read it; pass host ids (a list, an array or a CPU tensor)"
                )

    def _transfer(
        self,
        direction: Direction,
        gpu_ids,
        host_ids,
        after,
        path=None,
        op: str | None = None,
        instead: str = "capture kv_ops.copy_blocks instead",
        group=None,
    ) -> int:
        """One store or load: ids checked, ordered after ``after``, enqueued on ``path`` (picked
        here among ``group``'s paths unless given), tracked in its lane. :meth:`load_through`
        passes a path, and its caller's name (``op``) and advice (``instead``) for the errors."""
        kind = direction.value
        op = op or f"OffloadEngine.{kind}"
        self.check_open(op)
        if path is None:
            try:
                route = self._routes[group]
            except (KeyError, TypeError):  # TypeError: an unhashable group
                raise ValueError(self._bad_group(op, group)) from None
        load = direction is Direction.LOAD
        # Destinations must not repeat (which copy would win is undefined); sources may.
        gpu = ids_mod.take(op, "gpu_ids", gpu_ids, self.num_blocks, load, self.device)
        host = ids_mod.take(op, "host_ids", host_ids, self.num_host_blocks, not load, self.device)
        if len(gpu) != len(host):
            raise ValueError(f"{op}: {len(gpu)} gpu_ids but {len(host)} host_ids")
        blocks = Blocks(direction, gpu, host)
        if self._streams is not None:
            # A replay would repeat the copy with none of this call's bookkeeping (transfer id,
            # completion event, the ids' staging memory). Graphs capture kv_ops.copy_blocks.
            # Before the pick: auto's asks whether a transfer is still in flight (an event
            # query), which a capture forbids and would be invalidated by.
            refuse_capture(
                op,
                "a transfer cannot be captured into a CUDA graph",
                instead,
            )
        if path is None:
            path = self._pick(blocks, *route)
        elif callable(path):  # load_through's pick by the ids
            path = path(blocks)
        on_host = blocks.on_host
        if not on_host:
            self._refuse_gpu_ids(op, blocks, path)
        ready = self._ready(op, after, fresh=path.fresh_ready)
        if not on_host:
            # The path copies the GPU ids on its own stream: after the caller's stream wrote them.
            blocks.ids_ready = ready if after is None else self._ready(op, None, fresh=True)
        last = self._last.get(direction)
        if last is not None and last[0] is not path and last[1] is not None:
            # Transfers of one direction land in issue order whatever their paths: a staged load
            # ends on the path's own kernel stream, and a later kernel or DMA load (which run
            # on the copy stream) into the same blocks must not overtake it.
            self._streams[direction].wait_event(last[1])
        done = path.enqueue(blocks, ready)
        tid = self._next_tid
        self._next_tid += 1
        self._last[direction] = (path, done)
        # GPU ids live until their transfer has read them (the caller may drop them at once).
        self._lanes[direction].add(tid, path, done, keep=None if on_host else (gpu, host))
        self.path_counts[path.name] += 1
        return tid

    def _bad_group(self, op: str, group) -> str:
        if None in self._routes:
            return f"{op}: group={group!r}, but this engine was made without groups: leave group out"
        known = ", ".join(map(repr, self._routes))
        return f"{op}: group={group!r} is not one of this engine's groups ({known})"

    def store(self, gpu_ids, host_ids, after=None, group=None) -> int:
        """Copy GPU blocks ``gpu_ids[i]`` to host blocks ``host_ids[i]``.

        The copy is ordered after ``after``, by default the work enqueued on the caller's current
        stream before the call (the compute that wrote those blocks). Nothing blocks the
        caller's thread.

        Write to the GPU blocks again only after this store is reported by :meth:`poll` or
        :meth:`flush`: until then, what the stored copy holds of a block written meanwhile is
        undefined. (On the CPU the in-memory engine copies during the call and the disk tier
        later, on its I/O thread: code that writes early works with one and not the other.)

        Parameters
        ----------
        gpu_ids : sequence of int, or 1-D int32/int64 numpy array or tensor
            Source blocks in ``[0, num_blocks)``; may repeat.
        host_ids : sequence of int, or 1-D int32/int64 numpy array or tensor
            Destination host blocks (disk-tier slots) in ``[0, num_host_blocks)``; distinct, as
            many as ``gpu_ids``.
        after : torch.cuda.Event or torch.cuda.Stream, optional
            Order the copy after this event, or after the work enqueued on this stream so far,
            instead of after the caller's current stream. Not a stream being captured, nor an
            event recorded during a capture (a graph's work happens at its replays).
        group : optional
            On an engine made with ``groups``, the group whose blocks these are (required there):
            only its regions' bytes move, on both sides. Left out on an engine without groups.

        Returns
        -------
        int
            The transfer id, reported once by :meth:`poll`, :meth:`flush` or :meth:`close`.

        Raises
        ------
        ValueError
            Bad ids (not 1-D, not int32/int64, meta; host ids out of range, a repeated
            destination, a length mismatch), before any byte moves and without using up a
            transfer id; GPU ids given to a path or tier that plans on the host (``dma``, the
            disk tier, ``host_ids`` on ``staged``); a bad ``after``; a ``group`` that is not one
            of the engine's.
        RuntimeError
            While the current stream or ``after`` is being captured into a CUDA graph.
        ClosedError
            After :meth:`close`.
        """
        return self._transfer(Direction.STORE, gpu_ids, host_ids, after, group=group)

    def load(self, host_ids, gpu_ids, after=None, group=None) -> int:
        """Copy host blocks ``host_ids[i]`` to GPU blocks ``gpu_ids[i]``.

        The copy into the GPU blocks is ordered after ``after``, by default the work enqueued on
        the caller's current stream before the call (every reader of the destination blocks).
        A load issued while a forward is queued would then wait for the whole forward; to
        overlap with it, record an event after the last reader of these blocks and pass it.
        Make the consumer wait for the load with :meth:`poll` before it reads the loaded blocks.

        Parameters
        ----------
        host_ids : sequence of int, or 1-D int32/int64 numpy array or tensor
            Source host blocks (disk-tier slots) in ``[0, num_host_blocks)``; may repeat.
        gpu_ids : sequence of int, or 1-D int32/int64 numpy array or tensor
            Destination blocks in ``[0, num_blocks)``; distinct, as many as ``host_ids``.
        after : torch.cuda.Event or torch.cuda.Stream, optional
            Order the copy after this event, or after the work enqueued on this stream so far,
            instead of after the caller's current stream. Not a stream being captured, nor an
            event recorded during a capture (a graph's work happens at its replays).
        group : optional
            On an engine made with ``groups``, the group whose blocks these are (required there):
            only its regions' bytes move, on both sides. Left out on an engine without groups.

        Returns
        -------
        int
            The transfer id, reported once by :meth:`poll`, :meth:`flush` or :meth:`close`.

        Raises
        ------
        ValueError
            Bad ids (not 1-D, not int32/int64, meta; host ids out of range, a repeated
            destination, a length mismatch), before any byte moves and without using up a
            transfer id; GPU ids given to a path or tier that plans on the host (``dma``, the
            disk tier, ``host_ids`` on ``staged``); a bad ``after``; a ``group`` that is not one
            of the engine's.
        RuntimeError
            While the current stream or ``after`` is being captured into a CUDA graph.
        ClosedError
            After :meth:`close`.
        """
        return self._transfer(Direction.LOAD, gpu_ids, host_ids, after, group=group)

    # --- completion --------------------------------------------------------------------------

    def _collect(self, wait: bool) -> Completed:
        out = Completed()
        self._lanes[Direction.STORE].poll(out, out.stores, wait)
        self._lanes[Direction.LOAD].poll(out, out.loads, wait)
        return out

    def poll(self) -> Completed:
        """Transfers finished (or failed) since the last poll or flush; never blocks, never early.

        Returns
        -------
        Completed
            Per direction, in issue order, the ids whose copies have finished, each reported
            once; ``failed`` holds the ids that ended in an error.

        Raises
        ------
        ClosedError
            After :meth:`close`.
        """
        self.check_open("OffloadEngine.poll")
        return self._collect(wait=False)

    def flush(self) -> Completed:
        """Wait for every transfer in flight (before reusing GPU blocks after a preemption).

        Returns
        -------
        Completed
            Every transfer not reported before, all of them finished or failed.

        Raises
        ------
        ClosedError
            After :meth:`close`.
        """
        self.check_open("OffloadEngine.flush")
        return self._collect(wait=True)

    def completion_event(self, tid: int) -> torch.cuda.Event | None:
        """The event transfer ``tid`` records on the GPU once its copy has finished, while ``poll``
        has not reported it; None once reported, for a copy complete when issued, on a CPU engine
        or the disk tier. The engine reuses the event after reporting ``tid``: wait on it
        (``Stream.wait_event``) right away rather than keep it. The transfer just issued is
        found first (the last of its lane)."""
        lanes = self._lanes.values()
        last = (lane.pending[-1] for lane in lanes if lane.pending)
        for pending_tid, _, done, _ in itertools.chain(last, *(lane.pending for lane in lanes)):
            if pending_tid == tid:
                return done if isinstance(done, torch.cuda.Event) else None
        return None

    def close(self) -> Completed:
        """Finish every transfer in flight, then free the mirror or close the disk tier.

        First waits as :meth:`flush` does: every store and load issued so far has completed
        (or failed) on the GPU, the I/O thread and the file. Then it stops the disk tier's I/O
        thread, closes its file (which frees the file's space: it has no name) and drops the
        engine's references to the mirror and the staging buffers. A second call does nothing;
        every other call afterwards raises :class:`ClosedError`.

        Returns
        -------
        Completed
            The transfers not reported before (empty on a second call), so that every transfer
            id is reported exactly once.
        """
        if self._closed:
            return Completed()
        self._closed = True  # from here on every call is refused, even if the wait below fails
        _open.pop(self._exit_key, None)
        for drop in self._on_close:
            drop()
        try:
            return self._collect(wait=True)
        finally:
            self._release()

    def _release(self) -> None:
        self.disk = None
        try:
            every = {id(p): p for paths, _ in self._routes.values() for p in paths.values()}
            for path in every.values():
                path.close()  # the staged path's own streams; the disk tier's thread and file
            if self._streams is not None:
                # Idle after a completed flush; after an interrupted one this keeps the copies
                # from outliving the memory they use.
                for stream in self._streams.values():
                    stream.synchronize()
        finally:
            self.mirror = self.mirror_regions = None
            self.paths, self._routes, self._last = {}, {}, {}
            if self._registration is not None:  # the copies that used it are done (above)
                self._registration.release()
                self._registration = None
            self._lanes = {d: _Lane(d) for d in Direction}

    def __enter__(self) -> "OffloadEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_engine(owner: str, engine) -> None:
    """What an object built on an engine checks first: a ``TypeError`` naming ``owner`` unless
    ``engine`` is an :class:`OffloadEngine`, and :class:`ClosedError` once it is closed."""
    if not isinstance(engine, OffloadEngine):
        raise TypeError(f"{owner}: engine must be a kv_ops.OffloadEngine, got {type(engine).__name__}")
    engine.check_open(owner)


# The engines not closed yet, by creation order. Weak: an engine dropped without close() is still
# collected (the disk tier's finalizer then stops its thread and closes its file).
_open: weakref.WeakValueDictionary[int, OffloadEngine] = weakref.WeakValueDictionary()
_created = itertools.count()


@atexit.register
def _close_at_exit() -> None:
    """Close every engine still open, newest first, as :meth:`OffloadEngine.close` does: what is in
    flight completes, then the engine lets go of its thread, file, events and host memory.

    Why: at interpreter exit, Python ends a daemon thread that tries to take the GIL back by
    unwinding it (``pthread_exit``). The disk tier's I/O thread spends its jobs in torch calls (a
    gather or a scatter, which give the GIL up while they copy), and unwinding out of one runs
    through a ``noexcept`` C++ destructor, so the C++ runtime aborts the whole process. atexit
    handlers run before that, while the interpreter, torch and CUDA are all still whole, so the
    thread can finish its queue and return, and every CUDA event, graph and page-locked buffer an
    engine holds is released before CUDA itself is torn down rather than at some step of module
    teardown. A non-daemon thread would not do: it waits on its queue for the next job, and the
    interpreter joins such threads before any atexit handler runs, so exit would hang instead.

    Newest first, as ``with`` blocks unwind: an engine made later may rest on one made earlier.
    Every engine is closed even if closing another one raises (the error is reported after).
    """
    with contextlib.ExitStack() as stack:
        for _, engine in sorted(_open.items(), key=lambda item: item[0]):
            stack.callback(engine.close)


class AllRanks:
    """Combines per-rank completion reports: a transfer counts as done once every rank reported it.

    With one engine per rank (tensor parallelism), transfer ``t`` of a step is the same logical
    store on every rank, but each rank finishes its own part at its own time. Feed each poll's
    reports of all ranks to :meth:`add` (or let :meth:`gather` all-gather them through
    ``torch.distributed``); what comes back is done everywhere, so the scheduler may free the
    GPU blocks or count the host copy as complete.

    Examples
    --------
    >>> combined = AllRanks(dist.get_world_size())
    >>> done = combined.gather(engine.poll())   # the same answer on every rank
    """

    def __init__(self, world_size: int):
        self.world_size = positive_int("AllRanks", "world_size", world_size)
        self._seen: dict[tuple[str, int], int] = {}

    def add(self, reports: Sequence[Completed]) -> Completed:
        """Count reports (each rank reports a transfer once, as ``poll`` does); return what is now
        done on every rank, sorted."""
        out = Completed()
        for report in reports:
            out.failed.update(report.failed)  # failed on any rank: failed
            for kind, ids in (("store", report.stores), ("load", report.loads)):
                for tid in ids:
                    key = (kind, tid)
                    self._seen[key] = self._seen.get(key, 0) + 1
                    if self._seen[key] == self.world_size:
                        del self._seen[key]
                        (out.stores if kind == "store" else out.loads).append(tid)
        out.stores.sort()
        out.loads.sort()
        return out

    def gather(self, local: Completed, group=None) -> Completed:
        """All-gather this rank's report with every other rank's, then :meth:`add` them all."""
        import torch.distributed as dist

        reports: list[Completed | None] = [None] * self.world_size
        dist.all_gather_object(reports, local, group=group)
        return self.add(reports)


__all__ = ["OffloadEngine", "Completed", "AllRanks", "ClosedError", "EngineClosedError", "check_engine"]
