"""Store and load, the engine's two sides: what differs between them, bound once, and the docstring they share."""

from __future__ import annotations

from dataclasses import dataclass

from .blocks import Direction
from .completion import Lane

# What a refused capture advises, unless the caller (load_through's) gives its own.
CAPTURE_ADVICE = "capture kv_ops.copy_blocks instead"


@dataclass(frozen=True)
class Side:
    """What differs between a store and a load, bound once: the direction, the name errors give
    and their advice under a capture, which ids are destinations (distinct), and its lane.
    :meth:`OffloadEngine.load_through` binds one more per caller: the load's lane, its name."""

    direction: Direction
    op: str
    instead: str
    gpu_unique: bool
    host_unique: bool
    lane: Lane


def engine_sides(lanes: dict[Direction, Lane]) -> tuple[Side, Side]:
    """An engine's store and load sides over its ``lanes``. Destinations must not repeat (which
    copy would win is undefined); sources may."""
    store = Side(Direction.STORE, "OffloadEngine.store", CAPTURE_ADVICE, False, True, lanes[Direction.STORE])
    load = Side(Direction.LOAD, "OffloadEngine.load", CAPTURE_ADVICE, True, False, lanes[Direction.LOAD])
    return store, load


# The docstring OffloadEngine.store and .load share; each names its source and destination.
TRANSFER_DOC = """Copy {source} blocks ``{src}[i]`` to {destination} blocks ``{dst}[i]``.

{ordering}

Parameters
----------
{src} : sequence of int, or 1-D int32/int64 numpy array or tensor
    Source {source} blocks{src_where}; may repeat.
{dst} : sequence of int, or 1-D int32/int64 numpy array or tensor
    Destination {destination} blocks{dst_where}; distinct, as many as ``{src}``.
after : torch.cuda.Event or torch.cuda.Stream, optional
    Order the copy after this event, or after the work enqueued on this stream so far,
    instead of after the caller's current stream. Not a stream being captured, nor an
    event recorded during a capture (a graph's work happens at its replays).
group : optional
    On an engine made with ``groups``, the group whose blocks these are (required there):
    only its regions' bytes move, on both sides. Left out on an engine without groups.

Returns
-------
int
    The transfer id, reported once by :meth:`poll`, :meth:`flush` or :meth:`close`.

Raises
------
ValueError
    Bad ids (not 1-D, not int32/int64, meta; host ids out of range, a repeated
    destination, a length mismatch), before any byte moves and without using up a
    transfer id; GPU ids given to a path or tier that plans on the host (``dma``, the
    disk tier, ``host_ids`` on ``staged``); a bad ``after``; a ``group`` that is not one
    of the engine's.
RuntimeError
    While the current stream or ``after`` is being captured into a CUDA graph.
ClosedError
    After :meth:`close`.
"""
GPU = ("GPU", "gpu_ids", " in ``[0, num_blocks)``")
HOST = ("host", "host_ids", " (disk-tier slots) in ``[0, num_host_blocks)``")


def transfer_doc(source: tuple, destination: tuple, ordering: str) -> str:
    """:data:`TRANSFER_DOC` for a copy from ``source`` to ``destination`` (:data:`GPU`, :data:`HOST`)."""
    (source, src, src_where), (destination, dst, dst_where) = source, destination
    return TRANSFER_DOC.format(
        source=source,
        src=src,
        src_where=src_where,
        destination=destination,
        dst=dst,
        dst_where=dst_where,
        ordering=ordering,
    )


STORE_DOC = transfer_doc(
    GPU,
    HOST,
    """The copy is ordered after ``after``, by default the work enqueued on the caller's current
stream before the call (the compute that wrote those blocks). Nothing blocks the
caller's thread.

Write to the GPU blocks again only after this store is reported by :meth:`poll` or
:meth:`flush`: until then, what the stored copy holds of a block written meanwhile is
undefined. (On the CPU the in-memory engine copies during the call and the disk tier
later, on its I/O thread: code that writes early works with one and not the other.)""",
)
LOAD_DOC = transfer_doc(
    HOST,
    GPU,
    """The copy into the GPU blocks is ordered after ``after``, by default the work enqueued on
the caller's current stream before the call (every reader of the destination blocks).
A load issued while a forward is queued would then wait for the whole forward; to
overlap with it, record an event after the last reader of these blocks and pass it.
Make the consumer wait for the load with :meth:`poll` before it reads the loaded blocks.""",
)


__all__ = [
    "Side",
    "engine_sides",
    "CAPTURE_ADVICE",
    "TRANSFER_DOC",
    "GPU",
    "HOST",
    "transfer_doc",
    "STORE_DOC",
    "LOAD_DOC",
]
