"""One transfer (its direction and block ids) and the completion events and copy streams every path shares."""

from __future__ import annotations

import enum
import functools
from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

from ..cuda.driver import record_event
from . import dma


class Direction(enum.Enum):
    STORE = "store"  # GPU cache -> host mirror
    LOAD = "load"  # host mirror -> GPU cache


class Blocks:
    """One transfer: GPU block ``gpu_ids[i]`` <-> mirror row ``host_ids[i]``, ids checked.

    Each side is a 1-D int64 numpy array, or an int64 tensor on the engine's GPU, which the host
    never reads (the kernel path takes both sides there, the staged path ``gpu_ids``); then
    ``ids_ready`` is an event after the work that wrote them. ``runs`` is
    :func:`kv_ops.dma.run_starts` of the pairs and ``num_runs`` their count, found on first use.
    """

    __slots__ = ("direction", "gpu_ids", "host_ids", "ids_ready", "__dict__")

    def __init__(self, direction: Direction, gpu_ids, host_ids, ids_ready: torch.cuda.Event | None = None):
        self.direction = direction
        self.gpu_ids = gpu_ids
        self.host_ids = host_ids
        self.ids_ready = ids_ready

    @classmethod
    def of(cls, direction: Direction, gpu_ids, host_ids) -> "Blocks":
        """From host ids of any form (CPU tensors, arrays), as int64 numpy arrays."""
        return cls(direction, dma.host_array(gpu_ids), dma.host_array(host_ids))

    @property
    def count(self) -> int:
        return len(self.gpu_ids)

    @property
    def on_host(self) -> bool:
        """Both sides are host arrays (the copy-engine plans need them)."""
        return isinstance(self.gpu_ids, np.ndarray) and isinstance(self.host_ids, np.ndarray)

    @functools.cached_property
    def runs(self) -> tuple[np.ndarray, np.ndarray]:
        return dma.run_starts(self.gpu_ids, self.host_ids)

    @functools.cached_property
    def num_runs(self) -> int:
        """How many runs ``runs`` has, counted with fewer operations (auto's pick needs only this)."""
        return dma.count_runs(self.gpu_ids, self.host_ids)

    def sides(self, gpu, host):
        """(src, dst, src_ids, dst_ids) for this direction, given the GPU and the host side."""
        if self.direction is Direction.STORE:
            return gpu, host, self.gpu_ids, self.host_ids
        return host, gpu, self.host_ids, self.gpu_ids


def mirror_views(mirror: torch.Tensor, widths: Sequence[int]) -> list[torch.Tensor]:
    """Region r's blocks in the mirror: columns ``[sum(widths[:r]), +widths[r])`` of every row."""
    views, column = [], 0
    for width in widths:
        views.append(mirror[:, column : column + width])
        column += width
    return views


def host_views(mirror: torch.Tensor, regions: Sequence[torch.Tensor], views=None) -> list[torch.Tensor]:
    """A path's host side: ``views`` where given (a KV group's columns of the mirror, one per
    region), else every region's columns in order (:func:`mirror_views`)."""
    return list(views) if views is not None else mirror_views(mirror, [r.shape[1] for r in regions])


def low_priority_streams(device: torch.device) -> dict[Direction, torch.cuda.Stream]:
    """One lowest-priority stream per direction: transfers yield to the model's kernels."""
    lowest, _ = torch.cuda.Stream.priority_range()  # numerically largest = lowest priority
    return {d: torch.cuda.Stream(device, priority=lowest) for d in Direction}


def recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


class Events:
    """One direction's completion events, reused once reported.

    The engine gives an event back when :meth:`OffloadEngine.poll` has seen it fire; a path then
    records it again with one driver call instead of making a new one. Whoever still holds an
    old reference (the engine's last transfer) can only over-wait on a later record, never
    under-wait, and every wait points at work issued before it. An id pool's reuse check must
    not over-wait (it would grow the pool, which synchronizes): it reads the event's
    ``records``.
    """

    def __init__(self):
        self._free: deque[torch.cuda.Event] = deque()

    def record(self, stream: torch.cuda.Stream, handle) -> torch.cuda.Event:
        """An event recorded now on ``stream`` (``handle``: its raw handle). Its ``records`` counts
        its records, so that a :class:`kv_ops.transfer.ids.Pool` holding it can tell that the
        record it waited for has run (see there)."""
        if self._free:
            event = self._free.pop()
            record_event(event, handle)
            event.records += 1
            return event
        event = recorded(stream)
        event.records = 1
        return event

    def give(self, event: torch.cuda.Event) -> None:
        self._free.append(event)


class EventPath:
    """What the three paths (and the layer-wise loads) answer alike: each waits on ``ready``
    before ``enqueue`` returns, and each transfer completes with an event from ``_events`` (the
    engine's :class:`Events`, per direction), which goes back there once reported."""

    fresh_ready = False  # the wait is enqueued before enqueue returns: the engine's one reused event serves
    _events: dict[Direction, Events]

    @property
    def label(self) -> str:
        return f"path={self.name!r}"

    def reported(self, direction: Direction, done: torch.cuda.Event | None) -> None:
        # Never an error: a launch that fails raises in enqueue, a device fault in the event's query.
        if done is not None:
            self._events[direction].give(done)

    def close(self) -> None:
        """Nothing to stop: the engine synchronizes its own copy streams."""


def host_tensor(ids) -> torch.Tensor:
    """Host ids for the CPU's reference copies (a view of the array, no copy)."""
    return torch.from_numpy(ids)


__all__ = [
    "Direction",
    "Blocks",
    "Events",
    "EventPath",
    "host_tensor",
    "host_views",
    "low_priority_streams",
    "mirror_views",
    "recorded",
]
