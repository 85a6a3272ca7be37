"""Page-locked host memory shared between the GPU process and the CUDA-free offload process."""

from __future__ import annotations

import mmap
import os
import secrets
import tempfile
from dataclasses import dataclass

import torch

from kv_ops.cuda.host_memory import pin_mapping


@dataclass(frozen=True)
class SharedHandle:
    """What the offload process needs to attach: a path and a size. Picklable, no CUDA."""

    path: str
    nbytes: int


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


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

    Examples
    --------
    >>> buf = SharedHostBuffer(4096)                 # GPU process
    >>> other = SharedHostBuffer.attach(buf.handle)  # offload process
    """

    def __init__(self, nbytes: int, register: bool | None = None):
        if nbytes <= 0:
            raise ValueError(f"SharedHostBuffer: nbytes must be > 0, got {nbytes}")
        path = os.path.join(_shm_dir(), f"offload-ops.{os.getpid()}.{secrets.token_hex(8)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            try:
                os.ftruncate(fd, nbytes)
                mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
            finally:
                os.close(fd)
            register = torch.cuda.is_available() if register is None else register
            self.bytes = pin_mapping(mapping, nbytes, register)
        except BaseException:
            # No object comes back to unlink it later (registration fails without CUDA, for one).
            os.unlink(path)
            raise
        self.handle = SharedHandle(path, nbytes)
        self.owner = True

    @classmethod
    def attach(cls, handle: SharedHandle) -> "SharedHostBuffer":
        """Map a buffer made by another process (no registration, no CUDA)."""
        self = cls.__new__(cls)
        fd = os.open(handle.path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            mapping = mmap.mmap(fd, handle.nbytes, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.handle = handle
        self.owner = False
        self.bytes = pin_mapping(mapping, handle.nbytes, register=False)
        return self

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor over ``shape`` elements of ``dtype`` starting at byte ``offset``."""
        nbytes = torch.empty(shape, dtype=dtype, device="meta").numel() * dtype.itemsize
        if offset < 0 or offset % dtype.itemsize or offset + nbytes > self.handle.nbytes:
            raise ValueError(f"SharedHostBuffer.view: {nbytes} bytes at {offset} do not fit {self.handle.nbytes}")
        return self.bytes[offset : offset + nbytes].view(dtype).view(shape)

    def unlink(self) -> None:
        """Remove the file (the creator does, at shutdown); mappings stay valid until dropped."""
        if self.owner:
            try:
                os.unlink(self.handle.path)
            except FileNotFoundError:
                pass
            self.owner = False


__all__ = ["SharedHandle", "SharedHostBuffer"]
