"""What a transfer is ordered after: ``after=``, or the work on the caller's current stream, as one event."""

from __future__ import annotations

import torch

from ..cuda.capture import refuse_capture
from ..cuda.driver import current_stream_handle, driver_context, record_event
from .blocks import Direction


class Ordering:
    """An engine's ready events: bound once to its device and copy streams (None on the CPU)."""

    def __init__(self, device: torch.device, streams: dict[Direction, torch.cuda.Stream] | None):
        self.device = device
        self.streams = streams
        self.event = None
        if streams is not None:
            # Recorded once here, so that it exists: each call then records it with one driver call.
            self.event = torch.cuda.Event()
            self.event.record(streams[Direction.STORE])

    def ready(self, op: str, after, fresh: bool) -> torch.cuda.Event | None:
        """The event the transfer waits for: ``after`` itself, or recorded now on ``after`` (a
        stream) or on the caller's current stream. Nothing blocks the caller's thread.

        The paths wait on it before this call returns, so one event serves every call: a wait
        holds the record before it, whatever is recorded afterwards. A path that waits later
        (``fresh_ready``: the disk tier, on its I/O thread) gets a ``fresh`` event of its own.
        """
        if self.streams is None:
            if after is not None:
                raise ValueError(f"{op}: after= orders GPU work; this engine's cache is on {self.device}")
            return None
        if isinstance(after, torch.cuda.Event):
            return after
        if after is None:
            if not fresh:  # the common case, in one driver call: no Stream object is made
                with driver_context(self.device):
                    record_event(self.event, current_stream_handle(self.device.index))
                return self.event
            stream = torch.cuda.current_stream(self.device)  # the engine refused it if capturing
        elif not isinstance(after, torch.cuda.Stream):
            raise ValueError(
                f"{op}: after must be a torch.cuda.Event, a torch.cuda.Stream or None, got {type(after).__name__}"
            )
        elif after.device != self.device:
            raise ValueError(f"{op}: after is a stream of {after.device}, but the engine's cache is on {self.device}")
        else:
            # Waiting on an event recorded there would pull the engine's streams into the capture:
            # the copy would run at the graph's replays, not now, with none of this call's bookkeeping.
            refuse_capture(
                op,
                "after is a stream being captured into a CUDA graph",
                "order the transfer after the captured work once the graph is replayed (record an event after the replay)",
                stream=after,
            )
            stream = after
        ready = torch.cuda.Event() if fresh else self.event
        ready.record(stream)
        return ready


__all__ = ["Ordering"]
