"""Tables copied into page-locked host memory as gatherable rows, for ``host_table`` and ``host_embedding``.

Their gather, the op a layer's forward calls, is :func:`ple_ops.ops.gather_rows`, on the floor below."""

from __future__ import annotations

import torch

from kv_ops.cuda.host_memory import device_view, pinned_empty

# Tables are copied this many bytes of rows at a time: a table that is not contiguous (a view of
# a larger weight, a transposed tie) is made contiguous by copy_ through a temporary of the
# copied part's size, which must not be a second whole table on a full GPU.
_CHUNK_BYTES = 64 << 20


def pin_rows(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a ``[vocab, dim]`` table into page-locked host memory, as gatherable uint8 rows.

    Returns uint8 ``[vocab, row_bytes]``: a device view of the page-locked bytes on CUDA
    (:func:`kv_ops.device_view`), the page-locked tensor itself otherwise.
    """
    pinned = pinned_empty(table.shape, table.dtype)
    step = max(1, _CHUNK_BYTES // max(1, table.shape[1] * table.element_size()))
    with torch.no_grad():
        for start in range(0, table.shape[0], step):
            chunk = table.detach()[start : start + step]
            pinned[start : start + step].copy_(chunk)
    rows = pinned.view(torch.uint8).view(table.shape[0], -1)
    return device_view(rows, device) if device.type == "cuda" else rows


__all__ = ["pin_rows"]
