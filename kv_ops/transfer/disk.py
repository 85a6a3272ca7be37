"""The disk tier: a private, unnamed file of block slots, the staged I/O to it, and its engine path."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import queue
import secrets
import threading
import weakref
from collections import deque
from collections.abc import Mapping, Sequence

import torch

from .. import reference
from ..cuda.arguments import positive_int
from ..cuda.host_memory import pinned_empty
from ..ops import gather_blocks, scatter_blocks
from ..validation import check_ids_meta, check_ids_values, id_checks
from .blocks import Blocks, Direction

# O_DIRECT needs the buffer address, the file offset and the length aligned to the device's
# logical block size; 4 KiB covers every common device, and pages are 4 KiB anyway.
ALIGN = 4096


def aligned(n: int, to: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``to``: the bytes of a file slot holding ``n`` bytes."""
    return -(-n // to) * to


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first row, first slot, count) for each run of consecutive slots, in the given order.

    The tier's I/O is one read or write per run. Public so that tests check the merging rule itself.
    """
    runs: list[tuple[int, int, int]] = []
    for row, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot and runs[-1][0] + runs[-1][2] == row:
            first_row, first_slot, count = runs[-1]
            runs[-1] = (first_row, first_slot, count + 1)
        else:
            runs.append((row, slot, 1))
    return runs


def open_tmpfile(directory: str) -> int | None:
    """An unnamed regular file in ``directory`` (``O_TMPFILE``), or None where the kernel or the
    file system cannot make one.

    ``O_EXCL`` makes the file impossible to link into the directory later (``linkat`` refuses),
    so no name can ever reach its bytes: they live exactly as long as the descriptor. Public so
    that tests stand in a file system without it.
    """
    tmpfile = getattr(os, "O_TMPFILE", None)
    if tmpfile is None:  # not Linux
        return None
    try:
        return os.open(directory, tmpfile | os.O_RDWR | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as e:
        # EOPNOTSUPP: this file system has no O_TMPFILE. EISDIR: a kernel older than 3.11 ignores
        # the flag and tries to open the directory itself for writing.
        if e.errno in (errno.EOPNOTSUPP, errno.EISDIR):
            return None
        raise


def candidate_names(tag: str):
    """Names for the create-then-unlink fallback: the tag, the pid, and a random part, so that a
    name cannot be predicted (and planted in advance) and a leftover is traceable to its process.
    Public so that tests plant a link at a name the fallback will try."""
    while True:
        yield f"kv_offload.{tag}.{os.getpid()}.{secrets.token_hex(8)}.tmp"


def _create_then_unlink(directory: str, tag: str) -> int:
    """Create a fresh file exclusively, without following links, and remove its name at once.

    ``O_CREAT | O_EXCL`` fails on any existing name, a symbolic link included (POSIX: the link is
    not followed), so an existing file is never opened, truncated or followed. The name exists
    only between the two calls below; a process killed exactly there leaves one empty file
    named after its pid, which nothing ever reuses.
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _, name in zip(range(16), candidate_names(tag)):
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            continue  # someone else's file or link: leave it alone, pick another name
        try:
            os.unlink(path)
        except BaseException:
            os.close(fd)
            raise
        return fd
    raise FileExistsError(errno.EEXIST, f"no free file name for the disk tier in {directory} after 16 random tries")


class BlockFile:
    """An unnamed file of ``num_slots`` block slots for one rank or device.

    The file has no name in ``directory`` from the moment it is open: it is created with
    ``O_TMPFILE`` where the kernel and file system support it, and otherwise created exclusively
    under a random name and unlinked at once. Its bytes are freed when the descriptor closes,
    by :meth:`close` or by the kernel when the process dies (SIGKILL and OOM kills included), so
    a crash leaves nothing behind and a restart in the same directory needs no clean-up. (On NFS,
    which has no O_TMPFILE, the client keeps an unlinked open file as ``.nfs*`` until it is
    closed, and a crashed client leaves that behind: use a local file system.)

    Blocks may hold users' prompts, so the file is private: mode 0600, never an existing file,
    never reached through a symbolic link, and no name through which another process could open
    it afterwards (``nlink`` is checked to be 0). ``O_DIRECT`` is the default, so that offloaded
    blocks do not also fill the page cache; ``page_cache=True`` opts in to buffered I/O (needed
    on file systems without O_DIRECT). Every slot is ``slot_bytes`` rounded up to 4 KiB, and the
    whole file is allocated up front, so a disk that is too small fails here rather than halfway
    through a transfer.

    Parameters
    ----------
    directory : str
        The file system the file goes on.
    tag : str
        Names this rank's or device's file in error messages (``"rank0"``, ``"cuda1"``, ...) and
        in the short-lived name of the create-then-unlink fallback.
    slot_bytes : int
        Bytes of one block (all regions); rounded up to 4 KiB.
    num_slots : int
        Slots in the file.
    page_cache : bool
        Use buffered I/O instead of ``O_DIRECT``.

    Examples
    --------
    >>> f = BlockFile("/mnt/nvme", "rank0", slot_bytes=kv_ops.block_bytes(regions), num_slots=4096)
    >>> staging = kv_ops.pinned_empty((64, f.slot_stride))
    >>> f.write([3, 4, 5, 9], staging[:4])
    """

    def __init__(self, directory: str, tag: str, slot_bytes: int, num_slots: int, page_cache: bool = False):
        slot_bytes = positive_int("BlockFile", "slot_bytes", slot_bytes)
        num_slots = positive_int("BlockFile", "num_slots", num_slots)
        self.fd: int | None = None
        self.directory = directory
        # What error messages call the file; it has no name on disk.
        self.label = f"{os.path.join(directory, f'kv_offload.{tag}')} (unlinked)"
        self.slot_stride = aligned(slot_bytes)
        self.num_slots = num_slots
        self.direct = not page_cache
        try:
            fd = open_tmpfile(directory)
            if fd is None:
                fd = _create_then_unlink(directory, tag)
        except OSError as e:
            raise OSError(
                e.errno, f"cannot create the disk tier file kv_offload.{tag} in {directory}: {e.strerror}"
            ) from None
        self.fd = fd
        # The descriptor is the only owner of the bytes: close it even if this object is dropped
        # without close() (the kernel frees an unlinked file's blocks on its last close).
        self._closer = weakref.finalize(self, os.close, fd)
        self._closer.atexit = False  # at exit the kernel closes it, after the I/O thread is gone
        try:
            if os.fstat(fd).st_nlink != 0:  # a hard link made in the instant the name existed
                raise OSError(
                    errno.EEXIST, f"the disk tier file in {directory} gained a link to it before it was unlinked"
                )
            if self.direct:
                # Set after creation, not at open: a file system without O_DIRECT then fails here
                # with EINVAL that can mean nothing else (at open it could be any flag), and a
                # failure leaves no file behind (an O_CREAT open refused for O_DIRECT could).
                try:
                    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
                except OSError as e:
                    if e.errno == errno.EINVAL:
                        raise OSError(
                            e.errno, f"the file system of {directory} does not support O_DIRECT; pass page_cache=True"
                        ) from None
                    raise
            size = self.slot_stride * num_slots
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # ENOSPC, EFBIG, EDQUOT, ...
                    raise OSError(
                        e.errno, f"cannot allocate {size} bytes of disk tier in {self.label}: {e.strerror}"
                    ) from None
                os.ftruncate(fd, size)  # the file system cannot preallocate: sparse file
        except BaseException:
            self.close()
            raise

    def _check(self, slots: Sequence[int], buf: torch.Tensor) -> None:
        if self.fd is None:
            raise ValueError(f"BlockFile: {self.label} is closed")
        if buf.device.type != "cpu" or buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] != self.slot_stride:
            raise ValueError(
                f"BlockFile: buffer must be a CPU uint8 [n, {self.slot_stride}] tensor, got {buf.device} {buf.dtype} "
                f"{tuple(buf.shape)}"
            )
        if not buf.is_contiguous() or len(slots) > buf.shape[0]:
            raise ValueError(f"BlockFile: buffer must be contiguous with at least {len(slots)} rows")
        if self.direct and buf.data_ptr() % ALIGN:
            raise ValueError(f"BlockFile: O_DIRECT needs a {ALIGN}-byte aligned buffer (kv_ops.pinned_empty gives one)")
        if len(slots):
            ids = torch.as_tensor(slots)
            check_ids_meta("BlockFile", "slots", ids)
            check_ids_values("BlockFile", "slots", ids, self.num_slots)

    def _io(self, write: bool, slots: Sequence[int], buf: torch.Tensor) -> None:
        self._check(slots, buf)
        stride = self.slot_stride
        what = "write" if write else "read"
        for row, slot, count in slot_runs(slots):
            nbytes = count * stride
            view = (ctypes.c_char * nbytes).from_address(buf.data_ptr() + row * stride)
            offset = slot * stride
            done = 0
            while done < nbytes:  # the kernel may move fewer bytes than asked; carry on from there
                chunk = memoryview(view)[done:]
                try:
                    n = (
                        os.pwrite(self.fd, chunk, offset + done)
                        if write
                        else os.preadv(self.fd, [chunk], offset + done)
                    )
                except OSError as e:
                    # A short write is followed by this call, which reports why (ENOSPC, EFBIG, EIO).
                    raise OSError(
                        e.errno, f"disk tier {what} of slots {slot}..{slot + count - 1} in {self.label}: {e.strerror}"
                    ) from None
                if n == 0:
                    # pread returns 0 only at end of file: the preallocated file got shorter
                    # (truncated by someone else). A slot is never served half-read.
                    raise OSError(
                        errno.EIO,
                        f"disk tier {what} of slots {slot}..{slot + count - 1} in {self.label}: end of file at byte "
                        f"{offset + done} (the file was truncated)",
                    )
                done += n

    def write(self, slots: Sequence[int], src: torch.Tensor) -> None:
        """Write ``src[i]`` to slot ``slots[i]`` (runs of consecutive slots in one call each).

        Raises
        ------
        OSError
            The OS error of the first failing ``pwrite`` (e.g. ENOSPC, EFBIG), naming the slots.
        """
        self._io(True, slots, src)

    def read(self, slots: Sequence[int], dst: torch.Tensor) -> None:
        """Read slot ``slots[i]`` into ``dst[i]``.

        Raises
        ------
        OSError
            The OS error of a failing ``preadv``, or EIO at an unexpected end of file.
        """
        self._io(False, slots, dst)

    def close(self) -> None:
        """Close the descriptor, which frees the file's blocks (it has no name). Safe to call twice."""
        if self.fd is not None:
            self.fd = None
            self._closer()  # os.close, exactly once

    def __enter__(self) -> "BlockFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


__all__ = ["BlockFile", "DiskTier", "DiskJob", "DiskPath", "ALIGN", "aligned", "slot_runs"]
