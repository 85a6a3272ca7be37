"""gather_from_host: every PLE layer's lookup table moved to page-locked host memory, gathered zero-copy in the graph."""

from __future__ import annotations

import reprlib

import torch
from torch import nn

from kv_ops.cuda import arguments

from ..layer import PleOffloadLayer, ple_layers
from .host_rows import TableInStateDict, check_pinnable, pin_rows


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
        Where the model runs: a CUDA device or the CPU (a CUDA device on a machine without CUDA is a
        ``ValueError``, raised before any table moves). On CUDA the table buffers are device views of the page-locked
        memory (:func:`kv_ops.device_view`), so graphs see CUDA tensors.

    Returns
    -------
    nn.Module
        ``model``, moved to ``device``, with the tables off the GPU. Each table stays in the
        ``state_dict`` under its own name (the page-locked rows, not a copy), and
        ``load_state_dict`` writes into them in place.

    Raises
    ------
    ValueError
        Before any table moves, so that the model is left as it was: ``model`` is not a module,
        ``device`` is bad, or a PLE layer is not a pure lookup, has a table that is not contiguous
        ``[vocab, dim]`` with at least one row and one column, or was converted already.

    Examples
    --------
    >>> model = ple_ops.gather_from_host(make_model(), "cuda")
    >>> step = torch.compile(model, fullgraph=True)      # no runtime, no prepare/release
    """
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"gather_from_host: model must be an nn.Module built with its tables, got {reprlib.repr(model)}"
        )
    device = arguments.device("gather_from_host", device)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"gather_from_host: device must be a CUDA device or 'cpu', got {device!r}")
    # Every layer is checked before the first table moves: a refusal leaves the model as it was.
    tables = [_checked_table(name, layer) for name, layer in ple_layers(model)]
    pinned: dict[int, torch.Tensor] = {}  # a table tied between layers is pinned once, and stays tied
    # Which tables the state_dict holds (a parameter or persistent buffer), before any goes.
    saved = [owner in layer.state_dict(keep_vars=True) for layer, _, owner in tables]
    for (layer, table, owner), kept in zip(tables, saved, strict=True):
        rows = pinned.get(id(table))
        if rows is None:
            rows = pinned[id(table)] = pin_rows(table, device)
        holder, _, leaf = owner.rpartition(".")
        holder = layer.get_submodule(holder)
        if hasattr(holder, leaf):  # gone already where two layers share the module that held it
            delattr(holder, leaf)  # the only copy left is the page-locked one
        layer.attach_host_table(rows, table.dtype)
        if kept:  # the state_dict keeps it under its old name, as before
            TableInStateDict(owner, "ple_host_table", "ple_dtype").attach(layer)
    return model.to(device)


def _checked_table(name: str, layer: PleOffloadLayer) -> tuple[PleOffloadLayer, torch.Tensor, str]:
    """``layer``, its lookup table and the name of the parameter or buffer that holds it, or a
    ``ValueError`` naming the layer: nothing is moved here."""
    if layer.ple_gathers or layer.ple_name is not None or layer.ple_placeholder:
        # Its table is gone (gathered already, or never built in this process): lookup_table()
        # would fail with an AttributeError that says neither.
        state = "already gathers from host memory" if layer.ple_gathers else "is an offload runtime's placeholder"
        raise ValueError(
            f"gather_from_host: PLE layer {name!r} ({type(layer).__name__}) {state}: pass a model "
            "built normally, with its tables, and convert it once"
        )
    table = layer.lookup_table()
    if table is None:
        raise ValueError(
            f"gather_from_host: PLE layer {name!r} ({type(layer).__name__}) is not a pure lookup "
            "(lookup_table() returned None); serve it with ple_ops.OffloadRuntime"
        )
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or not table.is_contiguous():
        shown = tuple(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__
        raise ValueError(f"gather_from_host: {name!r}'s table must be contiguous [vocab, dim], got {shown}")
    check_pinnable("gather_from_host", f"the table of layer {name!r}", table)
    # Its own or a submodule's (an nn.Embedding's weight, say): the name the state_dict knows it by.
    owners = [n for n, t in (*layer.named_parameters(), *layer.named_buffers()) if t is table]
    if not owners:
        raise ValueError(
            f"gather_from_host: {name!r}'s lookup_table() must be a parameter or buffer of the layer or of "
            "one of its submodules (as self.table.weight of an nn.Embedding), not a tensor made on the fly"
        )
    return layer, table, owners[0]


__all__ = ["gather_from_host"]
