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
import weakref
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import replace

import torch

from ..cuda.capture import refuse_capture
from ..geometry import KVCacheTensorSpec, block_bytes, regions_of
from . import crossover as crossover_mod
from . import ids as ids_mod
from .blocks import Blocks, Direction, Events, low_priority_streams, mirror_views
from .closed import ClosedError, EngineClosedError
from .completion import Completed, Lane, collect, order_after, pending_event
from .disk import DiskTier
from .engine_arguments import PATHS as PATHS  # kv_ops.transfer.engine.PATHS, as before
from .engine_arguments import check_counts, check_files_and_device, disk_fits, host_blocks
from .groups import engine_groups
from .ordering import Ordering
from .paths import PATH_NAMES
from .routes import Route, bad_group, disk_path, host_mirror, mirror_routes, pick, refuse_gpu_ids
from .sides import LOAD_DOC, STORE_DOC, Side, engine_sides

# GPU memory of each direction's staging ring, by default (the staged path's chunks pipeline
# through it; a ring never holds more rows than one transfer can have).
RING_BYTES = 128 << 20


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
        :class:`kv_ops.transfer.block_file.BlockFile`, :class:`DiskTier` and :class:`DiskPath`.
    disk_tag : str, optional
        Names this rank's or device's file; ``"<device>"`` (e.g. ``cuda0``) by default. Only with ``disk_dir``.
    page_cache : bool
        Buffered file I/O instead of ``O_DIRECT``. Only with ``disk_dir``.
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
        that are not :class:`KVCacheTensorSpec` or are empty, an unknown ``path``, caches on several
        devices, a capacity that holds no block, or page-locked memory (the mirror, or the
        disk tier's staging buffers) beyond what this machine has available; ``groups`` that
        is not a non-empty mapping of non-empty lists of regions, or given with ``disk_dir``; a
        ``host_buffer`` that is not a contiguous CPU uint8 tensor large enough for the mirror; a
        ``disk_dir`` that is empty, missing or not a directory, a ``disk_tag`` that is not a
        non-empty string fit for a file name (no ``/``, no NUL) or given without ``disk_dir``, a
        ``crossover_file`` that is a directory or in no directory that exists, or a ``capacity_bytes`` whose
        file the disk cannot hold (out of space, too large a file, over quota); ``disk_dir`` or
        ``crossover_file`` that is not a path, ``page_cache`` that is not a bool, or True without ``disk_dir``.

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
        # Checked, each by its public name, before anything is allocated.
        num_blocks = check_counts(
            kv_caches, num_blocks, path, capacity_bytes, ring_bytes, staging_slots, staging_blocks
        )
        self.device = check_files_and_device(kv_caches, disk_dir, disk_tag, crossover_file, page_cache)
        self._layout(kv_caches, num_blocks, specs, groups, disk_dir)
        self.num_host_blocks = host_blocks(
            capacity_bytes, self.block_bytes, disk_dir, host_buffer, staging_slots, staging_blocks
        )
        self._bookkeeping(path)
        if disk_dir is None:
            self._mirror(host_buffer, path, ring_bytes, crossover_file)
        else:
            with disk_fits(capacity_bytes, disk_dir):
                self._disk(disk_dir, disk_tag, page_cache, staging_slots, staging_blocks)
        # Transfers per path, for whoever tunes this: every mirror path (0 where it cannot be
        # picked), and the disk tier on a disk engine.
        self.path_counts = dict.fromkeys((*PATH_NAMES, *self.paths), 0)
        self._exit_key = next(_created)
        _open[self._exit_key] = self  # closed at exit unless closed before (see _close_at_exit)

    # --- the builders __init__ calls, in order --------------------------------------------------

    def _layout(self, kv_caches, num_blocks: int, specs, groups, disk_dir) -> None:
        """The caches as regions, and per group the (region name, bytes of its block) it moves."""
        self.num_blocks = num_blocks
        self.regions = regions_of("OffloadEngine", kv_caches, self.num_blocks, specs)
        self.cache_names = list(kv_caches)  # the layers, in the caller's order
        # Their tensors' addresses, in that order (two names may share one tensor): what a step
        # op that must be handed the very caches compares.
        self.cache_addresses = tuple(t.data_ptr() for t in kv_caches.values())
        self.block_bytes = block_bytes(self.regions)
        self.groups = engine_groups(groups, self.regions, disk_dir)
        self.group_bytes = {key: sum(width for _, width in entries) for key, entries in self.groups.items()}

    def _bookkeeping(self, path: str) -> None:
        """Streams, events, lanes and the state every call reads, before any path is made."""
        self._streams = low_priority_streams(self.device) if self.device.type == "cuda" else None
        self.path = path
        # The paths' completion events, reused once reported (a path gives its own back).
        self._events = {d: Events() for d in Direction}
        self._lanes = {d: Lane(d) for d in Direction}
        self._ordering = Ordering(self.device, self._streams)
        self._store_side, self._load_side = engine_sides(self._lanes)
        self._next_tid = 0  # taken only by a call that enqueued its transfer
        self._closed = False
        self._on_close: list = []  # see on_close()

    def _mirror(self, host_buffer, path: str, ring_bytes: int, crossover_file) -> None:
        """The host mirror, allocated or adopted (``_registration``, released on close), its
        columns by region, and per group (None without groups) its paths and auto's measurement."""
        self.disk: DiskTier | None = None  # the disk tier's file and I/O thread, for whoever inspects them
        self.mirror, self._registration = host_mirror(host_buffer, self.num_host_blocks, self.block_bytes)
        widths = [r.shape[1] for r in self.regions.values()]
        self.mirror_regions = dict(zip(self.regions, mirror_views(self.mirror, widths)))
        self._routes: dict[Hashable, Route] = mirror_routes(
            self, self._streams, self._events, path, ring_bytes, crossover_file
        )
        self.paths = next(iter(self._routes.values()))[0]

    def _disk(self, disk_dir, disk_tag, page_cache, staging_slots, staging_blocks) -> None:
        """The disk tier, the only path of a ``disk_dir`` engine."""
        self.mirror = self.mirror_regions = self._registration = None
        disk = disk_path(self, self._streams, disk_dir, disk_tag, page_cache, staging_slots, staging_blocks)
        self.paths = {disk.name: disk}
        self.path = disk.name  # every transfer takes it
        self.disk = disk.tier
        self._routes = {None: (self.paths, None)}

    @property
    def crossover(self) -> crossover_mod.Crossover | None:
        """What ``auto`` measured for this engine's shape (the first group's, with ``groups``);
        None on a CPU engine or another ``path``. Assigning one makes every group pick by it."""
        routes = iter(self._routes.values())
        return next(routes, (None, None))[1]

    @crossover.setter
    def crossover(self, measured: crossover_mod.Crossover | None) -> None:
        self._routes = {key: (paths, measured) for key, (paths, _) in self._routes.items()}

    # --- the interface of what is built on an engine (LayerwiseLoads, StepTransfers, adapters) ---
    # A mechanism that moves a load its own way is one more path: issued through load_through, it
    # is ordered, counted and reported with every other load.

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

    def load_side(self, op: str, instead: str) -> Side:
        """The load side for a caller of :meth:`load_through`, bound once: its name ``op`` in
        errors, and ``instead``, the advice given when a CUDA-graph capture is refused."""
        return replace(self._load_side, op=op, instead=instead)

    def load_through(self, path, side: Side, host_ids, gpu_ids, after=None) -> int:
        """One load issued on ``path`` and tracked as :meth:`load` tracks its own: the ids checked
        and taken in as :meth:`load` documents, ordered after ``after``, enqueued on ``path``
        (:class:`~kv_ops.transfer.paths.TransferPath`), reported by :meth:`poll` and counted in
        ``path_counts[path.name]`` (a key the caller adds once). ``path`` may instead be a function
        of the checked :class:`~kv_ops.transfer.blocks.Blocks` that returns the path, for a caller
        that picks its mechanism by the ids: a pick that differs from the last load's path is
        ordered after that load, as every change of path is. ``side`` is the caller's
        :meth:`load_side`. Returns the transfer id."""
        return self._transfer(side, gpu_ids, host_ids, after, path=path)

    def on_close(self, callback) -> None:
        """Call ``callback()`` at :meth:`close`, before the mirror goes: for what copies these
        blocks outside the engine (:class:`kv_ops.StepTransfers` drops what it has staged)."""
        self._on_close.append(callback)

    def order_after_transfers(self, stream: torch.cuda.Stream) -> None:
        """Make ``stream`` wait for every transfer issued so far: for copies of these blocks
        that do not go through the engine (:class:`kv_ops.StepTransfers`). Transfers of one
        direction complete in issue order (see :meth:`_transfer`), so the last one's event
        covers the others."""
        order_after(self._lanes.values(), stream)

    def completion_event(self, tid: int) -> torch.cuda.Event | None:
        """The event transfer ``tid`` records on the GPU once its copy has finished, while ``poll``
        has not reported it; None once reported, for a copy complete when issued, on a CPU engine
        or the disk tier. The engine reuses the event after reporting ``tid``: wait on it
        (``Stream.wait_event``) right away rather than keep it. The transfer just issued is
        found first (the last of its lane)."""
        return pending_event(self._lanes.values(), tid)

    # --- transfers ---------------------------------------------------------------------------

    def _transfer(self, side: Side, gpu_ids, host_ids, after, group=None, path=None) -> int:
        """One store or load: ids checked, ordered after ``after``, enqueued on ``path`` (picked
        here among ``group``'s paths unless given), tracked in ``side``'s lane. :meth:`load_through`
        passes a path, and a side that names its caller and advice in the errors."""
        op = side.op
        self.check_open(op)
        if path is None:
            try:
                route = self._routes[group]
            except (KeyError, TypeError):  # TypeError: an unhashable group
                raise ValueError(bad_group(op, group, self._routes)) from None
        gpu = ids_mod.take(op, "gpu_ids", gpu_ids, self.num_blocks, side.gpu_unique, self.device)
        host = ids_mod.take(op, "host_ids", host_ids, self.num_host_blocks, side.host_unique, self.device)
        if len(gpu) != len(host):
            raise ValueError(f"{op}: {len(gpu)} gpu_ids but {len(host)} host_ids")
        blocks = Blocks(side.direction, gpu, host)
        if self._streams is not None:
            # A replay would repeat the copy with none of this call's bookkeeping (transfer id,
            # completion event, the ids' staging memory). Graphs capture kv_ops.copy_blocks.
            # Before the pick: auto's asks whether a transfer is still in flight (an event
            # query), which a capture forbids and would be invalidated by.
            refuse_capture(op, "a transfer cannot be captured into a CUDA graph", side.instead)
        if path is None:
            path = pick(self.path, blocks, *route, self._lanes)
        elif callable(path):  # load_through's pick by the ids
            path = path(blocks)
        on_host = blocks.on_host
        if not on_host:
            refuse_gpu_ids(op, blocks, path)
        ready = self._ordering.ready(op, after, fresh=path.fresh_ready)
        if not on_host:
            # The path copies the GPU ids on its own stream: after the caller's stream wrote them.
            blocks.ids_ready = ready if after is None else self._ordering.ready(op, None, fresh=True)
        last = side.lane.last
        if last is not None and last[0] is not path and last[1] is not None:
            # Transfers of one direction land in issue order whatever their paths: a staged load
            # ends on the path's own kernel stream, and a later kernel or DMA load (which run
            # on the copy stream) into the same blocks must not overtake it.
            self._streams[side.direction].wait_event(last[1])
        done = path.enqueue(blocks, ready)
        tid = self._next_tid
        self._next_tid += 1
        # GPU ids live until their transfer has read them (the caller may drop them at once).
        side.lane.add(tid, path, done, keep=None if on_host else (gpu, host))
        self.path_counts[path.name] += 1
        return tid

    def store(self, gpu_ids, host_ids, after=None, group=None) -> int:
        return self._transfer(self._store_side, gpu_ids, host_ids, after, group)

    store.__doc__ = STORE_DOC

    def load(self, host_ids, gpu_ids, after=None, group=None) -> int:
        return self._transfer(self._load_side, gpu_ids, host_ids, after, group)

    load.__doc__ = LOAD_DOC

    # --- completion --------------------------------------------------------------------------

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
        return collect(self._lanes, wait=False)

    def flush(self) -> Completed:
        """Wait for every transfer in flight (before reusing GPU blocks after a preemption).

        Returns and raises as :meth:`poll` does, once nothing is in flight: the :class:`Completed`
        holds every transfer not reported before, all of them finished or failed.
        """
        self.check_open("OffloadEngine.flush")
        return collect(self._lanes, wait=True)

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
            return collect(self._lanes, wait=True)
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
            self.paths, self._routes = {}, {}
            if self._registration is not None:  # the copies that used it are done (above)
                self._registration.release()
                self._registration = None
            for lane in self._lanes.values():
                lane.clear()

    def __enter__(self) -> "OffloadEngine":
        self.check_open("OffloadEngine.__enter__")  # a closed engine would fail at its first call inside
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


__all__ = ["OffloadEngine", "Completed", "ClosedError", "EngineClosedError", "check_engine"]
