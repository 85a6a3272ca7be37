"""The offload runtime's reaches into multiprocessing's private and undocumented names, with why and what would break them."""

from __future__ import annotations

from multiprocessing import resource_tracker
from multiprocessing.process import BaseProcess


def reaped(process: BaseProcess) -> bool:
    """Whether ``process``'s exit status was collected (an attribute read, no system call)."""
    # Why: multiprocessing has no public call for this that makes no system call (exitcode polls
    # waitpid), and the liveness check runs on the hot path of every step; its Popen's returncode
    # stays None until a wait saw the exit. Breaks if CPython renames Process._popen (then this
    # raises AttributeError at the first check) or drops Popen.returncode (then this never reports
    # a death, and only the watchdog's poll notices one).
    popen = process._popen
    return popen is not None and getattr(popen, "returncode", None) is not None


def track_shm_file(name: str) -> None:
    """Have multiprocessing's resource tracker remove ``/dev/shm/<name>`` if this process dies
    holding it (SIGKILL included), as it does for ``multiprocessing.shared_memory``."""
    # Why: the tracker, a process of its own, is the one thing left to act once a killed process
    # cannot; shared_memory registers its segments with it the same way. It is undocumented.
    # Breaks if CPython renames resource_tracker.register or its "shared_memory" kind (then this
    # raises at the buffer's creation), or stops unlinking by shm_unlink (then a killed creator's
    # file stays, as it did before this call).
    resource_tracker.register("/" + name, "shared_memory")


def untrack_shm_file(name: str) -> None:
    """The file was removed by its owner: the tracker has nothing left to do for it."""
    resource_tracker.unregister("/" + name, "shared_memory")


__all__ = ["reaped", "track_shm_file", "untrack_shm_file"]
