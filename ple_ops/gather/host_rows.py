"""Tables copied into page-locked host memory as gatherable rows, for ``host_table`` and ``host_embedding``.

Their gather, the op a layer's forward calls, is :func:`ple_ops.ops.gather_rows`, on the floor below."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

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


def pin_rows(table: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Copy a ``[vocab, dim]`` table into page-locked host memory, as gatherable uint8 rows of
    ``dtype`` (the table's by default; another is a cast, as ``Tensor.to`` casts).

    Returns uint8 ``[vocab, row_bytes]``: a device view of the page-locked bytes on CUDA
    (:func:`kv_ops.device_view`), the page-locked tensor itself otherwise.
    """
    pinned = pinned_empty(table.shape, dtype or table.dtype)
    step = max(1, _CHUNK_BYTES // max(1, table.shape[1] * max(table.element_size(), pinned.element_size())))
    with torch.no_grad():
        for start in range(0, table.shape[0], step):
            chunk = table.detach()[start : start + step]
            pinned[start : start + step].copy_(chunk)
    rows = pinned.view(torch.uint8).view(table.shape[0], -1)
    return device_view(rows, device) if device.type == "cuda" else rows


@dataclass(frozen=True)
class TableInStateDict:
    """The ``state_dict`` hooks that keep a converted table under the name of the parameter it
    replaced: ``module.<rows>`` (uint8 ``[vocab, row_bytes]``, as :func:`pin_rows` gives) seen
    as ``module.<dtype>`` ``[vocab, dim]``.

    Saving gives the rows themselves (no copy: on CUDA the device view of the page-locked bytes,
    as a parameter would be on its device), so ``torch.save`` and ``save_pretrained`` of a
    converted model write the whole table. Loading copies into them in place, on the current
    stream (stream-ordered after every gather already queued, as a parameter's ``copy_`` is),
    cast to the rows' dtype; a shape that differs is an error in ``load_state_dict``'s own
    words, and a missing key is reported as missing. Holds names only, so a copied module's
    hooks read the copy's rows.
    """

    key: str  # the replaced parameter's name, "weight" for an embedding
    rows: str  # the module attribute that holds the rows
    dtype: str  # and the one that holds their dtype (a cast of the module may change both)

    def attach(self, module: nn.Module) -> None:
        # Partials, not bound methods: torch marks each hook with an attribute, which a method refuses.
        module.register_state_dict_post_hook(functools.partial(TableInStateDict.save, self))
        module.register_load_state_dict_pre_hook(functools.partial(TableInStateDict.load, self))

    def table(self, module: nn.Module) -> torch.Tensor:
        return getattr(module, self.rows).view(getattr(module, self.dtype))

    def save(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        state_dict[prefix + self.key] = self.table(module).detach()

    def load(self, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        name = prefix + self.key
        if name not in state_dict:
            if strict:  # load_state_dict passes True and decides later whether missing keys raise
                missing_keys.append(name)
            return
        # Taken out, so that load_state_dict's own pass does not report it as unexpected.
        source = state_dict.pop(name)
        table = self.table(module)
        if isinstance(source, torch.Tensor) and source.is_meta:  # no values to copy (torch raises NotImplementedError)
            error_msgs.append(f"{name} is a meta tensor in the checkpoint: it holds no values to load")
            return
        if not isinstance(source, torch.Tensor) or source.shape != table.shape:
            shown = tuple(source.shape) if isinstance(source, torch.Tensor) else type(source).__name__
            error_msgs.append(
                f"size mismatch for {name}: copying a param with shape {shown} from checkpoint, "
                f"the shape in current model is {tuple(table.shape)}."
            )
            return
        with torch.no_grad():
            table.copy_(source)


__all__ = ["TableInStateDict", "check_pinnable", "pin_rows"]
