"""Pure-torch reference of what the PLE ops deliver (the test oracle), and the poison of failed rows."""

from __future__ import annotations

import torch


def pull_rows(out: torch.Tensor, slot: torch.Tensor, num_tokens: int) -> None:
    """``out[:num_tokens]`` receives the first ``num_tokens`` rows of ``slot``, byte for byte.

    ``out`` is ``[rows, dim]`` of any dtype, contiguous; ``slot`` is uint8 ``[max_tokens, row_bytes]``
    with ``row_bytes == dim * out.element_size()``. Rows past ``num_tokens`` are not touched.
    """
    if num_tokens:
        out[:num_tokens].view(torch.uint8).copy_(slot[:num_tokens])


def poison_rows(slot: torch.Tensor) -> None:
    """Fill a slot with 0xFF bytes: NaN in every floating dtype, -1 in signed integers, so that rows
    from a failed step cannot pass for data."""
    slot.fill_(0xFF)


__all__ = ["pull_rows", "poison_rows"]
