"""The gather transport: lookup PLE tables in page-locked host memory, gathered zero-copy in the graph."""

from __future__ import annotations

import torch
from torch import nn

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


def gather_from_host(model: nn.Module, device: str | torch.device) -> nn.Module:
    """Move every PLE layer's lookup table into page-locked host memory and the rest to ``device``.

    Each :class:`PleOffloadLayer` must be a pure lookup (its :meth:`~PleOffloadLayer.lookup_table`
    returns the table). Its table parameter is removed from the module and copied into
    :func:`kv_ops.pinned_empty` memory; the layer's forward then gathers its rows with one
    zero-copy kernel (:func:`kv_ops.gather_blocks`) that reads them over PCIe. Nothing waits on
    another process, so nothing can hang, and the gather is an ordinary kernel that
    ``torch.compile`` and CUDA graphs keep. Choose the offload process instead when rows need
    computation, or when the tables are larger than the page-locked memory the host can give.

    Parameters
    ----------
    model : nn.Module
        A model built normally (tables included), on the CPU.
    device : str or torch.device
        Where the model runs. On CUDA the table buffers are device views of the page-locked
        memory (:func:`kv_ops.device_view`), so graphs see CUDA tensors.

    Returns
    -------
    nn.Module
        ``model``, moved to ``device``, with the tables off the GPU.

    Examples
    --------
    >>> model = ple_ops.gather_from_host(make_model(), "cuda")
    >>> step = torch.compile(model, fullgraph=True)      # no runtime, no prepare/release
    """
    from .layer import PleOffloadLayer  # layer.py imports this module's gather_rows

    device = torch.device(device)
    for name, layer in model.named_modules():
        if not isinstance(layer, PleOffloadLayer):
            continue
        table = layer.lookup_table()
        if table is None:
            raise ValueError(
                f"gather_from_host: PLE layer {name!r} ({type(layer).__name__}) is not a pure lookup "
                "(lookup_table() returned None); serve it with ple_ops.OffloadRuntime"
            )
        if table.dim() != 2 or not table.is_contiguous():
            raise ValueError(
                f"gather_from_host: {name!r}'s table must be contiguous [vocab, dim], got {tuple(table.shape)}"
            )
        owners = [
            n for n, t in (*layer.named_parameters(recurse=False), *layer.named_buffers(recurse=False)) if t is table
        ]
        if not owners:
            raise ValueError(
                f"gather_from_host: {name!r}'s lookup_table() must be one of its own parameters or buffers"
            )
        rows = pin_rows(table, device)
        delattr(layer, owners[0])  # the only copy left is the page-locked one
        layer.attach_host_table(rows, table.dtype)
    return model.to(device)


__all__ = ["gather_from_host", "gather_rows", "pin_rows"]
