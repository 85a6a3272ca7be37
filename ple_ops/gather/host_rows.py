"""Tables copied into page-locked host memory as gatherable rows, for ``host_table`` and ``host_embedding``.

Their gather, the op a layer's forward calls, is :func:`ple_ops.ops.gather_rows`, on the floor below."""

from __future__ import annotations

import torch

from kv_ops.cuda.arguments import positive_int
from kv_ops.cuda.host_memory import device_view, pinned_empty

# Tables are copied this many bytes of rows at a time: a table that is not contiguous (a view of
# a larger weight, a transposed tie) is made contiguous by copy_ through a temporary of the
# copied part's size, which must not be a second whole table on a full GPU.
_CHUNK_BYTES = 64 << 20


def check_pinnable(owner: str, what: str, table: torch.Tensor) -> None:
    """Refuse a 2-D ``table`` with no rows or rows of no bytes (a ``ValueError`` naming ``what``
    and its shape), for callers to run on every table before the first is copied: such a table
    has no gatherable rows, and ``pin_rows`` would fail on it halfway through a conversion."""
    shape = tuple(table.shape)
    positive_int(owner, f"the row count of {what} {shape}", shape[0])
    positive_int(owner, f"the row width of {what} {shape}", shape[1])


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


__all__ = ["check_pinnable", "pin_rows"]
