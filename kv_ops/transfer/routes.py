"""Where an engine's transfers go: its host mirror or disk tier, and per KV group the paths it may take.

Made once, at the engine's start: the mirror (allocated, or adopted from ``host_buffer``), the
disk tier's path, and per group the mirror paths with what ``auto`` measured for the group's
widths. A call then picks among its group's paths (:func:`pick`), refused with words where it
names no group of the engine (:func:`bad_group`) or gives GPU ids to a path that cannot take
them (:func:`refuse_gpu_ids`)."""

from __future__ import annotations

import os
from collections.abc import Hashable, Mapping

import numpy as np
import torch

from ..cuda.host_memory import pinned_empty, register_host
from . import crossover as crossover_mod
from .blocks import Blocks, Direction
from .disk import DiskPath
from .paths import COPY_ENGINES, PATH_NAMES, TransferPath, make_paths

Route = tuple[dict[str, TransferPath], "crossover_mod.Crossover | None"]


def crossover_file_of(crossover_file: str | None, shape: int) -> str | None:
    """Where auto's measurement of an engine's ``shape``-th distinct group shape is kept: the
    file itself for the first, ``name.<shape>.ext`` beside it for the others (one file holds one
    shape's measurement)."""
    if crossover_file is None or shape == 0:
        return crossover_file
    stem, ext = os.path.splitext(crossover_file)
    return f"{stem}.{shape}{ext}"


def measured(
    device: torch.device, groups: Mapping[Hashable, tuple], ring_bytes: int, crossover_file: str | None
) -> dict[tuple, crossover_mod.Crossover]:
    """What ``auto`` measured for each distinct widths of ``groups`` (group -> ``((region, bytes),
    ...)``), by widths, with its picks planned."""
    crossovers: dict[tuple, crossover_mod.Crossover] = {}
    shapes = dict.fromkeys(groups.values())
    widths = list(dict.fromkeys(tuple(w for _, w in entries) for entries in shapes))
    for i, shape in enumerate(widths):
        found = crossover_mod.crossover(device, list(shape), ring_bytes, crossover_file_of(crossover_file, i))
        found.plan_picks(COPY_ENGINES)  # not at the first call of each size
        crossovers[shape] = found
    return crossovers


def host_mirror(host_buffer: torch.Tensor | None, rows: int, width: int) -> tuple[torch.Tensor, object]:
    """The mirror ``[rows, width]``, and the registration of an adopted ``host_buffer`` (None when
    the mirror is allocated here)."""
    if host_buffer is None:
        return pinned_empty((rows, width)), None
    # Adopted, never freed here: registered for the GPU (unless page-locked already) and
    # unregistered on close.
    registration = register_host("OffloadEngine", host_buffer)
    return host_buffer.view(-1)[: rows * width].view(rows, width), registration


def mirror_routes(engine, streams, events, path: str, ring_bytes: int, crossover_file) -> dict[Hashable, Route]:
    """Per group of ``engine`` (its public ``groups``, ``regions``, ``mirror``, ``mirror_regions``),
    its paths over the engine's ``streams`` and ``events``, and what ``auto`` measured for its widths.

    Groups with the same entries share one set of paths (vLLM's groups often overlay the same
    tensors), and groups of the same widths one measurement."""
    crossovers = {}
    if engine.device.type == "cuda" and path == "auto":
        # First: the measurement's scratch rings are then back in torch's cache when the
        # engine's own are allocated below.
        crossovers = measured(engine.device, engine.groups, ring_bytes, crossover_file)
    # Only the paths this engine may pick: on the GPU each binds its kernels now, and the
    # staged one allocates its ring (2 x ring_bytes), so that memory is taken at start;
    # every group's staged path shares the first one's ring.
    names = PATH_NAMES if path == "auto" else (path,)
    made: dict[tuple, Route] = {}
    for entries in dict.fromkeys(engine.groups.values()):
        gpu = [engine.regions[name][:, :width] for name, width in entries]
        host = [engine.mirror_regions[name][:, :width] for name, width in entries]
        first = next(iter(made.values()), ({}, None))[0].get("staged")
        paths = make_paths(gpu, engine.mirror, streams, ring_bytes, names, events, host, first)
        made[entries] = (paths, crossovers.get(tuple(w for _, w in entries)))
    return {key: made[entries] for key, entries in engine.groups.items()}


def disk_path(engine, streams, disk_dir, disk_tag, page_cache, staging_slots, staging_blocks) -> DiskPath:
    """The disk tier's path over ``engine``'s regions and host blocks (its file slots). Held only
    by the engine: once it is collected, so is the path, whose finalizer then stops the I/O
    thread and closes the file."""
    tag = disk_tag or f"{engine.device.type}{engine.device.index or 0}"
    return DiskPath(
        engine.regions,
        disk_dir,
        tag,
        engine.block_bytes,
        engine.num_host_blocks,
        page_cache,
        streams,
        int(staging_slots),
        int(staging_blocks),
    )


def bad_group(op: str, group, routes: Mapping[Hashable, Route]) -> str:
    """Why ``group`` is no key of ``routes`` (an engine's), in words that name ``op``."""
    if None in routes:
        return f"{op}: group={group!r}, but this engine was made without groups: leave group out"
    known = ", ".join(map(repr, routes))
    return f"{op}: group={group!r} is not one of this engine's groups ({known})"


def pick(name: str, blocks: Blocks, paths: dict[str, TransferPath], measured, lanes: Mapping) -> TransferPath:
    """The path of a call: the engine's ``path`` (``name``), or with ``auto`` the one ``measured``
    picks for ``blocks``, by the single-call rates if none of the engine's ``lanes`` has a
    transfer in flight (a call's host time is then all on its critical path)."""
    if name == "auto":
        name = None
        if not blocks.on_host:
            name = "kernel"  # the one path whose kernel reads both sides' ids
        elif measured is not None:
            alone = not (lanes[Direction.STORE].in_flight() or lanes[Direction.LOAD].in_flight())
            # The runs are counted only where the pick depends on them.
            name = measured.pick(blocks.direction, blocks.count, lambda: blocks.num_runs, COPY_ENGINES, alone)
        name = name or "kernel"  # nothing measured (a CPU engine): the reference copy
    return paths[name]


def refuse_gpu_ids(op: str, blocks: Blocks, path: TransferPath) -> None:
    """GPU ids are never read by the host (that would wait for the caller's stream): only a
    path whose kernel reads them takes them."""
    for what, ids in (("gpu_ids", blocks.gpu_ids), ("host_ids", blocks.host_ids)):
        if what in path.host_planned and not isinstance(ids, np.ndarray):
            raise ValueError(
                f"{op}: {what} is a {ids.device} tensor, but {path.label} plans its copies on the host, which "
                "would have to wait for the GPU to read it; pass host ids (a list, an array or a CPU tensor)"
            )


__all__ = [
    "Route",
    "crossover_file_of",
    "measured",
    "host_mirror",
    "mirror_routes",
    "disk_path",
    "bad_group",
    "pick",
    "refuse_gpu_ids",
]
