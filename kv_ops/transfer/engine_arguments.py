"""OffloadEngine's arguments: each checked by its public name, before anything is allocated."""

from __future__ import annotations

import contextlib
import errno
import os

import torch

from ..cuda.arguments import file_name_part, flag, path, positive_int
from ..cuda.host_memory import check_host_bytes
from ..geometry import check_kv_caches
from .block_file import aligned
from .crossover import check_kept_file
from .paths import PATH_NAMES

PATHS = ("auto", *PATH_NAMES)


def check_counts(kv_caches, num_blocks, path, capacity_bytes, ring_bytes, staging_slots, staging_blocks) -> int:
    """The caches, ``num_blocks`` (returned as an int), ``path`` and every other count, checked in
    that order."""
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
    return num_blocks


def check_files_and_device(kv_caches, disk_dir, disk_tag, crossover_file, page_cache) -> torch.device:
    """The file arguments' types checked, ``disk_dir`` a directory that exists, ``disk_tag``
    a piece of a file name and ``crossover_file`` a file in a directory that exists, then the one
    device the caches sit on, returned."""
    for what, value in (("disk_dir", disk_dir), ("crossover_file", crossover_file)):
        if value is not None:
            path("OffloadEngine", what, value)
    if disk_tag is not None:  # it names the file (the fallback's short-lived name holds it)
        file_name_part("OffloadEngine", "disk_tag", disk_tag)
        if disk_dir is None:  # no file to name: the caller meant a disk tier and would silently get host memory
            raise ValueError(
                f"OffloadEngine: disk_tag {disk_tag!r} names the disk tier's file, but no disk_dir was given; "
                "pass disk_dir too, or no disk_tag"
            )
    if disk_dir is not None:
        check_disk_dir(disk_dir)
    if crossover_file is not None:  # before the host memory and auto's measurement, not after
        check_kept_file("OffloadEngine", crossover_file)
    if flag("OffloadEngine", "page_cache", page_cache) and disk_dir is None:  # as disk_tag: a tier not there
        raise ValueError(
            "OffloadEngine: page_cache=True asks for buffered I/O on the disk tier's file, but no disk_dir was "
            "given; pass disk_dir too, or leave page_cache False"
        )
    devices = {t.device for t in kv_caches.values()}
    if len(devices) != 1:
        raise ValueError(f"OffloadEngine: the KV caches must sit on one device, got {sorted(map(str, devices))}")
    (device,) = devices
    return device


def check_disk_dir(disk_dir) -> None:
    """A ``ValueError`` naming ``disk_dir`` unless it names a directory that exists: the disk
    tier's file is made in it, and the OS error would name neither the argument nor the engine."""
    path = os.fspath(disk_dir)  # a non-empty path (check_files_and_device)
    if not os.path.exists(path):
        raise ValueError(f"OffloadEngine: disk_dir {disk_dir!r} does not exist; create the directory first")
    if not os.path.isdir(path):
        raise ValueError(f"OffloadEngine: disk_dir {disk_dir!r} is not a directory")


# What a file system answers when the disk tier's file does not fit: out of space, past the
# largest file it takes, or past a quota.
DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


@contextlib.contextmanager
def disk_fits(capacity_bytes, disk_dir):
    """Around the disk tier's creation: a file that does not fit its file system becomes a
    ``ValueError`` naming ``capacity_bytes`` and ``disk_dir`` (the file, unnamed, is gone by then)."""
    try:
        yield
    except OSError as error:
        if error.errno not in DISK_FULL:
            raise
        raise ValueError(
            f"OffloadEngine: capacity_bytes {capacity_bytes} does not fit on the file system of disk_dir "
            f"{disk_dir!r} ({os.strerror(error.errno)}); pass a smaller capacity_bytes or another disk_dir"
        ) from None


def host_blocks(capacity_bytes, block_bytes: int, disk_dir, host_buffer, staging_slots, staging_blocks) -> int:
    """How many host blocks (disk-tier slots) ``capacity_bytes`` holds: at least one, and only if
    the page-locked memory they take is available, or ``host_buffer`` holds them."""
    slot_bytes = aligned(block_bytes) if disk_dir is not None else block_bytes
    num_host_blocks = int(capacity_bytes) // slot_bytes
    if num_host_blocks < 1:
        raise ValueError(f"OffloadEngine: capacity_bytes {capacity_bytes} holds no block of {slot_bytes} bytes")
    # Page-locked memory cannot be swapped: more than the machine has is refused here, naming
    # the bytes, rather than as an ENOMEM from mmap or the driver.
    if host_buffer is not None:
        check_host_buffer(host_buffer, num_host_blocks * block_bytes, disk_dir)
    elif disk_dir is None:
        check_host_bytes("OffloadEngine", "capacity_bytes", num_host_blocks * block_bytes)
    else:
        check_host_bytes(
            "OffloadEngine",
            "staging_slots x staging_blocks (the disk tier's staging buffers)",
            int(staging_slots) * int(staging_blocks) * slot_bytes,
        )
    return num_host_blocks


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


__all__ = [
    "PATHS",
    "check_counts",
    "check_files_and_device",
    "check_disk_dir",
    "DISK_FULL",
    "disk_fits",
    "host_blocks",
    "check_host_buffer",
]
