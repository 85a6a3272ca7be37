"""The disk tier: a private file of block slots, and the staged, double-buffered I/O to it."""

from __future__ import annotations

import ctypes
import errno
import os
import queue
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from . import reference
from .host_memory import pinned_empty
from .ops import gather_blocks, scatter_blocks
from .validation import id_checks

# O_DIRECT needs the buffer address, the file offset and the length aligned to the device's
# logical block size; 4 KiB covers every common device, and pages are 4 KiB anyway.
ALIGN = 4096


def _round_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def _runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first row, first slot, count) for each run of consecutive slots, in the given order."""
    runs: list[tuple[int, int, int]] = []
    for row, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot and runs[-1][0] + runs[-1][2] == row:
            first_row, first_slot, count = runs[-1]
            runs[-1] = (first_row, first_slot, count + 1)
        else:
            runs.append((row, slot, 1))
    return runs


class BlockFile:
    """A file of ``num_slots`` block slots for one rank or device, removed on :meth:`close`.

    Blocks may hold users' prompts, so the file is private: created exclusively (an existing
    file or a symbolic link at the path is an error, never reused or followed), mode 0600.
    ``O_DIRECT`` is the default, so that offloaded blocks do not also fill the page cache;
    ``page_cache=True`` opts in to buffered I/O (needed on file systems without O_DIRECT, such as
    tmpfs). Every slot is ``slot_bytes`` rounded up to 4 KiB, and the whole file is allocated up
    front, so a disk that is too small fails here rather than halfway through a transfer.

    Parameters
    ----------
    directory : str
        Where the file goes.
    tag : str
        Distinguishes the file of this rank or device (``"rank0"``, ``"cuda1"``, ...).
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
        if slot_bytes <= 0 or num_slots <= 0:
            raise ValueError(f"BlockFile: slot_bytes {slot_bytes} and num_slots {num_slots} must be > 0")
        self.path = os.path.join(directory, f"kv_offload.{tag}.bin")
        self.slot_stride = _round_up(slot_bytes)
        self.num_slots = num_slots
        self.direct = not page_cache
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_DIRECT if self.direct else 0)
        try:
            self.fd = os.open(self.path, flags, 0o600)
        except FileExistsError as e:
            raise FileExistsError(
                e.errno, f"disk tier file already exists (another engine, or a stale file to remove by hand): {self.path}"
            ) from None
        except OSError as e:
            if self.direct and e.errno == errno.EINVAL:
                raise OSError(
                    e.errno, f"the file system of {directory} does not support O_DIRECT; pass page_cache=True"
                ) from None
            raise OSError(e.errno, f"cannot create the disk tier file {self.path}: {e.strerror}") from None
        try:
            size = self.slot_stride * num_slots
            try:
                os.posix_fallocate(self.fd, 0, size)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # ENOSPC, EFBIG, EDQUOT, ...
                    raise OSError(e.errno, f"cannot allocate {size} bytes of disk tier in {self.path}: {e.strerror}") from None
                os.ftruncate(self.fd, size)  # the file system cannot preallocate: sparse file
        except BaseException:
            self.close()
            raise

    def _check(self, slots: Sequence[int], buf: torch.Tensor) -> None:
        if buf.device.type != "cpu" or buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] != self.slot_stride:
            raise ValueError(
                f"BlockFile: buffer must be a CPU uint8 [n, {self.slot_stride}] tensor, got {buf.device} {buf.dtype} "
                f"{tuple(buf.shape)}"
            )
        if not buf.is_contiguous() or len(slots) > buf.shape[0]:
            raise ValueError(f"BlockFile: buffer must be contiguous with at least {len(slots)} rows")
        if self.direct and buf.data_ptr() % ALIGN:
            raise ValueError(f"BlockFile: O_DIRECT needs a {ALIGN}-byte aligned buffer (kv_ops.pinned_empty gives one)")
        for i, s in enumerate(slots):
            if not 0 <= s < self.num_slots:
                raise ValueError(f"BlockFile: slots[{i}] = {s} is outside [0, {self.num_slots})")

    def _io(self, write: bool, slots: Sequence[int], buf: torch.Tensor) -> None:
        self._check(slots, buf)
        stride = self.slot_stride
        for row, slot, count in _runs(slots):
            nbytes = count * stride
            view = (ctypes.c_char * nbytes).from_address(buf.data_ptr() + row * stride)
            offset = slot * stride
            done = 0
            while done < nbytes:  # the kernel may move fewer bytes than asked; carry on from there
                chunk = memoryview(view)[done:]
                try:
                    n = os.pwrite(self.fd, chunk, offset + done) if write else os.preadv(self.fd, [chunk], offset + done)
                except OSError as e:
                    what = "write" if write else "read"
                    raise OSError(e.errno, f"disk tier {what} of slots {slot}..{slot + count - 1} in {self.path}: {e.strerror}") from None
                if n == 0:
                    raise OSError(errno.EIO, f"disk tier: end of file at byte {offset + done} of {self.path}")
                done += n

    def write(self, slots: Sequence[int], src: torch.Tensor) -> None:
        """Write ``src[i]`` to slot ``slots[i]`` (runs of consecutive slots in one call each)."""
        self._io(True, slots, src)

    def read(self, slots: Sequence[int], dst: torch.Tensor) -> None:
        """Read slot ``slots[i]`` into ``dst[i]``."""
        self._io(False, slots, dst)

    def close(self) -> None:
        """Close and remove the file. Safe to call twice."""
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)
            self.fd = None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "BlockFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class DiskJob:
    """One store (regions -> file) or load (file -> regions) of the disk tier."""

    tid: int
    kind: str  # "store" or "load"
    gpu_ids: torch.Tensor  # int64, on the host
    disk_ids: torch.Tensor  # int64, on the host
    ready: torch.cuda.Event | None  # recorded on the caller's stream at the call


@dataclass
class DiskResult:
    """A finished job: ``event`` (loads on CUDA) completes when the last scatter has run."""

    tid: int
    kind: str
    error: BaseException | None
    event: torch.cuda.Event | None


class DiskTier:
    """Moves blocks between the regions and a :class:`BlockFile` through page-locked staging slots.

    Every job runs on one background I/O thread, so neither direction blocks the caller. A job
    is cut into chunks of ``staging_blocks`` blocks, and the chunks alternate between
    ``staging_slots`` staging buffers (double buffering with the default of two): a store
    gathers chunk i+1 on the GPU while chunk i is written to the file; a load reads chunk i+1
    from the file while the GPU scatters chunk i. A slot is reused only after the file write that
    read it returned (store) or the scatter that read it completed (load). Any exception ends the
    job as failed, carrying the OS error; a job is never reported done after an error.
    """

    def __init__(
        self,
        regions: Mapping[str, torch.Tensor],
        file: BlockFile,
        streams: Mapping[str, torch.cuda.Stream] | None,
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
        self.jobs: queue.SimpleQueue[DiskJob | threading.Event | None] = queue.SimpleQueue()
        self.results: queue.SimpleQueue[DiskResult] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="kv-offload-disk-io", daemon=True)
        self.thread.start()

    def submit(self, job: DiskJob) -> None:
        self.jobs.put(job)

    def barrier(self) -> None:
        """Return once every job submitted before the call has left the I/O thread."""
        reached = threading.Event()
        self.jobs.put(reached)
        reached.wait()

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()

    # --- the I/O thread ------------------------------------------------------------------------

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if isinstance(job, threading.Event):
                job.set()
                continue
            try:
                event = self._store(job) if job.kind == "store" else self._load(job)
                self.results.put(DiskResult(job.tid, job.kind, None, event))
            except BaseException as error:  # reported as a failed transfer, never as done
                self.results.put(DiskResult(job.tid, job.kind, error, None))

    def _chunks(self, job: DiskJob):
        for i, start in enumerate(range(0, job.gpu_ids.numel(), self.chunk)):
            stop = start + self.chunk
            yield i % len(self.staging), job.gpu_ids[start:stop], job.disk_ids[start:stop].tolist()

    def _on_gpu(self, kind: str, job: DiskJob, first: bool):
        """Context for GPU work of ``job``: its stream, ordered after the caller's event once."""
        stream = self.streams[kind]
        if first and job.ready is not None:
            stream.wait_event(job.ready)
        return torch.cuda.stream(stream)

    def _store(self, job: DiskJob) -> None:
        gathered: deque[tuple[int, int, list[int], torch.cuda.Event | None]] = deque()

        def write_oldest() -> None:
            slot, rows, disk_ids, event = gathered.popleft()
            if event is not None:
                event.synchronize()
            self.file.write(disk_ids, self.staging[slot][:rows])

        for i, (slot, gpu_ids, disk_ids) in enumerate(self._chunks(job)):
            if len(gathered) == len(self.staging):
                write_oldest()  # frees the slot this chunk is about to use
            packed = self.staging[slot][: len(disk_ids), : self.width]
            event = None
            if self.device.type == "cuda":
                with self._on_gpu("store", job, first=i == 0), id_checks(False):
                    gather_blocks(self.regions, gpu_ids.to(self.device, non_blocking=True), packed)
                    event = torch.cuda.Event()
                    event.record()
            else:
                reference.gather_blocks(list(self.regions.values()), gpu_ids, packed)
            gathered.append((slot, len(disk_ids), disk_ids, event))
        while gathered:
            write_oldest()
        return None

    def _load(self, job: DiskJob) -> torch.cuda.Event | None:
        busy: list[torch.cuda.Event | None] = [None] * len(self.staging)  # last scatter reading each slot
        for i, (slot, gpu_ids, disk_ids) in enumerate(self._chunks(job)):
            if busy[slot] is not None:
                busy[slot].synchronize()  # the GPU may still be reading this slot
            rows = self.staging[slot][: len(disk_ids)]
            self.file.read(disk_ids, rows)
            packed = rows[:, : self.width]
            if self.device.type == "cuda":
                with self._on_gpu("load", job, first=i == 0), id_checks(False):
                    scatter_blocks(packed, gpu_ids.to(self.device, non_blocking=True), self.regions)
                    busy[slot] = torch.cuda.Event()
                    busy[slot].record()
            else:
                reference.scatter_blocks(packed, gpu_ids, list(self.regions.values()))
        if self.device.type != "cuda":
            return None
        done = torch.cuda.Event()
        done.record(self.streams["load"])
        return done


__all__ = ["BlockFile", "DiskTier", "DiskJob", "DiskResult", "ALIGN"]
