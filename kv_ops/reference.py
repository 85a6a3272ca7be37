"""Pure-torch block and prefix copies: the CPU implementation of the ops and the oracle the tests use.

Each function moves the same bytes as its Triton kernel, including the rule for invalid pairs:
a pair whose source or destination id lies outside ``[0, num_blocks)`` is skipped in every
region and counted, never wrapped around the way negative indices would be.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def in_range(ids: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Boolean mask of the ids that name a block of a region with ``num_blocks`` blocks."""
    return (ids >= 0) & (ids < num_blocks)


def num_blocks(regions: Sequence[torch.Tensor]) -> int:
    """Blocks that an id may address in every one of ``regions``."""
    return min(r.shape[0] for r in regions)


def copy_blocks(
    src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], src_ids: torch.Tensor, dst_ids: torch.Tensor
) -> int:
    """``dst[r][dst_ids[i]] = src[r][src_ids[i]]`` for every region r and valid pair i.

    Returns the number of skipped (invalid) pairs.
    """
    ok = in_range(src_ids, num_blocks(src)) & in_range(dst_ids, num_blocks(dst))
    s, d = src_ids[ok].long(), dst_ids[ok].long()
    for a, b in zip(src, dst):
        b[d.to(b.device)] = a[s.to(a.device)].to(b.device)
    return int((~ok).sum())


def gather_blocks(regions: Sequence[torch.Tensor], ids: torch.Tensor, out: torch.Tensor) -> int:
    """``out[i] = concat_r regions[r][ids[i]]``; rows of invalid ids are left untouched."""
    return _packed_copy(regions, ids, out, gather=True)


def scatter_blocks(packed: torch.Tensor, ids: torch.Tensor, regions: Sequence[torch.Tensor]) -> int:
    """``regions[r][ids[i]] = packed[i, cols of r]``: the inverse of :func:`gather_blocks`."""
    return _packed_copy(regions, ids, packed, gather=False)


def _packed_copy(regions: Sequence[torch.Tensor], ids: torch.Tensor, packed: torch.Tensor, gather: bool) -> int:
    """Between blocks ``ids`` of the regions and the rows of ``packed``, region r at its columns
    (the block bytes of the regions before it summed): into ``packed`` with ``gather``, else out
    of it. Returns the number of skipped (invalid) ids."""
    ok = in_range(ids, num_blocks(regions))
    rows = torch.nonzero(ok).flatten().to(packed.device)
    blocks = ids[ok].long()
    col = 0
    for region in regions:
        width = region.shape[1]
        if gather:
            packed[rows, col : col + width] = region[blocks.to(region.device)].to(packed.device)
        else:
            region[blocks.to(region.device)] = packed[rows, col : col + width].to(region.device)
        col += width
    return int((~ok).sum())


def prefix_copy(slot, host, length: int, out, out_length: int, out_saved: int, start: int = 0) -> int:
    """What :class:`kv_ops.prefix_copy.PrefixCopy` does, for (keys, values) pairs of
    ``[batch, heads, max_cache_len, dim]``: first ``out[..., out_saved:out_length, :] = slot[...]``
    (the evicted layer's new positions; none where a crop left ``out_length <= out_saved``),
    then ``slot[..., start:length, :] = host[...]``. Returns the bytes moved."""
    lo, start = min(out_saved, out_length), min(start, length)
    moved = 0
    for s, h, o in zip(slot, host, out):
        o[:, :, lo:out_length] = s[:, :, lo:out_length]
        s[:, :, start:length] = h[:, :, start:length]
        moved += (out_length - lo + length - start) * s[:, :, :1].numel() * s.element_size()
    return moved


__all__ = ["in_range", "num_blocks", "copy_blocks", "gather_blocks", "scatter_blocks", "prefix_copy"]
