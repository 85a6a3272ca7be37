"""KV-cache groups: which regions' bytes each group of an engine moves, resolved and checked once."""

from __future__ import annotations

import numbers
from collections.abc import Hashable, Mapping, Sequence

import torch


def resolve_groups(owner: str, groups, regions: Mapping[str, torch.Tensor]) -> dict[Hashable, tuple]:
    """``groups`` (group -> entries) as group -> ``((region name, bytes), ...)``, checked.

    An entry is a region name (its whole block), a layer name whose regions are ``layer.<g>``
    (each of them whole), or ``(region name, nbytes)``: the first ``nbytes`` of the region's
    block (a layer whose page is padded beyond its data). A ``ValueError`` names ``groups``, the
    group and the entry otherwise.
    """
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError(f"{owner}: groups must be a non-empty mapping of group to region names, got {groups!r}")
    known = ", ".join(map(repr, regions))
    out: dict[Hashable, tuple] = {}
    for key, entries in groups.items():
        if key is None:
            raise ValueError(f"{owner}: groups has the key None, which stands for a call without group")
        if isinstance(entries, (str, bytes)) or not isinstance(entries, Sequence) or not entries:
            raise ValueError(f"{owner}: groups[{key!r}] must be a non-empty list of region names, got {entries!r}")
        resolved: list[tuple[str, int]] = []
        for entry in entries:
            if isinstance(entry, str) and entry in regions:
                resolved.append((entry, regions[entry].shape[1]))
            elif isinstance(entry, str) and f"{entry}.0" in regions:  # a layer of several regions
                resolved += [(n, r.shape[1]) for n, r in regions.items() if n.rpartition(".")[0] == entry]
            elif isinstance(entry, tuple) and len(entry) == 2 and entry[0] in regions:
                name, nbytes = entry
                width = regions[name].shape[1]
                if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral) or not 0 < nbytes <= width:
                    raise ValueError(
                        f"{owner}: groups[{key!r}] entry {entry!r}: the bytes must be an integer in [1, {width}] "
                        f"(region {name!r}'s block), got {nbytes!r}"
                    )
                resolved.append((name, int(nbytes)))
            else:
                raise ValueError(
                    f"{owner}: groups[{key!r}] entry {entry!r} is no region (nor (region, nbytes)); the regions are {known}"
                )
        names = [name for name, _ in resolved]
        if len(set(names)) != len(names):
            raise ValueError(f"{owner}: groups[{key!r}] names a region twice: {entries!r}")
        out[key] = tuple(resolved)
    return out


def engine_groups(groups, regions: Mapping[str, torch.Tensor], disk_dir) -> dict[Hashable, tuple]:
    """An :class:`~kv_ops.OffloadEngine`'s groups, as group -> ``((region name, bytes), ...)``:
    ``groups`` resolved, or without them one group of every region whole (key None)."""
    if groups is not None and disk_dir is not None:
        raise ValueError(
            "OffloadEngine: groups needs the host mirror, but disk_dir was given: the disk tier reads and "
            "writes whole 4 KiB-aligned file slots, so one group's bytes cannot move alone there"
        )
    if groups is None:
        return {None: tuple((name, r.shape[1]) for name, r in regions.items())}
    return resolve_groups("OffloadEngine", groups, regions)


__all__ = ["resolve_groups", "engine_groups"]
