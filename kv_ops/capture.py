"""Whether a CUDA graph is being captured, and the one refusal of work that must not be captured."""

from __future__ import annotations

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


__all__ = ["capturing", "refuse_capture"]
