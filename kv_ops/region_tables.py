"""The block-copy kernel's region tables: each region set's geometry as the kernel reads it, built once and kept.

A table holds, per region, where its blocks are (as offsets from the table's own address, so
that the kernel's address math inherits the table's alignment), their strides, their widths and
their columns in a packed row: what :class:`kv_ops.kernels.BoundCopy` binds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .cuda import driver, host_memory
from .cuda.capture import refuse_capture
from .cuda.launch import alignment

# Tables of region geometry, keyed by their content. Never evicted: a captured CUDA graph holds
# a table's address, so freeing one could make a replay read garbage. An entry is tiny (48 bytes
# per region) and a process sees few distinct region sets.
_tables: dict[tuple, tuple[torch.Tensor, int]] = {}


def address(t: torch.Tensor, device: torch.device) -> int:
    """Where a kernel on ``device`` finds ``t``'s first byte (host memory: its mapped address)."""
    if t.device.type == "cpu" and device.type == "cuda":
        return driver.device_pointer(t)
    return t.data_ptr()


def geometry_table(
    device: torch.device, src: Sequence[torch.Tensor] | None, dst: Sequence[torch.Tensor] | None, widths: list[int]
) -> tuple[torch.Tensor, int]:
    """The kernel's per-region table for these regions and its alignment, built once and reused."""
    key = (
        device,
        tuple((t.device, t.data_ptr(), t.stride(0)) for t in src) if src is not None else None,
        tuple((t.device, t.data_ptr(), t.stride(0)) for t in dst) if dst is not None else None,
        tuple(widths),
    )
    cached = _tables.get(key)
    if cached is not None:
        return cached
    refuse_capture(
        "kv_ops",
        "these regions were first seen during CUDA graph capture",
        "run the op once with them before capturing (the warm-up that every capture needs)",
        device=device,
    )
    num = len(widths)
    # The region addresses are stored relative to the table's own address, which is known only
    # once it exists: allocate it (outside any graph pool), then fill it.
    table = host_memory.lasting_copy(torch.zeros(6 * num, dtype=torch.int64), device)
    base = table.data_ptr()
    columns = [0]
    for w in widths[:-1]:
        columns.append(columns[-1] + w)
    rows = [
        [address(t, device) - base for t in src] if src is not None else [0] * num,
        [address(t, device) - base for t in dst] if dst is not None else [0] * num,
        [t.stride(0) for t in src] if src is not None else [0] * num,
        [t.stride(0) for t in dst] if dst is not None else [0] * num,
        widths,
        columns,
    ]
    values = [v for row in rows for v in row]
    table.copy_(torch.tensor(values, dtype=torch.int64))
    # Offsets from the table: their alignment is what the kernel's address math inherits.
    _tables[key] = (table, alignment(values))
    return _tables[key]


__all__ = ["address", "geometry_table"]
