"""The doctor's storage checks: free space in ``/dev/shm`` and O_DIRECT in each disk-tier directory."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import tempfile

from ...cuda.arguments import index
from ...cuda.arguments import path as path_argument
from .common import ALIGN, CheckResult, fmt_bytes

# --- check: /dev/shm -----------------------------------------------------------------------------


def check_shm(ple_bytes: int = 0, path: str = "/dev/shm") -> CheckResult:
    """Free space in ``/dev/shm``, where ple_ops puts the buffers it shares with its CPU process.

    Parameters
    ----------
    ple_bytes : int
        Bytes the PLE runtime will place there (slots, flags, control block); 0 only reports.
    path : str
        The tmpfs to check.

    Returns
    -------
    CheckResult
        ``fail`` with the command that grows it if ``ple_bytes`` exceeds the free space.
    """
    name = path
    ple_bytes = index("check_shm", "ple_bytes", ple_bytes)
    if not os.path.isdir(path):
        return CheckResult(
            name,
            "warn",
            f"{path} does not exist: ple_ops puts its shared buffers in {tempfile.gettempdir()} instead",
            "mount a tmpfs there: mount -t tmpfs -o size=8G tmpfs /dev/shm",
        )
    st = os.statvfs(path)
    free, size = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    have = f"{fmt_bytes(free)} free of {fmt_bytes(size)}"
    if ple_bytes == 0:
        return CheckResult(name, "ok", f"{have} (pass --ple-bytes to check a plan against it)")
    if ple_bytes > free:
        # What is in use stays in use; the new size must hold it and the plan.
        need_gib = -(-(size - free + ple_bytes) // (1 << 30))
        return CheckResult(
            name,
            "fail",
            f"PLE needs {fmt_bytes(ple_bytes)} but {path} has {have}",
            f"grow it to at least {need_gib} GiB: docker run --shm-size={need_gib}g ..., or "
            f"sudo mount -o remount,size={need_gib}G {path} (Kubernetes: an emptyDir volume with medium: Memory)",
        )
    return CheckResult(name, "ok", f"PLE needs {fmt_bytes(ple_bytes)}; {have}")


# --- check: O_DIRECT, one line per --dir ---------------------------------------------------------


def check_o_direct(directory: str) -> CheckResult:
    """Whether files in ``directory`` take O_DIRECT I/O, which the disk tier's ``BlockFile`` uses.

    Creates a private file (``O_EXCL | O_NOFOLLOW``, mode 0600) with ``O_DIRECT``, unlinks it at
    once, then writes 4 KiB from a page-aligned buffer and reads it back. (``BlockFile`` itself
    prefers an unnamed ``O_TMPFILE`` and sets ``O_DIRECT`` after; the file system's answer is
    the same.) Nothing is left behind, whatever fails.

    Parameters
    ----------
    directory : str
        A candidate ``disk_dir`` for :class:`kv_ops.OffloadEngine`.

    Returns
    -------
    CheckResult
        ``warn`` if the file system refuses O_DIRECT (``EINVAL``: use ``page_cache=True``),
        ``fail`` if no file can be made or written there.
    """
    # An empty name would put the probe file in the working directory.
    directory = path_argument("check_o_direct", "directory", directory)
    name = f"O_DIRECT {directory}"
    if not hasattr(os, "O_DIRECT"):
        return CheckResult(name, "skip", "this platform has no O_DIRECT", "pass page_cache=True to OffloadEngine")
    path = os.path.join(directory, f".kv_ops-doctor.{os.getpid()}.{secrets.token_hex(8)}")
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECT
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as e:
        return _o_direct_error(name, directory, "create a file", e)
    unlinked = False
    try:
        os.unlink(path)
        unlinked = True
        with mmap.mmap(-1, ALIGN) as out, mmap.mmap(-1, ALIGN) as back:
            pattern = secrets.token_bytes(ALIGN)
            out[:] = pattern
            written = os.pwrite(fd, out, 0)
            if written != ALIGN:
                return CheckResult(name, "fail", f"short O_DIRECT write: {written} of {ALIGN} bytes")
            read = os.preadv(fd, [back], 0)
            if read != ALIGN or back[:] != pattern:
                return CheckResult(
                    name, "fail", f"O_DIRECT read back {read} bytes that differ from the {ALIGN} written"
                )
    except OSError as e:
        return _o_direct_error(name, directory, "write and read 4 KiB", e)
    finally:
        os.close(fd)
        if not unlinked:
            with contextlib.suppress(OSError):
                os.unlink(path)
    st = os.statvfs(directory)
    return CheckResult(
        name, "ok", f"4 KiB aligned O_DIRECT write and read back; {fmt_bytes(st.f_bavail * st.f_frsize)} free"
    )


def _o_direct_error(name: str, directory: str, what: str, e: OSError) -> CheckResult:
    if e.errno == errno.EINVAL:
        return CheckResult(
            name,
            "warn",
            "no O_DIRECT here: pass page_cache=True to OffloadEngine",
            f"OffloadEngine(..., disk_dir={directory!r}, page_cache=True), or a directory on a local ext4/xfs disk",
        )
    if e.errno == errno.ENOENT and not os.path.isdir(directory):
        return CheckResult(
            name, "fail", f"{directory} does not exist", f"mkdir -p {directory}, or pass an existing directory"
        )
    if e.errno == errno.ENOTDIR:
        return CheckResult(name, "fail", f"{directory} is not a directory", "pass a directory")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return CheckResult(
            name, "fail", f"cannot {what} in {directory}: {e.strerror}", "pass a directory this user can write"
        )
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return CheckResult(
            name, "fail", f"cannot {what} in {directory}: {e.strerror}", "free space there, or pass another directory"
        )
    return CheckResult(name, "fail", f"cannot {what} in {directory}: {e.strerror or e}")
