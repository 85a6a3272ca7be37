"""The offload runtime's one reach into multiprocessing's private names, with why and what would break it."""

from __future__ import annotations

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


__all__ = ["reaped"]
