"""The disk tier: the staged I/O between the regions and its file of block slots, and its engine path."""

from __future__ import annotations

import queue
import threading
import weakref
from collections import deque
from collections.abc import Mapping

import torch

from .. import reference
from ..cuda.host_memory import pinned_empty
from ..ops import gather_blocks, scatter_blocks
from ..validation import id_checks
from .block_file import BlockFile
from .blocks import Blocks, Direction


def _check_running(thread: threading.Thread) -> None:
    if not thread.is_alive():
        raise RuntimeError("kv_ops disk tier: the I/O thread is not running (closed, or it died)")


class DiskJob:
    """One store (regions -> file) or load (file -> regions) of the disk tier, and how it ended.

    It completes as a CUDA event does (``query``, ``synchronize``), so that the engine tracks it
    as it tracks a path's event: once it has left the I/O thread and the last GPU work it
    enqueued has run (the last scatter of a load, or whatever a failed job had enqueued before
    its error). ``error`` is what ended it, None once it moved its bytes.
    """

    def __init__(
        self,
        direction: Direction,
        gpu_ids: torch.Tensor,
        disk_ids: torch.Tensor,
        ready: torch.cuda.Event | None,
        thread: threading.Thread,
    ):
        self.direction = direction
        self.gpu_ids = gpu_ids  # int64, on the host
        self.disk_ids = disk_ids  # int64, on the host
        self.ready = ready  # recorded on the caller's stream at the call
        self.error: BaseException | None = None
        self.event: torch.cuda.Event | None = None
        self._left = threading.Event()  # set by the I/O thread, after error and event
        self._thread = thread

    def finish(self, error: BaseException | None, event: torch.cuda.Event | None) -> None:
        """On the I/O thread: the job is done with, ``error`` ended it, ``event`` follows its GPU work."""
        self.error, self.event = error, event
        self._left.set()

    def query(self) -> bool:
        return self._left.is_set() and (self.event is None or self.event.query())

    def synchronize(self) -> None:
        # Wait in slices so that a thread that died (it catches every job's errors, so only an
        # interpreter shutdown can kill it) is an error rather than a hang.
        while not self._left.wait(0.25):
            _check_running(self._thread)
        if self.event is not None:
            self.event.synchronize()


class DiskTier:
    """Moves blocks between the regions and a :class:`BlockFile` through page-locked staging slots.

    Every job runs on one background I/O thread, in submission order, so neither direction
    blocks the caller. A job is cut into chunks of ``staging_blocks`` blocks, and the chunks
    alternate between ``staging_slots`` staging buffers (double buffering with the default of
    two): a store gathers chunk i+1 on the GPU while chunk i is written to the file; a load reads
    chunk i+1 from the file while the GPU scatters chunk i. A staging buffer is reused, by either
    direction and by later jobs, only after the last GPU work that touched it (gather or scatter)
    has completed, and a store writes it to the file only after its gather completed. Any
    exception ends the job as failed, carrying the OS error, and the job's other chunks are
    dropped; a job is never reported done after an error, and later jobs run as usual.
    """

    def __init__(
        self,
        regions: Mapping[str, torch.Tensor],
        file: BlockFile,
        streams: Mapping[Direction, torch.cuda.Stream] | None,
        staging_slots: int = 2,
        staging_blocks: int = 64,
    ):
        self.regions = dict(regions)
        self.file = file
        self.streams = streams
        self.device = next(iter(regions.values())).device
        self.width = sum(r.shape[1] for r in regions.values())
        self.chunk = staging_blocks
        self.staging = [pinned_empty((staging_blocks, file.slot_stride)) for _ in range(staging_slots)]
        # The last GPU work (a gather writing it, a scatter reading it) on each staging buffer,
        # across jobs and directions: the stores' and loads' streams are not ordered with each
        # other, and the file I/O on this thread not with either, so reuse waits for it.
        self._last_use: list[torch.cuda.Event | None] = [None] * staging_slots
        self.jobs: queue.SimpleQueue[DiskJob | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="kv-offload-disk-io", daemon=True)
        self.thread.start()

    def submit(
        self, direction: Direction, gpu_ids: torch.Tensor, disk_ids: torch.Tensor, ready: torch.cuda.Event | None
    ) -> DiskJob:
        """Queue a job behind every job submitted before it; it completes as :class:`DiskJob` says."""
        _check_running(self.thread)
        job = DiskJob(direction, gpu_ids, disk_ids, ready, self.thread)
        self.jobs.put(job)
        return job

    def close(self) -> None:
        """Run every job submitted so far, stop the I/O thread, and wait until the GPU no longer
        touches the staging buffers (they may be freed after this). Safe to call twice."""
        if self.thread.is_alive():
            self.jobs.put(None)  # after every queued job: the queue is FIFO
            self.thread.join()
        for slot in range(len(self.staging)):
            self._claim(slot)

    # --- the I/O thread ------------------------------------------------------------------------

    def _run(self) -> None:
        setup_error: BaseException | None = None
        if self.device.type == "cuda":
            try:
                torch.cuda.set_device(self.device)
            except BaseException as error:  # every job then fails with it, rather than hanging
                setup_error = error
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                if setup_error is not None:
                    raise setup_error
                event = self._store(job) if job.direction is Direction.STORE else self._load(job)
            except BaseException as error:  # reported as a failed transfer, never as done
                job.finish(error, self._fence(job.direction))
            else:
                job.finish(None, event)

    def _fence(self, direction: Direction) -> torch.cuda.Event | None:
        """An event after the GPU work enqueued so far on ``direction``'s stream: a failed job is
        reported only once none of its chunks still runs."""
        if self.device.type != "cuda":
            return None
        try:
            event = torch.cuda.Event()
            event.record(self.streams[direction])
            return event
        except BaseException:  # the device itself failed: nothing better to wait for
            return None

    def _claim(self, slot: int) -> None:
        """Wait until no GPU work of any job reads or writes staging buffer ``slot``."""
        event = self._last_use[slot]
        if event is not None:
            event.synchronize()
            self._last_use[slot] = None

    def _chunks(self, job: DiskJob):
        for i, start in enumerate(range(0, job.gpu_ids.numel(), self.chunk)):
            stop = start + self.chunk
            yield i % len(self.staging), job.gpu_ids[start:stop], job.disk_ids[start:stop].tolist()

    def _on_gpu(self, direction: Direction, job: DiskJob, first: bool):
        """Context for GPU work of ``job``: its stream, ordered after the caller's event once."""
        stream = self.streams[direction]
        if first and job.ready is not None:
            stream.wait_event(job.ready)
        return torch.cuda.stream(stream)

    def _store(self, job: DiskJob) -> None:
        gathered: deque[tuple[int, list[int]]] = deque()  # (staging slot, disk ids): gathered, not yet written

        def write_oldest() -> None:
            slot, disk_ids = gathered.popleft()
            self._claim(slot)  # its gather has finished writing it
            self.file.write(disk_ids, self.staging[slot][: len(disk_ids)])

        for i, (slot, gpu_ids, disk_ids) in enumerate(self._chunks(job)):
            if len(gathered) == len(self.staging):
                write_oldest()  # frees the slot this chunk is about to use
            self._claim(slot)  # a scatter of an earlier load may still be reading it
            packed = self.staging[slot][: len(disk_ids), : self.width]
            if self.device.type == "cuda":
                with self._on_gpu(Direction.STORE, job, first=i == 0), id_checks(False):
                    gather_blocks(self.regions, gpu_ids.to(self.device, non_blocking=True), packed)
                    self._last_use[slot] = torch.cuda.Event()
                    self._last_use[slot].record()
            else:
                reference.gather_blocks(list(self.regions.values()), gpu_ids, packed)
            gathered.append((slot, disk_ids))
        while gathered:
            write_oldest()
        return None

    def _load(self, job: DiskJob) -> torch.cuda.Event | None:
        for i, (slot, gpu_ids, disk_ids) in enumerate(self._chunks(job)):
            self._claim(slot)  # the GPU may still read (scatter) or write (gather) this buffer
            rows = self.staging[slot][: len(disk_ids)]
            self.file.read(disk_ids, rows)
            packed = rows[:, : self.width]
            if self.device.type == "cuda":
                with self._on_gpu(Direction.LOAD, job, first=i == 0), id_checks(False):
                    scatter_blocks(packed, gpu_ids.to(self.device, non_blocking=True), self.regions)
                    self._last_use[slot] = torch.cuda.Event()
                    self._last_use[slot].record()
            else:
                reference.scatter_blocks(packed, gpu_ids, list(self.regions.values()))
        if self.device.type != "cuda":
            return None
        done = torch.cuda.Event()
        done.record(self.streams[Direction.LOAD])
        return done


def _close(tier: DiskTier) -> None:
    """Stop a disk tier and close its file: from :meth:`DiskPath.close`, or from the finalizer
    of a path dropped without it (so it must not need the path)."""
    try:
        # Runs anything still queued (only if the engine's flush was cut short), stops the
        # thread, and waits until the GPU is done with the staging buffers.
        tier.close()
    finally:
        tier.file.close()  # the last descriptor: the kernel frees the nameless file


class DiskPath:
    """The disk tier as one of the engine's paths (:mod:`kv_ops.transfer.paths`): a
    :class:`BlockFile` of ``num_slots`` slots and the :class:`DiskTier` that moves blocks to it.

    ``enqueue`` hands the transfer to the I/O thread and returns its :class:`DiskJob`, which the
    engine waits on as on a path's event; :meth:`reported` gives the engine the job's error, so
    that an I/O error fails only its own transfer. A path dropped without :meth:`close` (its
    engine collected) stops its thread and closes its file once it is collected.
    """

    name = "disk"
    label = "the disk tier"  # how the engine's errors name it
    copy_engines = False  # the staging buffers are packed and unpacked by the gather and scatter kernels
    # The id sides it plans on the host: the I/O thread cuts every job into chunks by its ids.
    host_planned = frozenset({"gpu_ids", "host_ids"})
    fresh_ready = True  # the I/O thread waits on ``ready`` later, so it needs an event of its own

    def __init__(
        self,
        regions: Mapping[str, torch.Tensor],
        directory: str,
        tag: str,
        slot_bytes: int,
        num_slots: int,
        page_cache: bool,
        streams: Mapping[Direction, torch.cuda.Stream] | None,
        staging_slots: int,
        staging_blocks: int,
    ):
        file = BlockFile(directory, tag, slot_bytes, num_slots, page_cache)
        try:
            self.tier = DiskTier(regions, file, streams, staging_slots, staging_blocks)
        except BaseException:
            file.close()
            raise
        # The finalizer holds the tier, not the path, which it would keep alive.
        self._closer = weakref.finalize(self, _close, self.tier)
        # Not at exit: an engine's path was closed by then with its engine, before the interpreter
        # freezes daemon threads (kv_ops.transfer.engine._close_at_exit says why that matters).
        self._closer.atexit = False

    def enqueue(self, blocks: Blocks, ready: torch.cuda.Event | None) -> DiskJob:
        # Copies: the I/O thread reads the ids later, and the caller may reuse its buffer.
        gpu_ids, disk_ids = torch.from_numpy(blocks.gpu_ids.copy()), torch.from_numpy(blocks.host_ids.copy())
        return self.tier.submit(blocks.direction, gpu_ids, disk_ids, ready)

    def reported(self, direction: Direction, done: DiskJob) -> BaseException | None:
        return done.error

    def close(self) -> None:
        """Run every job submitted so far, stop the I/O thread and close the file; at most once
        (not again when collected)."""
        self._closer()


__all__ = ["DiskTier", "DiskJob", "DiskPath"]
