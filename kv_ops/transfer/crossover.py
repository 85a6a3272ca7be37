"""What ``path="auto"`` measured: each path's rates on the engine's own shape, and its pick.

The measurement copies scratch blocks shaped like the engine's (the same regions' widths, so the
same descriptors and the same gather), never the user's cache. For each path, direction, call
size (:data:`COUNTS` blocks, capped at :data:`MAX_CALL_BYTES`) and id pattern (random ids, or
runs of :data:`RUN` consecutive ids) it takes two rates:

* **sustained**: :data:`CALLS` calls issued back to back, as a serving engine issues a burst,
  the clock stopped when the last copy has finished. A call's host time hides behind the
  copies still in flight;
* **single**: one call from an idle device, from before the call until its copy has finished.
  The call's host time is on the critical path: the staged path costs more host time than the
  kernel path, so a single flushed call of 16-64 blocks of 1 MiB finishes
  sooner on the kernel path even where a burst moves faster staged. With it, **host**: the
  microseconds that call spent in ``enqueue``.

The sweep is short next to a serving process's life (figures: docs/measurements.md), but not
free (nor is the kernels' first compile in a fresh cache). It is done once per device, shape and process, and can be kept in a JSON file that the
user names.

The pick, in the nearest measured cell:

* a call behind others in flight: the fastest path by the sustained rate, except that a
  copy-engine path within :data:`TOLERANCE` of the fastest wins, because it leaves every SM to
  the model;
* a call that has the engine to itself (nothing in flight): of the paths within
  :data:`TOLERANCE` of the fastest single rate, the one with the least host time. The host is
  then the scarce part: its time is the serving loop's, and nothing hides it (docs/design.md).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field

import torch

from ..cuda.arguments import path as path_argument
from ..cuda.host_memory import pinned_empty
from .blocks import Blocks, Direction, low_priority_streams
from .paths import COPY_ENGINES, PATH_NAMES, make_paths

# Bumped when what is measured changes, so that a kept file of an older measurement is not used.
MEASUREMENT = 3
COUNTS = (4, 32, 256)
RUN = 16
CALLS = 4
MAX_CALL_BYTES = 64 << 20
TOLERANCE = 0.05
# Call sizes up to which :meth:`Crossover.pick` remembers whether the pick depends on the runs,
# and if so the pick of each run count (at most this many choices, once per size). Above it the
# runs are counted every call, and the choice for that count is kept (CHOICES_KEPT).
RUN_FREE_BLOCKS = 64
# How many (direction, blocks, runs, alone) choices :meth:`Crossover.pick` keeps before it starts
# over: a serving loop's calls repeat a few sizes, and a choice costs more host time than a lookup.
CHOICES_KEPT = 4096


@dataclass(frozen=True)
class Cell:
    """One measurement: ``path`` moved ``blocks`` blocks in ``runs`` runs per call, ``direction``,
    at ``gbps`` (sustained over back-to-back calls) and ``single_gbps`` (one call from an idle
    device, its host time included; None: not measured, the sustained rate stands in), and
    ``host_us``, the host microseconds of that one call (None: not measured)."""

    path: str
    direction: str
    blocks: int
    runs: int
    gbps: float
    single_gbps: float | None = None
    host_us: float | None = None

    def rate(self, alone: bool) -> float:
        """The rate that decides a call that has the engine to itself (``alone``) or not."""
        return self.single_gbps if alone and self.single_gbps is not None else self.gbps


@dataclass
class Crossover:
    """The measured cells of one engine shape, and the per-call choice they make.

    ``key`` names what was measured (device, widths, ring), so that a cached file is used only
    for the same shape on the same kind of device. The cells are complete when a crossover is
    made (:func:`measure` and :meth:`load` build them all first): the choice indexes them once.
    """

    key: dict
    cells: list[Cell] = field(default_factory=list)
    # Per direction, the measured points: (log2 blocks, log2 mean run length, the cells there).
    # Built on the first choice: every call makes one, so it must not rescan the cells.
    _grid: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # (direction, blocks, alone) -> the pick if every run count gives it, else "" (see pick()).
    _run_free: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # (direction, blocks, alone) -> the pick of each run count 1..blocks, where it depends on them.
    _by_runs: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # Above RUN_FREE_BLOCKS: (direction, blocks, runs, alone) -> the pick, or "" for none (see pick()).
    _chosen: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _points(self, direction: Direction) -> list[tuple[float, float, list[Cell]]]:
        points = self._grid.get(direction)
        if points is None:
            at: dict[tuple[int, int], list[Cell]] = {}
            for c in self.cells:
                if c.direction == direction.value:
                    at.setdefault((c.blocks, c.runs), []).append(c)
            points = [(math.log2(b), math.log2(b / r), cells) for (b, r), cells in at.items()]
            self._grid[direction] = points
        return points

    def _nearest(self, direction: Direction, blocks: int, runs: int) -> list[Cell]:
        """The cells (one per path) nearest to ``blocks`` blocks in ``runs`` runs: log scales of the
        call size and of the mean run length."""
        size = math.log2(max(blocks, 1))
        run = math.log2(max(blocks, 1) / max(runs, 1))
        nearest, best = [], math.inf
        for point_size, point_run, cells in self._points(direction):
            distance = abs(point_size - size) + abs(point_run - run)
            if distance < best:
                nearest, best = list(cells), distance
            elif distance == best:
                nearest += cells
        return nearest

    def choose(
        self, direction: Direction, blocks: int, runs: int, copy_engines: dict[str, bool], alone: bool = False
    ) -> str | None:
        """The path name for a call, from the nearest cell (the module docstring says why):
        ``alone`` (nothing else in flight), the least host time among the paths within
        :data:`TOLERANCE` of the fastest single-call rate; otherwise the fastest sustained
        rate, or a copy-engine path within :data:`TOLERANCE` of it (the fastest of those).
        Cells without host times (hand-made, or kept from an older measurement) decide alone
        as behind others, by the single rate. None where nothing was measured."""
        cells = [c for c in self._nearest(direction, blocks, runs) if c.path in copy_engines]
        if not cells:
            return None
        best = max(c.rate(alone) for c in cells)
        near = [c for c in cells if c.rate(alone) >= (1 - TOLERANCE) * best]
        if alone and all(c.host_us is not None for c in near):
            return max(near, key=lambda c: (-c.host_us, _first(c))).path
        engines = [c for c in near if copy_engines[c.path]]
        return max(engines or cells, key=lambda c: (c.rate(alone), _first(c))).path

    def pick(
        self, direction: Direction, blocks: int, runs, copy_engines: dict[str, bool], alone: bool = False
    ) -> str | None:
        """:meth:`choose` for a call of ``blocks`` blocks, asking ``runs()`` (its run count) only
        where the answer depends on it, and choosing once per answer. Up to
        :data:`RUN_FREE_BLOCKS` blocks, whether every run count gives one answer is found once
        per size, and where not, the answer of each run count (:meth:`plan_picks` finds them all
        at once); above, each choice is kept (up to :data:`CHOICES_KEPT` of them). Counting the
        runs costs less host time than a choice. ``copy_engines`` must be the same
        mapping at every call (the engine's)."""
        if blocks <= RUN_FREE_BLOCKS:
            key = (direction, blocks, alone)
            name = self._run_free.get(key)
            if name is None:
                name = self._find_run_free(direction, blocks, alone, copy_engines)
            if name:
                return name
            by_runs = self._by_runs[key]
            return by_runs[min(max(runs(), 1), len(by_runs)) - 1] or None
        key = (direction, blocks, runs(), alone)
        name = self._chosen.get(key)
        if name is None:
            if len(self._chosen) >= CHOICES_KEPT:
                self._chosen.clear()
            name = self._chosen[key] = self.choose(direction, blocks, key[2], copy_engines, alone) or ""
        return name or None

    def _find_run_free(self, direction: Direction, blocks: int, alone: bool, copy_engines: dict[str, bool]) -> str:
        """The pick of a ``blocks``-block call if every run count gives the same one, else ""
        (then the pick of each run count is kept in ``_by_runs``); kept in ``_run_free``. One
        choice per run count: for 64 blocks, 64 choices."""
        key = (direction, blocks, alone)
        answers = tuple(
            self.choose(direction, blocks, r, copy_engines, alone) or "" for r in range(1, max(blocks, 1) + 1)
        )
        name = answers[0] if len(set(answers)) == 1 else ""
        if not name:  # the runs matter (or nothing was measured: None whatever the runs)
            self._by_runs[key] = answers
        self._run_free[key] = name
        return name

    def plan_picks(self, copy_engines: dict[str, bool]) -> None:
        """Find, for every call size up to :data:`RUN_FREE_BLOCKS`, whether its pick depends on
        its runs, now instead of at the first call of each size. Found lazily, that first call
        paid one choice per run count (``blocks`` choices): in a serving loop, whose calls come
        in many sizes, many calls are some size's first. Planning every size costs once what
        those first calls would pay (figures: docs/measurements.md). An engine calls it once it has its crossover
        (engines of one shape share one, planned once)."""
        for direction in Direction:
            for alone in (False, True):
                for blocks in range(RUN_FREE_BLOCKS + 1):
                    if (direction, blocks, alone) not in self._run_free:
                        self._find_run_free(direction, blocks, alone, copy_engines)

    def table(self) -> str:
        """The measured cells as a markdown table, one row per (direction, blocks, runs), with the
        pick. Where single-call rates were measured, each path shows "sustained / single", and
        the pick of a call behind others in flight and of a call alone."""
        paths = [p for p in PATH_NAMES if any(c.path == p for c in self.cells)]
        singles = any(c.single_gbps is not None for c in self.cells)
        hosts = any(c.host_us is not None for c in self.cells)
        rate_head = ("GB/s, sustained / single" + (", host" if hosts else "")) if singles else "GB/s"
        pick_head = "auto picks, in flight / alone" if singles else "auto picks"
        lines = [
            "| direction | blocks | runs | " + " | ".join(f"{p} {rate_head}" for p in paths) + f" | {pick_head} |",
            "| --- | ---: | ---: | " + " | ".join("---:" for _ in paths) + " | --- |",
        ]
        keys = dict.fromkeys((c.direction, c.blocks, c.runs) for c in self.cells)
        for direction, blocks, runs in keys:
            at = {c.path: c for c in self.cells if (c.direction, c.blocks, c.runs) == (direction, blocks, runs)}
            engines = {p: COPY_ENGINES[p] for p in at}
            shown = [_shown(at.get(p), singles) for p in paths]
            pick = self.choose(Direction(direction), blocks, runs, engines)
            if singles:
                pick = f"{pick} / {self.choose(Direction(direction), blocks, runs, engines, alone=True)}"
            lines.append(f"| {direction} | {blocks} | {runs} | " + " | ".join(shown) + f" | {pick} |")
        return "\n".join(lines)

    def save(self, path: str) -> None:
        """Write the cells to ``path`` as JSON (atomically: a crash leaves the old file or none,
        and a write or rename that fails leaves no temporary file behind)."""
        path = path_argument("Crossover.save", "path", path)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump({"key": self.key, "cells": [asdict(c) for c in self.cells]}, f, indent=1)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path: str, key: dict) -> "Crossover | None":
        """The crossover kept in ``path`` if it was measured for ``key``; None if absent, unreadable
        or of another shape or device."""
        try:
            with open(path) as f:
                data = json.load(f)
            if not isinstance(data, dict) or data.get("key") != key:
                return None
            cells = [Cell(**c) for c in data["cells"]]
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None
        directions = {d.value for d in Direction}
        for c in cells:  # a hand-edited or damaged file must not reach the per-call choice
            counts = [v for v in (c.blocks, c.runs) if isinstance(v, int) and not isinstance(v, bool) and v >= 1]
            if c.path not in PATH_NAMES or c.direction not in directions or len(counts) != 2:
                return None
            rates = [c.gbps] if c.single_gbps is None else [c.gbps, c.single_gbps]
            if not all(isinstance(r, (int, float)) and math.isfinite(r) and r > 0 for r in rates):
                return None
            host = c.host_us
            if host is not None and not (isinstance(host, (int, float)) and math.isfinite(host) and host >= 0):
                return None
        return cls(key, cells) if cells else None


def _first(cell: Cell) -> int:
    """The tie-break of a choice: the path named first in PATH_NAMES."""
    return -PATH_NAMES.index(cell.path)


def _shown(cell: Cell | None, singles: bool) -> str:
    if cell is None:
        return "0.0"
    if not singles:
        return f"{cell.gbps:.1f}"
    host = "" if cell.host_us is None else f", {cell.host_us:.0f} us"
    return f"{cell.gbps:.1f} / {cell.rate(True):.1f}{host}"


def shape_key(device: torch.device, widths: list[int], ring_bytes: int) -> dict:
    """What a measurement depends on: what is measured, the device model, the region widths, the
    ring size, torch."""
    return {
        "measurement": MEASUREMENT,
        "device": torch.cuda.get_device_name(device),
        "widths": list(widths),
        "ring_bytes": int(ring_bytes),
        "torch": torch.__version__,
    }


def _call_ids(gen: torch.Generator, blocks: int, rows: int, runs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPU and host ids of one call: ``blocks`` pairs in ``runs`` runs, drawn from ``rows`` rows."""
    if runs == blocks:
        return torch.randperm(rows, generator=gen)[:blocks], torch.randperm(rows, generator=gen)[:blocks]
    length = blocks // runs
    starts = torch.randperm(rows // length, generator=gen)[:runs] * length
    gpu = (starts[:, None] + torch.arange(length)).flatten()
    starts = torch.randperm(rows // length, generator=gen)[:runs] * length
    return gpu, (starts[:, None] + torch.arange(length)).flatten()


def measure(device: torch.device, widths: list[int], ring_bytes: int, paths=PATH_NAMES) -> Crossover:
    """Time ``paths`` on scratch regions of ``widths`` over :data:`COUNTS` x patterns x directions."""
    row_bytes = sum(widths)
    cap = max(1, MAX_CALL_BYTES // row_bytes)
    counts = sorted({min(c, cap) for c in COUNTS})
    rows = 2 * counts[-1]  # random ids are then rarely consecutive
    gpu = [torch.randint(0, 256, (rows, w), dtype=torch.uint8, device=device) for w in widths]
    mirror = pinned_empty((rows, row_bytes))
    made = make_paths(gpu, mirror, low_priority_streams(device), ring_bytes)
    gen = torch.Generator().manual_seed(0)
    cells = []
    for name in paths:
        path = made[name]
        for direction in Direction:
            for blocks in counts:
                for runs in sorted({blocks, max(1, blocks // RUN)}):
                    calls = [Blocks.of(direction, *_call_ids(gen, blocks, rows, runs)) for _ in range(CALLS)]
                    seconds = _sustained(path, calls, device)
                    single, host = _single(path, calls, device)
                    moved = calls[0].count  # runs x (blocks // runs): what was really copied
                    rate, single_rate = (moved * row_bytes / t / 1e9 for t in (seconds, single))
                    cells.append(Cell(name, direction.value, moved, runs, rate, single_rate, host * 1e6))
    return Crossover(shape_key(device, widths, ring_bytes), cells)


def _sustained(path, calls: list[Blocks], device: torch.device, reps: int = CALLS) -> float:
    """Seconds per call, ``calls`` issued back to back until the last copy ends; best of ``reps``
    after a warm-up. As many samples as :func:`_single` takes: with fewer, one host hiccup per
    sample moves the sustained rate, and the pick with it."""
    best = math.inf
    for rep in range(reps + 1):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
        for blocks in calls:
            path.enqueue(blocks, ready)
        torch.cuda.synchronize(device)
        if rep:
            best = min(best, (time.perf_counter() - start) / len(calls))
    return best


def _single(path, calls: list[Blocks], device: torch.device) -> tuple[float, float]:
    """Seconds of one call from an idle device until its copy has finished (its host time
    included), and seconds of host time inside ``enqueue``: each the best over ``calls`` after
    a warm-up call."""
    best = host = math.inf
    ready = torch.cuda.Event()
    for i, blocks in enumerate([calls[0], *calls]):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        ready.record(torch.cuda.current_stream(device))
        path.enqueue(blocks, ready)
        issued = time.perf_counter()
        torch.cuda.synchronize(device)
        if i:
            best = min(best, time.perf_counter() - start)
            host = min(host, issued - start)
    return best, host


@functools.cache
def measured_once(device: torch.device, widths: tuple[int, ...], ring_bytes: int) -> Crossover:
    """:func:`measure`, once per process and shape (engines of one shape share it). Public so that
    tests stand in for the GPU measurement."""
    return measure(device, list(widths), ring_bytes)


def check_kept_file(owner: str, cache_file) -> str:
    """``cache_file`` (``crossover_file`` to the engine) as a ``str`` when a file can be kept there:
    a path that is not a directory, in a directory that exists; else a ``ValueError`` naming it.
    Checked before the measurement, which is not free and whose result a failed write would lose."""
    name = path_argument(owner, "crossover_file", cache_file)
    if os.path.isdir(name):
        raise ValueError(f"{owner}: crossover_file {cache_file!r} is a directory; name a JSON file (in it, say)")
    parent = os.path.dirname(os.path.abspath(name))
    if not os.path.isdir(parent):
        raise ValueError(
            f"{owner}: crossover_file {cache_file!r} is in {parent!r}, which is not a directory; create it first"
        )
    return name


def crossover(device: torch.device, widths: list[int], ring_bytes: int, cache_file: str | None = None) -> Crossover:
    """The crossover of this shape on ``device``: measured once per process (engines of one shape
    share it), or read from ``cache_file`` when it holds this shape's, and written there otherwise.
    A ``cache_file`` that no file can be written at is a ``ValueError`` before anything is measured."""
    if cache_file is not None:
        cache_file = check_kept_file("crossover", cache_file)
    key = shape_key(device, widths, ring_bytes)
    if cache_file is not None:
        kept = Crossover.load(cache_file, key)
        if kept is not None:
            return kept
    found = measured_once(device, tuple(widths), int(ring_bytes))
    if cache_file is not None:
        found.save(cache_file)
    return found


__all__ = [
    "Cell",
    "Crossover",
    "measure",
    "crossover",
    "check_kept_file",
    "shape_key",
    "COUNTS",
    "RUN",
    "TOLERANCE",
    "MEASUREMENT",
]
