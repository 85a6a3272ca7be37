"""CUDA-graph capture for kv_ops and ple_ops: whether one is under way, the one refusal of what it must not record.

And :func:`captured_into`, the ops' own captures.
"""

from __future__ import annotations

import contextlib
import gc

import torch

from .driver import stream_is_capturing


def capturing(device: torch.device | None = None, stream: torch.cuda.Stream | None = None) -> bool:
    """Whether a CUDA graph is being captured: on ``stream`` if given (whichever stream is
    current), else on the current stream; never for a CPU ``device``, which nothing captures."""
    if stream is not None:
        return stream_is_capturing(stream)
    if device is not None and device.type != "cuda":
        return False
    return torch.cuda.is_current_stream_capturing()


def refuse_capture(
    who: str,
    what: str,
    instead: str,
    *,
    device: torch.device | None = None,
    stream: torch.cuda.Stream | None = None,
    error: type[Exception] = RuntimeError,
) -> None:
    """Raise ``error("{who}: {what}; {instead}")`` while :func:`capturing` (``device``, ``stream``).

    Work that a capture would record but not do (host bookkeeping, a copy whose ids change, a
    driver call the capture rejects) is refused here, before anything is enqueued: ``what``
    says what was refused, ``instead`` what to do.

    Examples
    --------
    >>> refuse_capture("kv_ops.dma", "the DMA path cannot be captured into a CUDA graph", "use kv_ops.copy_blocks", stream=s)
    """
    if capturing(device, stream):
        raise error(f"{who}: {what}; {instead}")


@contextlib.contextmanager
def captured_into(graph: torch.cuda.CUDAGraph):
    """Capture the work enqueued on the current stream inside the block into ``graph``: the ops'
    own graphs, made once at set-up.

    ``capture_begin``/``capture_end`` rather than ``torch.cuda.graph``, which collects garbage
    and empties torch's cache first (tens of milliseconds per graph, and an engine makes
    hundreds). Thread-local, so other threads' CUDA calls stay legal meanwhile. With the
    garbage collector off: a collection inside the capture can destroy an old ``CUDAGraph``,
    whose teardown frees memory, which the driver refuses during a capture, and the capture is
    then invalidated, which grows likely once a process holds hundreds of old graphs.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            yield graph
        finally:
            graph.capture_end()
    finally:
        if enabled:
            gc.enable()


__all__ = ["capturing", "refuse_capture", "captured_into"]
