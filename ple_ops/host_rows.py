"""Tables as page-locked host rows, and their zero-copy gather: shared by the gather transport
(``host_table``), ``PleOffloadLayer`` and ``host_embedding``."""

from __future__ import annotations

import torch

import kv_ops

_CHUNK_BYTES = 64 << 20  # tables are copied (and transformed) this many bytes of rows at a time


def pin_rows(table: torch.Tensor, device: torch.device, transform=None) -> torch.Tensor:
    """Copy a ``[vocab, dim]`` table into page-locked host memory, as gatherable uint8 rows.

    ``transform`` (elementwise, dtype-keeping) is applied to each chunk of rows on the table's
    own device before the copy, so no second full-size copy of the table is made anywhere.
    Returns uint8 ``[vocab, row_bytes]``: a device view of the page-locked bytes on CUDA
    (:func:`kv_ops.device_view`), the page-locked tensor itself otherwise.
    """
    pinned = kv_ops.pinned_empty(table.shape, table.dtype)
    step = max(1, _CHUNK_BYTES // max(1, table.shape[1] * table.element_size()))
    with torch.no_grad():
        for start in range(0, table.shape[0], step):
            chunk = table.detach()[start : start + step]
            pinned[start : start + step].copy_(chunk if transform is None else transform(chunk))
    rows = pinned.view(torch.uint8).view(table.shape[0], -1)
    return kv_ops.device_view(rows, device) if device.type == "cuda" else rows


def gather_rows(host_rows: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``host_rows[ids]`` as ``dtype`` ``[len(ids), dim]``: one zero-copy gather kernel."""
    rows = torch.empty(ids.shape[0], host_rows.shape[1], dtype=torch.uint8, device=host_rows.device)
    kv_ops.gather_blocks([host_rows], ids, rows)
    return rows.view(dtype)


__all__ = ["pin_rows", "gather_rows"]
