"""Where KV-cache blocks live: block-strided byte regions resolved from cache tensors."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheTensorSpec:
    """One allocation that holds the KV cache of one or more layers.

    All byte counts are relative to the start of the allocation's storage (not to a tensor's
    ``storage_offset``), so several specs may describe slices of one shared allocation.

    Parameters
    ----------
    layers : sequence of str
        The layers placed in this allocation, in placement order. At least one of them must be a
        key of the ``kv_caches`` mapping handed to :func:`resolve_regions`.
    block_stride : int
        Bytes between block ``b`` and block ``b + 1`` of one layer.
    layer_stride : int
        Bytes between the placements of layer ``l`` and layer ``l + 1``.

        * ``layer_stride >= num_blocks * block_stride``: layers are outermost. Each layer's
          placement is cut into ``layer_stride // (num_blocks * block_stride)`` regions of
          ``[num_blocks, block_stride]`` bytes (one for a plain layer, two for K/V-first, one per
          KV-head group ...), which must divide it exactly.
        * otherwise blocks are outermost (a cross-layer layout): block ``b`` holds every layer,
          so the allocation is one region ``[num_blocks, block_stride]`` whose block spans all
          layers; the layers must fit in a block (``len(layers) * layer_stride <= block_stride``).
    offset : int
        Byte where the first layer's first block starts.
    """

    layers: tuple[str, ...]
    block_stride: int
    layer_stride: int
    offset: int = 0

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers or len(set(self.layers)) != len(self.layers):
            raise ValueError(f"KVCacheTensorSpec: layers must be non-empty and distinct, got {self.layers}")
        if self.block_stride <= 0:
            raise ValueError(f"KVCacheTensorSpec for {self.layers[0]!r}: block_stride {self.block_stride} must be > 0")
        if self.layer_stride < 0 or (self.layer_stride == 0 and len(self.layers) > 1):
            raise ValueError(
                f"KVCacheTensorSpec for {self.layers[0]!r}: layer_stride {self.layer_stride} must be > 0 "
                "when several layers share the allocation"
            )
        if self.offset < 0:
            raise ValueError(f"KVCacheTensorSpec for {self.layers[0]!r}: offset {self.offset} must be >= 0")


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t`` as a flat uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _check_num_blocks(num_blocks: int) -> None:
    if not isinstance(num_blocks, int) or num_blocks <= 0:
        raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")


def _add_unique(out: dict[str, torch.Tensor], name: str, region: torch.Tensor) -> None:
    """Add ``region`` unless the same bytes with the same geometry are already there (an alias)."""
    key = (region.device, region.data_ptr(), tuple(region.shape), tuple(region.stride()))
    for other_name, other in out.items():
        if (other.device, other.data_ptr(), tuple(other.shape), tuple(other.stride())) == key:
            return
        if other_name == name:
            raise ValueError(f"two different regions are both named {name!r}")
    out[name] = region


def _byte_span(region: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte addresses covered by a 2-D region."""
    n, width = region.shape
    start = region.data_ptr()
    return start, start + (n - 1) * region.stride(0) + width


def _check_disjoint(regions: Mapping[str, torch.Tensor]) -> None:
    """Raise if two regions share a byte: a copy into one would corrupt the other."""
    spans = sorted((r.device.type, r.device.index or 0, *_byte_span(r), name) for name, r in regions.items())
    for a, b in zip(spans, spans[1:]):
        if a[:2] == b[:2] and b[2] < a[3]:
            raise ValueError(
                f"regions {a[4]!r} and {b[4]!r} overlap: bytes [{a[2]:#x}, {a[3]:#x}) and [{b[2]:#x}, {b[3]:#x})"
            )


def resolve_regions(
    kv_caches: Mapping[str, torch.Tensor],
    specs: Sequence[KVCacheTensorSpec],
    num_blocks: int,
) -> dict[str, torch.Tensor]:
    """Cut KV-cache storages into block-strided byte regions, as the specs declare.

    Parameters
    ----------
    kv_caches : mapping of str to Tensor
        Per-layer cache tensors. Only their storages are used; their shapes are not read.
    specs : sequence of KVCacheTensorSpec
        One per allocation; see :class:`KVCacheTensorSpec` for the two placements.
    num_blocks : int
        Blocks per region.

    Returns
    -------
    dict of str to Tensor
        Every distinct region as a uint8 view ``[num_blocks, block_bytes]`` of the raw storage,
        named ``layer`` (one region per layer, or a cross-layer region named after its first
        layer) or ``layer.<g>`` (the g-th group of a layer: K/V, KV-head group). Aliases,
        regions reached twice through tensors that share a storage, appear once.

    Raises
    ------
    ValueError
        A spec names no tensor in ``kv_caches``, its layers' tensors do not share one storage,
        it does not fit its storage, it does not divide into whole regions, or two regions overlap.

    Examples
    --------
    >>> kv = torch.empty(2, 2, num_blocks, 16, 8, 128, dtype=torch.bfloat16)  # layers, K/V, ...
    >>> bb = 16 * 8 * 128 * 2
    >>> spec = KVCacheTensorSpec(["l0", "l1"], block_stride=bb, layer_stride=2 * num_blocks * bb)
    >>> regions = resolve_regions({"l0": kv[0], "l1": kv[1]}, [spec], num_blocks)
    >>> sorted(regions)
    ['l0.0', 'l0.1', 'l1.0', 'l1.1']
    """
    _check_num_blocks(num_blocks)
    out: dict[str, torch.Tensor] = {}
    for spec in specs:
        present = [name for name in spec.layers if name in kv_caches]
        if not present:
            raise ValueError(
                f"spec for layers {list(spec.layers)} names no tensor in kv_caches (keys: {sorted(kv_caches)})"
            )
        storage_ptrs = {kv_caches[name].untyped_storage().data_ptr() for name in present}
        if len(storage_ptrs) != 1:
            raise ValueError(f"layers {present} of one spec do not share one storage")
        raw = _raw_bytes(kv_caches[present[0]])
        region_bytes = num_blocks * spec.block_stride
        first = spec.layers[0]
        num_layers = len(spec.layers)

        if spec.layer_stride >= region_bytes or num_layers == 1:
            # Layers outermost: each layer is one or more whole [num_blocks, block] regions.
            per_layer = max(spec.layer_stride, region_bytes) if num_layers == 1 else spec.layer_stride
            groups, rest = divmod(per_layer, region_bytes)
            if rest:
                raise ValueError(
                    f"layer {first!r}: layer_stride {spec.layer_stride} is not a whole number of regions of "
                    f"{num_blocks} blocks x {spec.block_stride} bytes = {region_bytes} bytes"
                )
            span = num_layers * per_layer
            placements = [
                (layer if groups == 1 else f"{layer}.{g}", spec.offset + (l * groups + g) * region_bytes)
                for l, layer in enumerate(spec.layers)
                for g in range(groups)
            ]
        else:
            # Blocks outermost: one region whose block holds every layer.
            if num_layers * spec.layer_stride > spec.block_stride:
                raise ValueError(
                    f"layer {spec.layers[-1]!r}: {num_layers} layers x layer_stride {spec.layer_stride} = "
                    f"{num_layers * spec.layer_stride} bytes do not fit in a block of {spec.block_stride} bytes"
                )
            span = region_bytes
            placements = [(first, spec.offset)]

        if spec.offset + span > raw.numel():
            raise ValueError(
                f"layer {first!r}: the spec places {span} bytes at offset {spec.offset}, past the end of its "
                f"storage of {raw.numel()} bytes"
            )
        for name, start in placements:
            region = raw[start : start + region_bytes].view(num_blocks, spec.block_stride)
            _add_unique(out, name, region)
    _check_disjoint(out)
    return out


def _dense_bytes(t: torch.Tensor) -> int | None:
    """Bytes of ``t`` if its elements exactly fill one contiguous span (any dim order), else None."""
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return None
        expected *= size
    return t.numel() * t.element_size()


_LAYOUT_HELP = (
    "infer_regions understands per-layer tensors shaped (num_blocks, ...) [MLA-like, or (num_blocks, 2, ...)"
    " with K/V inside a block, or cross-layer (num_blocks, num_layers, ...)] and (2, num_blocks, ...)"
    " [K/V-first], where each block's elements fill one contiguous byte span; describe other layouts"
    " with KVCacheTensorSpec and resolve_regions"
)


def infer_regions(kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> dict[str, torch.Tensor]:
    """Find the block-strided regions of common per-layer cache layouts without specs.

    Accepted per-layer shapes: ``(num_blocks, ...)`` (MLA-like; also ``(num_blocks, 2, ...)`` and
    cross-layer ``(num_blocks, num_layers, ...)``) and K/V-first ``(2, num_blocks, ...)``. The
    elements of one block must fill one contiguous byte span; the dims inside a block may be in
    any order (NHD or HND). Regions that interleave per block (for instance per-layer views
    ``t[:, l]`` of one cross-layer tensor) are merged into one region whose block spans them all.

    Parameters
    ----------
    kv_caches : mapping of str to Tensor
        Per-layer cache tensors.
    num_blocks : int
        Blocks per region.

    Returns
    -------
    dict of str to Tensor
        As :func:`resolve_regions`: uint8 views ``[num_blocks, block_bytes]``, named ``layer`` or
        ``layer.<g>`` (g = 0 for K, 1 for V in K/V-first layouts), aliases once.

    Raises
    ------
    ValueError
        A tensor's layout is none of the above; the message says which tensor and why.

    Examples
    --------
    >>> kv = {f"l{i}": torch.empty(2, num_blocks, 16, 8, 128, dtype=torch.bfloat16) for i in range(4)}
    >>> sorted(infer_regions(kv, num_blocks))[:2]
    ['l0.0', 'l0.1']
    """
    _check_num_blocks(num_blocks)
    found: list[tuple[str, torch.Tensor]] = []
    for name, t in kv_caches.items():
        shape = tuple(t.shape)
        blocks_first = t.dim() >= 1 and shape[0] == num_blocks
        kv_first = t.dim() >= 2 and shape[0] == 2 and shape[1] == num_blocks
        if blocks_first and kv_first:
            raise ValueError(
                f"layer {name!r}: shape {shape} is ambiguous with num_blocks={num_blocks} "
                "(K/V-first or blocks-first); describe it with KVCacheTensorSpec"
            )
        if not (blocks_first or kv_first):
            raise ValueError(f"layer {name!r}: shape {shape} has no block axis of size {num_blocks}. {_LAYOUT_HELP}")
        groups = [(name, t)] if blocks_first else [(f"{name}.{g}", t[g]) for g in range(2)]
        for group_name, g in groups:
            block_bytes = _dense_bytes(g[0])
            if block_bytes is None:
                raise ValueError(
                    f"layer {name!r}: a block of shape {tuple(g.shape[1:])} with strides {g.stride()[1:]} "
                    f"is not one contiguous byte span. {_LAYOUT_HELP}"
                )
            block_stride = g.stride(0) * g.element_size()
            if num_blocks > 1 and block_stride < block_bytes:
                raise ValueError(
                    f"layer {name!r}: blocks overlap (block stride {block_stride} bytes < block size {block_bytes})"
                )
            region = _raw_bytes(g).as_strided(
                (num_blocks, block_bytes), (max(block_stride, block_bytes), 1), g.storage_offset() * g.element_size()
            )
            found.append((group_name, region))

    # Drop aliases first, then merge regions that sit side by side inside each block (same
    # storage, stride and count): one wider block copies faster and moves the same bytes.
    unique: dict[str, torch.Tensor] = {}
    for name, region in found:
        _add_unique(unique, name, region)
    by_address = sorted(unique.items(), key=lambda item: (item[1].device.type, item[1].device.index or 0, item[1].data_ptr()))
    merged: list[tuple[str, torch.Tensor]] = []
    for name, region in by_address:
        if merged:
            prev_name, prev = merged[-1]
            adjacent = (
                prev.device == region.device
                and prev.untyped_storage().data_ptr() == region.untyped_storage().data_ptr()
                and prev.stride(0) == region.stride(0)
                and prev.data_ptr() + prev.shape[1] == region.data_ptr()
                and prev.shape[1] + region.shape[1] <= prev.stride(0)
            )
            if adjacent:
                width = prev.shape[1] + region.shape[1]
                merged[-1] = (prev_name, prev.as_strided((num_blocks, width), prev.stride(), prev.storage_offset()))
                continue
        merged.append((name, region))

    order = {name: i for i, (name, _) in enumerate(found)}  # report regions in kv_caches order
    out = dict(sorted(merged, key=lambda item: order[item[0]]))
    _check_disjoint(out)
    return out


def block_bytes(regions: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]) -> int:
    """Total bytes of one block across ``regions``: the row width of a packed gather buffer."""
    values = regions.values() if isinstance(regions, Mapping) else regions
    return sum(r.shape[1] for r in values)


__all__ = ["KVCacheTensorSpec", "resolve_regions", "infer_regions", "block_bytes"]
