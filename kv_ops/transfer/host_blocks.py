"""Which of an engine's host blocks are free: ``HostBlockAllocator`` hands them out in runs, by best fit."""

from __future__ import annotations

import bisect

import numpy as np
import torch

from ..cuda.arguments import positive_int
from . import ids as intake

_CPU = torch.device("cpu")


class OutOfHostBlocksError(MemoryError):
    """Fewer host blocks are free than were asked for: a valid request that cannot be met now.

    A ``MemoryError``, not a ``ValueError``: a scheduler catches it and frees blocks (or waits
    for a transfer to be reported) and asks again, while a ``ValueError`` is a caller's slip.
    """


class HostBlockAllocator:
    """Hands out host block ids ``[0, num_blocks)`` in runs of consecutive ids, and takes them back.

    Behind a GPU ring, a run of consecutive host ids moves as one copy-engine descriptor (the
    staged path; one 2-D copy per layer in a staged layer-wise load) where scattered ids need one
    per block, so the allocator keeps the free blocks as few, long runs:

    * :meth:`allocate` ``(n)`` takes the *best fit*: the shortest free run that holds all ``n``
      (the lowest such run on a tie), from its start, so longer runs stay whole for larger
      requests. When no single run holds ``n``, it takes the longest runs whole, longest first,
      until what is left fits in one run, and that rest again by best fit: as few pieces as the
      free space allows. Fewer than ``n`` free blocks in all is :class:`OutOfHostBlocksError`.
    * :meth:`free` gives ids back; a freed block joins the free runs beside it, so once
      everything is free there is one run of every block again.

    The free runs are kept sorted twice, by first id and by (length, first id), in Python lists
    searched by bisection: a call costs a few searches and list inserts per piece it hands out or
    takes back, plus numpy work on its ids, never a Python loop over blocks. A scheduler's calls
    are short, where numpy's per-call cost would dominate. Not thread-safe: one scheduler owns it.
    """

    def __init__(self, num_blocks):
        self.num_blocks = positive_int("HostBlockAllocator", "num_blocks", num_blocks)
        self.num_free = self.num_blocks
        self._starts: list[int] = []  # each free run's first id, ascending
        self._length: dict[int, int] = {}  # first id -> the run's length (>= 1)
        self._by_size: list[tuple[int, int]] = []  # (length, first id), ascending
        self._add(0, self.num_blocks)

    def _add(self, start: int, length: int) -> None:
        bisect.insort(self._starts, start)
        self._length[start] = length
        bisect.insort(self._by_size, (length, start))

    def _remove(self, start: int) -> int:
        """Take the free run that begins at ``start`` out of both lists; returns its length."""
        del self._starts[bisect.bisect_left(self._starts, start)]
        length = self._length.pop(start)
        del self._by_size[bisect.bisect_left(self._by_size, (length, start))]
        return length

    def _shortest_holding(self, n: int) -> int:
        """The first id of the shortest free run of at least ``n`` blocks, the lowest among equals."""
        return self._by_size[bisect.bisect_left(self._by_size, (n, -1))][1]

    @property
    def largest_run(self) -> int:
        """The most blocks one :meth:`allocate` can hand out as a single run now (0 when none is free)."""
        return self._by_size[-1][0] if self._by_size else 0

    def free_runs(self) -> list[tuple[int, int]]:
        """The free runs as ``(first id, length)``, lowest first; no two touch."""
        return [(start, self._length[start]) for start in self._starts]

    def allocate(self, n) -> np.ndarray:
        """``n`` free host block ids as an ascending int64 array, taken by the rule in the class
        docstring (one run whenever a free run holds ``n``); :class:`OutOfHostBlocksError` when
        fewer than ``n`` are free, a ``ValueError`` when ``n`` is not a positive integer."""
        n = positive_int("HostBlockAllocator.allocate", "n", n)
        if n > self.num_free:
            raise OutOfHostBlocksError(
                f"HostBlockAllocator.allocate: {n} blocks asked for, but only {self.num_free} of "
                f"{self.num_blocks} are free"
            )
        pieces, rest = [], n
        while self._by_size[-1][0] < rest:  # no run holds the rest: the longest goes whole
            start = self._shortest_holding(self._by_size[-1][0])  # the lowest of the longest
            length = self._remove(start)
            pieces.append((start, length))
            rest -= length
        start = self._shortest_holding(rest)
        length = self._remove(start)
        if length > rest:
            self._add(start + rest, length - rest)
        self.num_free -= n
        if not pieces:
            return np.arange(start, start + n, dtype=np.int64)
        pieces.append((start, rest))
        return np.concatenate([np.arange(first, first + count, dtype=np.int64) for first, count in sorted(pieces)])

    def free(self, ids) -> None:
        """Give back ``ids`` (a list, a 1-D int32/int64 array or CPU tensor) handed out by
        :meth:`allocate`, in any order and in any grouping. A ``ValueError`` naming ``ids`` and the
        block, with nothing freed, for an id outside ``[0, num_blocks)``, one named twice, or one
        that is free already (never handed out, or freed before)."""
        op = "HostBlockAllocator.free"
        if isinstance(ids, torch.Tensor) and not ids.is_cpu:
            raise ValueError(f"{op}: ids must be on the CPU, got a tensor on {ids.device}")
        ordered = np.sort(intake.take(op, "ids", ids, self.num_blocks, True, _CPU))
        if ordered.size == 0:
            return
        first, last = int(ordered[0]), int(ordered[-1])
        if last - first + 1 == ordered.size:  # distinct ids spanning no more than their count: one run
            pieces = [(first, ordered.size)]
        else:
            heads = np.flatnonzero(np.diff(ordered, prepend=-2) != 1)
            pieces = list(zip(ordered[heads].tolist(), np.diff(heads, append=ordered.size).tolist()))
        starts = self._starts
        for first, length in pieces:  # all checked before anything is freed
            before = bisect.bisect_right(starts, first) - 1  # the free run at or before the piece
            if before >= 0 and starts[before] + self._length[starts[before]] > first:
                raise ValueError(f"{op}: ids holds block {first}, which is free already (not handed out)")
            if before + 1 < len(starts) and starts[before + 1] < first + length:
                raise ValueError(f"{op}: ids holds block {starts[before + 1]}, which is free already (not handed out)")
        for first, length in pieces:  # each joins the free runs that touch it
            before = bisect.bisect_right(starts, first) - 1
            if before >= 0 and starts[before] + self._length[starts[before]] == first:
                first = starts[before]
                length += self._remove(first)
            if first + length in self._length:
                length += self._remove(first + length)
            self._add(first, length)
        self.num_free += ordered.size


__all__ = ["HostBlockAllocator", "OutOfHostBlocksError"]
