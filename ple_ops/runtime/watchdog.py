"""The runtime's watchdog: the thread that frees GPU streams no prepared step will serve, and fails the runtime."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Protocol

from .. import reference
from ..semaphore import RESET, WAITING
from .control import ControlBlock, Phase, Word
from .process import RuntimeLayer

POLL = 0.005  # seconds between two looks of the watchdog
# A stream must look stuck (waiting on a reset flag that no prepared step will raise) on looks at
# least this far apart before the runtime acts: the words are read one by one, not atomically.
STUCK_GRACE = 0.05


class Watched(Protocol):
    """What the watchdog reads and does: the runtime's :class:`~ple_ops.runtime.process.WorkerProcess`."""

    control: ControlBlock
    layers: Sequence[RuntimeLayer]
    step_timeout: float
    prepared_at: float  # monotonic time the last requested step was prepared

    def collect(self) -> None:
        """Drain the pipe (step failures, the process's own failure)."""

    def stopped(self) -> bool:
        """Whether the runtime failed or is closing."""

    def gone(self) -> str | None:
        """Why the offload process can serve no more, else ``None`` (asks whether it lives)."""

    def is_alive(self) -> bool:
        """Whether the offload process lives."""

    def fail(self, reason: str) -> None:
        """Fail the runtime: stop the producer, poison every slot, raise every flag."""


class Watchdog:
    """Every :data:`POLL` seconds, on its own thread: drain the runtime's pipe, and fail the runtime
    when the offload process died or failed, a step is late past ``step_timeout``, or a GPU stream
    waits on a flag that no prepared step will raise; once the runtime failed or closed, free any
    stream that still waits (poisoned rows, raised flag).

    It reads and acts through :class:`Watched` alone; it fails the runtime through
    ``Watched.fail``, the one place that stops the producer, poisons and raises.
    """

    def __init__(self, watched: Watched):
        self._watched = watched
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ple-offload-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        """End the thread (it finishes its current look), waiting at most ``timeout`` seconds.

        ``OffloadRuntime.close`` calls it; tests call it to see what the runtime notices without
        its watchdog.
        """
        self._stopping.set()
        self._thread.join(timeout)

    def _watch(self) -> None:
        rt = self._watched
        stuck: dict[int, tuple[float, int]] = {}
        while not self._stopping.wait(POLL):
            try:
                rt.collect()
                if rt.stopped():
                    self._unblock_waiters()
                    continue
                reason = self._failure_reason(stuck)
                if reason is not None:
                    rt.fail(reason)
            except Exception as exc:  # never let the watchdog die silently
                if not rt.stopped():
                    rt.fail(f"the offload watchdog failed: {exc!r}")

    def _failure_reason(self, stuck: dict[int, tuple[float, int]]) -> str | None:
        rt = self._watched
        gone = rt.gone()
        if gone is not None:
            return gone
        control = rt.control
        request = control.get(Word.REQUEST)  # before prepared_at: prepare() writes them in the other order
        if control.get(Word.SERVED) < request and time.monotonic() - rt.prepared_at > rt.step_timeout:
            return self._late_reason()
        now = time.monotonic()
        for layer in rt.layers:
            i = layer.index
            # delivered first: the worker raises the flag before it writes delivered, so a reset
            # flag read after "delivered == request" was consumed by a stream, not yet-to-come.
            if (
                control.delivered(i) == request
                and layer.flag.host_value() == RESET
                and control.waiting[i].host_value() == WAITING
                and control.get(Word.REQUEST) == request
            ):
                since, seen_request = stuck.setdefault(i, (now, request))
                if seen_request != request:
                    stuck[i] = (now, request)
                elif now - since >= STUCK_GRACE:
                    return (
                        f"a GPU stream waits for layer {layer.name!r}'s rows but no prepared step will produce "
                        "them: prepare() was missing (a forward or CUDA-graph replay without prepare(), a second "
                        "replay after one prepare(), or release() after a graph that already released the step). "
                        "The runtime poisoned the rows and raised the flags so that the stream could go on"
                    )
            else:
                stuck.pop(i, None)
        return None

    def _late_reason(self) -> str:
        rt = self._watched
        control = rt.control
        index, phase = control.get(Word.WORKER_LAYER), control.get(Word.WORKER_PHASE)
        name = rt.layers[index].name if 0 <= index < len(rt.layers) else "?"
        base = f"the offload process did not serve step {control.get(Word.REQUEST)} within step_timeout {rt.step_timeout} s"
        if phase == Phase.AWAITING_RESET:
            return (
                f"{base}: it waits for layer {name!r}'s flag to be reset by the previous step's release, which never "
                "ran (a release(enqueue=False) after a graph without the releases, or a GPU stream that stopped?)"
            )
        if phase == Phase.COMPUTING:
            return f"{base}: layer {name!r}'s forward_impl is still running"
        return base

    def _unblock_waiters(self) -> None:
        """After a failure or during close: raise, over poison, any flag a stream waits on."""
        rt = self._watched
        if rt.is_alive():
            return  # close() is still stopping the worker, which may yet write the slots
        for layer in rt.layers:
            if rt.control.waiting[layer.index].host_value() == WAITING and layer.flag.host_value() == RESET:
                reference.poison_rows(layer.armed.slot)
                layer.flag.host_signal()


__all__ = ["Watchdog", "Watched", "POLL", "STUCK_GRACE"]
