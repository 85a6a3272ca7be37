"""The disk tier's file: a private, unnamed file of block slots, and its reads and writes.

:class:`BlockFile` is the file one rank or device offloads to; the disk tier
(:mod:`kv_ops.transfer.disk`) stages blocks through page-locked buffers into it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import secrets
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from ..cuda.arguments import file_name_part, flag, path, positive_int, shown
from ..validation import check_ids_meta, check_ids_values

# O_DIRECT needs the buffer address, the file offset and the length aligned to the device's
# logical block size; 4 KiB covers every common device, and pages are 4 KiB anyway.
ALIGN = 4096

# What read() and write() take as slots: what torch.as_tensor reads as 1-D ids (checked there).
SLOTS = (Sequence, torch.Tensor, np.ndarray)


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
    directory : str or os.PathLike
        The file system the file goes on.
    tag : str
        Names this rank's or device's file in error messages (``"rank0"``, ``"cuda1"``, ...) and
        in the short-lived name of the create-then-unlink fallback: a non-empty string with no
        ``/`` and no NUL, else a ``ValueError``.
    slot_bytes : int
        Bytes of one block (all regions); rounded up to 4 KiB.
    num_slots : int
        Slots in the file.
    page_cache : bool
        Use buffered I/O instead of ``O_DIRECT``.

    Each argument is checked by the rule :class:`kv_ops.OffloadEngine` checks its own by
    (``disk_dir``, ``disk_tag``, ``page_cache``), before any file is made: anything else is a
    ``ValueError`` naming it. So are ``slots`` that are not a list, tensor or array of slot
    indices, and a ``src`` or ``dst`` that is not a fitting tensor, before any byte moves.

    Examples
    --------
    >>> f = BlockFile("/mnt/nvme", "rank0", slot_bytes=kv_ops.block_bytes(regions), num_slots=4096)
    >>> staging = kv_ops.pinned_empty((64, f.slot_stride))
    >>> f.write([3, 4, 5, 9], staging[:4])
    """

    def __init__(self, directory: str, tag: str, slot_bytes: int, num_slots: int, page_cache: bool = False):
        # The rules OffloadEngine checks its own disk_dir, disk_tag and page_cache by.
        directory = path("BlockFile", "directory", directory)
        file_name_part("BlockFile", "tag", tag)  # the fallback's short-lived name holds it
        slot_bytes = positive_int("BlockFile", "slot_bytes", slot_bytes)
        num_slots = positive_int("BlockFile", "num_slots", num_slots)
        page_cache = flag("BlockFile", "page_cache", page_cache)  # "no" would read as True: buffered I/O
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

    def _check(self, slots: Sequence[int], buf: torch.Tensor, name: str) -> None:
        if self.fd is None:
            raise ValueError(f"BlockFile: {self.label} is closed")
        # Two isinstance calls per transfer: None or a str would otherwise fail inside len() or
        # torch with a TypeError that names neither the argument nor the file.
        if not isinstance(slots, SLOTS) or isinstance(slots, (str, bytes)):
            raise ValueError(f"BlockFile: slots must be a list, tensor or array of slot indices, got {shown(slots)}")
        if not isinstance(buf, torch.Tensor):
            raise ValueError(
                f"BlockFile: {name} must be a CPU uint8 [n, {self.slot_stride}] tensor, got {type(buf).__name__}"
            )
        if buf.device.type != "cpu" or buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] != self.slot_stride:
            raise ValueError(
                f"BlockFile: {name} must be a CPU uint8 [n, {self.slot_stride}] tensor, got {buf.device} {buf.dtype} "
                f"{tuple(buf.shape)}"
            )
        if not buf.is_contiguous() or len(slots) > buf.shape[0]:
            raise ValueError(f"BlockFile: {name} must be contiguous with at least {len(slots)} rows")
        if self.direct and buf.data_ptr() % ALIGN:
            raise ValueError(f"BlockFile: O_DIRECT needs a {ALIGN}-byte aligned buffer (kv_ops.pinned_empty gives one)")
        if len(slots):
            ids = torch.as_tensor(slots)
            check_ids_meta("BlockFile", "slots", ids)
            check_ids_values("BlockFile", "slots", ids, self.num_slots)

    def _io(self, write: bool, slots: Sequence[int], buf: torch.Tensor) -> None:
        self._check(slots, buf, "src" if write else "dst")
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
        if self.fd is None:  # as every read and write after close() does
            raise ValueError(f"BlockFile: {self.label} is closed")
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["BlockFile", "ALIGN", "aligned", "slot_runs"]
