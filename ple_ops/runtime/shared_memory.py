"""Page-locked host memory shared between the GPU process and the CUDA-free offload process."""

from __future__ import annotations

import errno
import glob
import math
import mmap
import os
import re
import secrets
import stat
import sys
import tempfile
import weakref
from dataclasses import dataclass

import torch

from kv_ops.cuda import arguments
from kv_ops.cuda.arguments import file_name_part, index, positive_int
from kv_ops.cuda.host_memory import pin_mapping

from .multiprocessing_internals import track_shm_file, untrack_shm_file

# Every file is named PREFIX.<creator pid>.[<tag>.]<random hex>: a runtime tags its files with a
# random word it tells its offload process, which can then remove exactly those if the GPU
# process dies before it could (remove_files_of). The pid alone is not enough: under a shared
# /dev/shm another PID namespace has the same pids.
PREFIX = "offload-ops"
# The name SharedHostBuffer gives a file (a tag is any word without "/" or NUL, dots included): the
# only names attach() opens, in _shm_dir() only.
_NAME = re.compile(rf"{re.escape(PREFIX)}\.[0-9]+\.(?:.+\.)?[0-9a-f]{{16}}", re.DOTALL)


@dataclass(frozen=True)
class SharedHandle:
    """What the offload process needs to attach: a path and a size. Picklable, no CUDA."""

    path: str
    nbytes: int


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _remove(path: str, creator: int, tracked: bool) -> None:
    """Remove ``path`` if this is the process that made it (a forked child inherits the finalizer
    of a buffer it does not own, and must not take the name from its parent)."""
    if os.getpid() == creator:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        if tracked:
            untrack_shm_file(os.path.basename(path))


class DoesNotFit(ValueError):
    """A buffer size the file system behind ``/dev/shm`` cannot hold."""


def _reserve(fd: int, nbytes: int) -> None:
    """Give the file ``nbytes`` of backing store now, or raise a ``ValueError`` if there is none.

    A file only truncated to size gets its pages when they are first touched; on a full tmpfs that
    touch is a SIGBUS that kills the process, long after the size was chosen. Reserving them here
    turns it into ENOSPC, at the call that chose the size.
    """
    if not hasattr(os, "posix_fallocate"):  # not on macOS: sized only, as before
        os.ftruncate(fd, nbytes)
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
        stat = os.fstatvfs(fd)
        raise DoesNotFit(
            f"SharedHostBuffer: nbytes {nbytes} does not fit in {_shm_dir()} ({stat.f_bavail * stat.f_frsize} "
            f"bytes free: {os.strerror(error.errno)}); ask for fewer bytes or make {_shm_dir()} larger"
        ) from None


def _attachable(handle) -> SharedHandle:
    """``handle`` when it names a file this package makes (:data:`PREFIX` in :func:`_shm_dir`) and a
    size, else a ``ValueError`` naming it: attach maps the file read-write, and any other path
    (``/etc/passwd``) is not a buffer of ours."""
    owner = "SharedHostBuffer.attach"
    if not isinstance(handle, SharedHandle):
        raise ValueError(f"{owner}: handle must be a SharedHandle (SharedHostBuffer.handle), got {handle!r}")
    path = arguments.path(owner, "handle.path", handle.path)
    directory, name = os.path.split(path)
    if directory != _shm_dir() or not _NAME.fullmatch(name):
        raise ValueError(
            f"{owner}: handle.path must be a buffer file this package made, {_shm_dir()}/{PREFIX}.<pid>.<hex>, "
            f"got {path!r}"
        )
    positive_int(owner, "handle.nbytes", handle.nbytes)
    return handle


def remove_files_of(pid: int, tag: str) -> list[str]:
    """Remove every buffer file process ``pid`` made with ``tag`` and left (it died before it
    could); returns their paths. Only for a process that knows ``pid`` is gone: the offload
    process, once it was re-parented. A file it may not remove is left (it is not ours)."""
    removed = []
    for path in glob.glob(os.path.join(_shm_dir(), f"{PREFIX}.{int(pid)}.{tag}.*")):
        try:
            os.unlink(path)
        except OSError:
            continue
        removed.append(path)
    return removed


class SharedHostBuffer:
    """Host memory that two processes map, page-locked and device-mapped on the GPU side.

    The creating (GPU) process makes a file in ``/dev/shm`` exclusively (mode 0600, no link
    followed), maps it shared and registers it with ``cuMemHostRegister``, so a GPU stream can
    read and write it through its device address. The offload process attaches by
    :attr:`handle` with a plain ``mmap``: it never touches CUDA.

    Parameters
    ----------
    nbytes : int
        Size of the buffer.
    register : bool, optional
        Page-lock it for the GPU. Defaults to ``torch.cuda.is_available()``.
    tag : str, optional
        A word in the file's name, by which :func:`remove_files_of` finds it.

    The file's bytes are reserved when it is made, so that a size ``/dev/shm`` cannot hold is a
    ``ValueError`` here (and leaves no file) instead of a SIGBUS at the first touch. The creator
    removes the name at :meth:`unlink`, when this object is collected, or when the process exits,
    whichever comes first: keep the object alive until every other process has attached (the
    mappings stay valid after the name is gone). A process killed outright leaves its files:
    :func:`remove_files_of` removes a tagged one, and multiprocessing's resource tracker an
    untagged one (in ``/dev/shm``), once every process sharing the tracker is gone.

    Examples
    --------
    >>> buf = SharedHostBuffer(4096)                 # GPU process
    >>> other = SharedHostBuffer.attach(buf.handle)  # offload process
    """

    def __init__(self, nbytes: int, register: bool | None = None, tag: str | None = None):
        nbytes = positive_int("SharedHostBuffer", "nbytes", nbytes)
        if nbytes > sys.maxsize:  # past any file's size (off_t) and any mapping's: os would overflow
            raise DoesNotFit(f"SharedHostBuffer: nbytes {nbytes} is past the largest file size, {sys.maxsize} bytes")
        tagged = "" if tag is None else f"{file_name_part('SharedHostBuffer', 'tag', tag)}."
        directory = _shm_dir()
        path = os.path.join(directory, f"{PREFIX}.{os.getpid()}.{tagged}{secrets.token_hex(8)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        # A tagged file is the offload runtime's, whose process removes it if this one is killed
        # (remove_files_of). An untagged one has no such process: multiprocessing's resource
        # tracker removes it then (only in /dev/shm, where shm_unlink finds it).
        tracked = False
        try:
            try:
                if tag is None and directory == "/dev/shm":
                    track_shm_file(os.path.basename(path))
                    tracked = True
                _reserve(fd, nbytes)
                mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
            finally:
                os.close(fd)
            register = torch.cuda.is_available() if register is None else register
            self.bytes = pin_mapping(mapping, nbytes, register)
        except BaseException:
            # No object comes back to unlink it later (registration fails without CUDA, for one).
            _remove(path, os.getpid(), tracked)
            raise
        self.handle = SharedHandle(path, nbytes)
        self.owner = True
        self._finalizer = weakref.finalize(self, _remove, path, os.getpid(), tracked)

    @classmethod
    def attach(cls, handle: SharedHandle) -> "SharedHostBuffer":
        """Map a buffer made by another process (no registration, no CUDA).

        Only a handle of a file this package makes is attached: a path elsewhere, or another name,
        is a ``ValueError`` before the file is opened, and so is a file that is not a regular file
        of at least ``handle.nbytes`` bytes.
        """
        handle = _attachable(handle)
        self = cls.__new__(cls)
        fd = os.open(handle.path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode) or found.st_size < handle.nbytes:
                raise ValueError(
                    f"SharedHostBuffer.attach: {handle.path!r} holds {found.st_size} bytes, not a buffer of "
                    f"handle.nbytes {handle.nbytes}"
                )
            mapping = mmap.mmap(fd, handle.nbytes, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.handle = handle
        self.owner = False
        self.bytes = pin_mapping(mapping, handle.nbytes, register=False)
        return self

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor over ``shape`` elements of ``dtype`` starting at byte ``offset``; an offset that
        is not an integer >= 0, a shape that is not one, or a dtype that is not a ``torch.dtype`` is
        a ``ValueError`` naming it."""
        offset = index("SharedHostBuffer.view", "offset", offset)
        shape = arguments.shape("SharedHostBuffer.view", "shape", shape)
        dtype = arguments.dtype("SharedHostBuffer.view", "dtype", dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if offset % dtype.itemsize or offset + nbytes > self.handle.nbytes:
            raise ValueError(f"SharedHostBuffer.view: {nbytes} bytes at {offset} do not fit {self.handle.nbytes}")
        return self.bytes[offset : offset + nbytes].view(dtype).view(shape)

    def unlink(self) -> None:
        """Remove the file (the creator does, at shutdown); mappings stay valid until dropped."""
        if self.owner:
            self._finalizer()  # runs once: a later collection or exit does nothing
            self.owner = False


__all__ = ["SharedHandle", "SharedHostBuffer", "DoesNotFit", "remove_files_of", "PREFIX"]
