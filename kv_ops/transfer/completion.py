"""What an engine reports done: ``Completed``, each direction's ``Lane``, ``AllRanks`` across ranks."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..cuda.arguments import positive_int
from .blocks import Direction
from .paths import TransferPath


@dataclass
class Completed:
    """What :meth:`OffloadEngine.poll` found finished since the last poll, in issue order.

    ``failed`` maps the id of a transfer that did not complete (a disk-tier I/O error) to its
    error; such an id never appears in ``stores`` or ``loads``. A failed store leaves its host
    blocks (file slots), and a failed load its GPU blocks, with undefined contents; every other
    transfer is unaffected.
    """

    stores: list[int] = field(default_factory=list)
    loads: list[int] = field(default_factory=list)
    failed: dict[int, BaseException] = field(default_factory=dict)


class Lane:
    """One direction: transfers in issue order, each with its path, what the path's ``enqueue``
    returned to complete with it (an event, or the disk tier's job; None: already complete),
    and what must live until it completes (GPU ids the transfer reads). The head is reported
    first, so nothing overtakes."""

    def __init__(self, direction: Direction):
        self.direction = direction
        self.pending: deque[tuple[int, TransferPath, object, object]] = deque()
        # The last transfer issued, kept once reported: its path and what it completes with.
        self.last: tuple[TransferPath, object] | None = None

    def add(self, tid: int, path: TransferPath, done, keep=None) -> None:
        self.last = (path, done)
        self.pending.append((tid, path, done, keep))

    def in_flight(self) -> bool:
        """Whether a transfer of this direction is still running. They complete in issue order,
        so the last one tells; a query only where some transfer is still unreported."""
        if not self.pending or self.last is None:
            return False
        done = self.last[1]
        return done is not None and not done.query()

    def clear(self) -> None:
        """Forget every transfer (the engine's close, once the copies are done or abandoned)."""
        self.pending.clear()
        self.last = None

    def poll(self, out: Completed, done_ids: list[int], wait: bool = False) -> None:
        while self.pending:
            tid, path, done, _ = self.pending[0]
            if done is not None and not done.query():
                if not wait:
                    return
                done.synchronize()
            self.pending.popleft()
            error = path.reported(self.direction, done)
            if error is None:
                done_ids.append(tid)
            else:
                out.failed[tid] = error


def collect(lanes: Mapping[Direction, Lane], wait: bool) -> Completed:
    """What ``lanes`` report now (``wait``: once every transfer has completed), stores first."""
    out = Completed()
    lanes[Direction.STORE].poll(out, out.stores, wait)
    lanes[Direction.LOAD].poll(out, out.loads, wait)
    return out


def pending_event(lanes: Iterable[Lane], tid: int) -> torch.cuda.Event | None:
    """The completion event of transfer ``tid`` while unreported (see
    :meth:`kv_ops.OffloadEngine.completion_event`); the last of each lane is looked at first."""
    last = (lane.pending[-1] for lane in lanes if lane.pending)
    for pending_tid, _, done, _ in itertools.chain(last, *(lane.pending for lane in lanes)):
        if pending_tid == tid:
            return done if isinstance(done, torch.cuda.Event) else None
    return None


def order_after(lanes: Iterable[Lane], stream: torch.cuda.Stream) -> None:
    """Make ``stream`` wait for the last transfer of each lane still unreported (see
    :meth:`kv_ops.OffloadEngine.order_after_transfers`)."""
    for lane in lanes:
        if not lane.pending or lane.last is None:
            continue  # every transfer of this direction has been reported: nothing to wait for
        done = lane.last[1]
        if isinstance(done, torch.cuda.Event):
            stream.wait_event(done)
        elif done is not None:  # the disk tier's completion: never on a mirror engine
            raise ValueError("OffloadEngine.order_after_transfers: a disk-tier transfer has no stream event")


class AllRanks:
    """Combines per-rank completion reports: a transfer counts as done once every rank reported it.

    With one engine per rank (tensor parallelism), transfer ``t`` of a step is the same logical
    store on every rank, but each rank finishes its own part at its own time. Feed each poll's
    reports of all ranks to :meth:`add` (or let :meth:`gather` all-gather them through
    ``torch.distributed``); what comes back is done everywhere, so the scheduler may free the
    GPU blocks or count the host copy as complete.

    Examples
    --------
    >>> combined = AllRanks(dist.get_world_size())
    >>> done = combined.gather(engine.poll())   # the same answer on every rank
    """

    def __init__(self, world_size: int):
        self.world_size = positive_int("AllRanks", "world_size", world_size)
        self._seen: dict[tuple[str, int], int] = {}

    def add(self, reports: Sequence[Completed]) -> Completed:
        """Count reports (each rank reports a transfer once, as ``poll`` does); return what is now
        done on every rank, sorted.

        ``reports`` is a list of one :class:`Completed` per rank (what :meth:`gather` all-gathers),
        else a ``ValueError``, before anything is counted: a report counted twice, or a rank's
        missing, would declare a transfer done that some rank is still running.
        """
        # One len and one isinstance per rank: a step's cost next to its poll.
        if (
            not isinstance(reports, (list, tuple))
            or len(reports) != self.world_size
            or not all(isinstance(report, Completed) for report in reports)
        ):
            raise ValueError(
                f"AllRanks.add: reports must be a list of one kv_ops.Completed per rank ({self.world_size}), "
                f"got {_described(reports)}"
            )
        out = Completed()
        for report in reports:
            out.failed.update(report.failed)  # failed on any rank: failed
            for kind, ids in (("store", report.stores), ("load", report.loads)):
                for tid in ids:
                    key = (kind, tid)
                    self._seen[key] = self._seen.get(key, 0) + 1
                    if self._seen[key] == self.world_size:
                        del self._seen[key]
                        (out.stores if kind == "store" else out.loads).append(tid)
        out.stores.sort()
        out.loads.sort()
        return out

    def gather(self, local: Completed, group=None) -> Completed:
        """All-gather this rank's report with every other rank's, then :meth:`add` them all."""
        import torch.distributed as dist

        reports: list[Completed | None] = [None] * self.world_size
        dist.all_gather_object(reports, local, group=group)
        return self.add(reports)


def _described(reports) -> str:
    """What :meth:`AllRanks.add` was handed, for its error: the list's length and entry types."""
    if not isinstance(reports, (list, tuple)):
        return type(reports).__name__
    kinds = ", ".join(sorted({type(report).__name__ for report in reports}))
    return f"{type(reports).__name__} of {len(reports)} ({kinds})" if reports else f"an empty {type(reports).__name__}"


__all__ = ["Completed", "Lane", "collect", "pending_event", "order_after", "AllRanks"]
