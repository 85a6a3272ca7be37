"""Where KV-cache blocks live: block-strided byte regions resolved from cache tensors."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from .cuda.arguments import byte_regions, index, positive_int, shown, text
from .cuda.host_memory import bytes_at


def alias_bytes(base: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor over ``nbytes`` of ``base``'s storage from byte ``offset``, with a storage
    of its own. It keeps ``base`` alive.

    torch, and torch.compile with it, treat the result as unrelated to ``base`` and to other
    aliases of the same storage. That is the point: regions handed to a compiled graph as views
    of one storage make AOTAutograd rebuild them from a synthetic base, and Inductor then clones
    the mutated ones around every call (a KV cache's worth of bytes per step on torch 2.13) or
    writes them back at wrong offsets (torch 2.11). Regions are checked disjoint where they are
    made, so nothing is lost by hiding their common storage.
    """
    storage = base.untyped_storage()
    if offset < 0 or offset + nbytes > storage.nbytes():
        raise ValueError(f"alias_bytes: bytes [{offset}, {offset + nbytes}) outside a storage of {storage.nbytes()}")
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=base.device)
    if base.device.type not in ("cuda", "cpu"):
        raise ValueError(f"alias_bytes: unsupported device {base.device}")
    return bytes_at(base, storage.data_ptr() + offset, nbytes, base.device)


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
        owner = "KVCacheTensorSpec"
        # A str is a sequence too: "abc" would be read as three layers named by its letters.
        if isinstance(self.layers, (str, bytes)) or not isinstance(self.layers, Iterable):
            raise ValueError(f"{owner}: layers must be a list of layer names (str), got {shown(self.layers)}")
        layers = tuple(self.layers)
        for i, name in enumerate(layers):
            text(owner, f"layers[{i}]", name)
        # By the shared rules: True or 4096.5 bytes is a slip that would fail later, far from here.
        # Stored as plain ints, so that a numpy integer does not reach the byte arithmetic.
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "block_stride", positive_int(owner, "block_stride", self.block_stride))
        object.__setattr__(self, "layer_stride", index(owner, "layer_stride", self.layer_stride))
        object.__setattr__(self, "offset", index(owner, "offset", self.offset))
        if not self.layers or len(set(self.layers)) != len(self.layers):
            raise ValueError(f"KVCacheTensorSpec: layers must be non-empty and distinct, got {self.layers}")
        if self.layer_stride == 0 and len(self.layers) > 1:
            raise ValueError(
                f"KVCacheTensorSpec for {self.layers[0]!r}: layer_stride {self.layer_stride} must be > 0 "
                "when several layers share the allocation"
            )


@dataclass(frozen=True)
class _Placement:
    """One region before it becomes a tensor: where its blocks sit in a storage, in bytes."""

    name: str
    base: torch.Tensor  # any tensor on the storage; keeps it alive
    offset: int  # from the storage's first byte
    stride: int  # between blocks
    width: int  # bytes of one block

    @property
    def address(self) -> int:
        return self.base.untyped_storage().data_ptr() + self.offset

    def key(self) -> tuple:
        return (self.base.device, self.address, self.stride, self.width)

    def span(self, num_blocks: int) -> int:
        return (num_blocks - 1) * self.stride + self.width


def check_kv_caches(owner: str, kv_caches) -> None:
    """Raise a ``ValueError`` naming ``owner`` unless ``kv_caches`` is a non-empty mapping of layer
    names (``str``) to ``torch.Tensor``s on a CUDA device or the CPU: a list, a numpy array, ``{}``,
    a non-str key, a value that is not a tensor, or a tensor elsewhere (meta) is refused here,
    before its first use would fail with an unrelated error.

    Examples
    --------
    >>> check_kv_caches("OffloadEngine", {"layer.0": torch.empty(4, 2, 16)})
    """
    if not isinstance(kv_caches, Mapping):
        raise ValueError(
            f"{owner}: kv_caches must be a mapping of layer name to torch.Tensor, got {type(kv_caches).__name__}"
        )
    if not kv_caches:
        raise ValueError(f"{owner}: kv_caches must hold at least one layer, got an empty {type(kv_caches).__name__}")
    for key, value in kv_caches.items():
        if not isinstance(key, str):
            raise ValueError(f"{owner}: kv_caches keys must be layer names (str), got {key!r} ({type(key).__name__})")
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{owner}: kv_caches[{key!r}] must be a torch.Tensor, got {type(value).__name__}")
        if value.device.type not in ("cuda", "cpu"):
            # A meta tensor has a shape but no bytes: regions over it would copy nothing.
            raise ValueError(
                f"{owner}: kv_caches[{key!r}] is on {value.device}, but the caches must be CUDA or CPU tensors"
                + (" (a meta tensor holds no bytes to move)" if value.is_meta else "")
            )


def _unique(placements: list[_Placement]) -> list[_Placement]:
    """Drop aliases: the same bytes with the same geometry, reached through another name."""
    seen: set[tuple] = set()
    out = []
    for p in placements:
        if p.key() not in seen:
            seen.add(p.key())
            out.append(p)
    return out


def _materialize(owner: str, placements: list[_Placement], num_blocks: int) -> dict[str, torch.Tensor]:
    """Check names and disjointness, then make each region a ``[num_blocks, width]`` uint8 tensor.

    Each region gets a storage of its own over the cache's bytes (``alias_bytes``),
    so that torch.compile sees independent buffers rather than views of one storage.
    """
    names = [p.name for p in placements]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"{owner}: two different regions are both named {dup!r}")
    spans = sorted(
        (p.base.device.type, p.base.device.index or 0, p.address, p.address + p.span(num_blocks), p.name)
        for p in placements
    )
    for a, b in zip(spans, spans[1:]):
        if a[:2] == b[:2] and b[2] < a[3]:
            raise ValueError(
                f"{owner}: regions {a[4]!r} and {b[4]!r} overlap: bytes [{a[2]:#x}, {a[3]:#x}) and [{b[2]:#x}, {b[3]:#x})"
            )
    return {
        p.name: alias_bytes(p.base, p.offset, p.span(num_blocks)).as_strided((num_blocks, p.width), (p.stride, 1))
        for p in placements
    }


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
        Every distinct region as a uint8 tensor ``[num_blocks, block_bytes]`` over the raw
        storage (its own storage object aliasing those bytes, so torch.compile treats regions as
        independent buffers; see ``alias_bytes``), named ``layer`` (one region per layer, or a cross-layer region named after its first
        layer) or ``layer.<g>`` (the g-th group of a layer: K/V, KV-head group). Aliases,
        regions reached twice through tensors that share a storage, appear once.

    Raises
    ------
    ValueError
        ``kv_caches`` is not a non-empty mapping of str to Tensor (:func:`check_kv_caches`),
        ``num_blocks`` is not a positive integer, ``specs`` is not a non-empty sequence of
        :class:`KVCacheTensorSpec`, a spec names no tensor in ``kv_caches``, its
        layers' tensors do not share one storage, it does not fit its storage, it does not divide
        into whole regions, or two regions overlap.

    Examples
    --------
    >>> kv = torch.empty(2, 2, num_blocks, 16, 8, 128, dtype=torch.bfloat16)  # layers, K/V, ...
    >>> bb = 16 * 8 * 128 * 2
    >>> spec = KVCacheTensorSpec(["l0", "l1"], block_stride=bb, layer_stride=2 * num_blocks * bb)
    >>> regions = resolve_regions({"l0": kv[0], "l1": kv[1]}, [spec], num_blocks)
    >>> sorted(regions)
    ['l0.0', 'l0.1', 'l1.0', 'l1.1']
    """
    return _resolve("resolve_regions", kv_caches, specs, num_blocks)


def regions_of(owner: str, kv_caches, num_blocks, specs=None) -> dict[str, torch.Tensor]:
    """:func:`resolve_regions` with ``specs``, else :func:`infer_regions`, for an entry point that
    takes the caches itself: every error names ``owner``, the function the user called, as the
    argument checks of :mod:`kv_ops.cuda.arguments` do."""
    # None, not any falsy value, means "infer": an empty specs is a mistake _resolve refuses.
    return _infer(owner, kv_caches, num_blocks) if specs is None else _resolve(owner, kv_caches, specs, num_blocks)


def _resolve(owner: str, kv_caches, specs, num_blocks) -> dict[str, torch.Tensor]:
    check_kv_caches(owner, kv_caches)
    num_blocks = positive_int(owner, "num_blocks", num_blocks)
    if isinstance(specs, KVCacheTensorSpec) or not isinstance(specs, Sequence) or isinstance(specs, str):
        raise ValueError(f"{owner}: specs must be a list of KVCacheTensorSpec objects, got {specs!r}")
    if not specs:
        # Nothing to cut: every region would be missing, and a copy over them would move nothing.
        raise ValueError(
            f"{owner}: specs is empty; pass one KVCacheTensorSpec per allocation, or no specs to infer the layout"
        )
    found: list[_Placement] = []
    for spec in specs:
        if not isinstance(spec, KVCacheTensorSpec):
            raise ValueError(f"{owner}: specs must be KVCacheTensorSpec objects, got {type(spec).__name__}")
        present = [name for name in spec.layers if name in kv_caches]
        if not present:
            raise ValueError(
                f"{owner}: spec for layers {list(spec.layers)} names no tensor in kv_caches (keys: {sorted(kv_caches)})"
            )
        storage_ptrs = {kv_caches[name].untyped_storage().data_ptr() for name in present}
        if len(storage_ptrs) != 1:
            raise ValueError(f"{owner}: layers {present} of one spec do not share one storage")
        base = kv_caches[present[0]]
        storage_bytes = base.untyped_storage().nbytes()
        region_bytes = num_blocks * spec.block_stride
        first = spec.layers[0]
        num_layers = len(spec.layers)

        if spec.layer_stride >= region_bytes or num_layers == 1:
            # Layers outermost: each layer is one or more whole [num_blocks, block] regions.
            per_layer = max(spec.layer_stride, region_bytes) if num_layers == 1 else spec.layer_stride
            groups, rest = divmod(per_layer, region_bytes)
            if rest:
                raise ValueError(
                    f"{owner}: layer {first!r}: layer_stride {spec.layer_stride} is not a whole number of regions of "
                    f"{num_blocks} blocks x {spec.block_stride} bytes = {region_bytes} bytes"
                )
            span = num_layers * per_layer
            placements = [
                (layer if groups == 1 else f"{layer}.{g}", spec.offset + (k * groups + g) * region_bytes)
                for k, layer in enumerate(spec.layers)
                for g in range(groups)
            ]
        else:
            # Blocks outermost: one region whose block holds every layer.
            if num_layers * spec.layer_stride > spec.block_stride:
                raise ValueError(
                    f"{owner}: layer {spec.layers[-1]!r}: {num_layers} layers x layer_stride {spec.layer_stride} = "
                    f"{num_layers * spec.layer_stride} bytes do not fit in a block of {spec.block_stride} bytes"
                )
            span = region_bytes
            placements = [(first, spec.offset)]

        if spec.offset + span > storage_bytes:
            raise ValueError(
                f"{owner}: layer {first!r}: the spec places {span} bytes at offset {spec.offset}, past the end of its "
                f"storage of {storage_bytes} bytes"
            )
        found += [_Placement(name, base, start, spec.block_stride, spec.block_stride) for name, start in placements]
    return _materialize(owner, _unique(found), num_blocks)


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
        As :func:`resolve_regions`: uint8 tensors ``[num_blocks, block_bytes]``, named ``layer`` or
        ``layer.<g>`` (g = 0 for K, 1 for V in K/V-first layouts), aliases once.

    Raises
    ------
    ValueError
        ``kv_caches`` or ``num_blocks`` is malformed (as :func:`resolve_regions` says), a
        tensor's blocks have no bytes (a dimension of size 0), or a tensor's layout is none of the
        above; the message says which tensor and why.

    Examples
    --------
    >>> kv = {f"l{i}": torch.empty(2, num_blocks, 16, 8, 128, dtype=torch.bfloat16) for i in range(4)}
    >>> sorted(infer_regions(kv, num_blocks))[:2]
    ['l0.0', 'l0.1']
    """
    return _infer("infer_regions", kv_caches, num_blocks)


def _infer(owner: str, kv_caches, num_blocks) -> dict[str, torch.Tensor]:
    check_kv_caches(owner, kv_caches)
    num_blocks = positive_int(owner, "num_blocks", num_blocks)
    found: list[_Placement] = []
    for name, t in kv_caches.items():
        shape = tuple(t.shape)
        blocks_first = t.dim() >= 1 and shape[0] == num_blocks
        kv_first = t.dim() >= 2 and shape[0] == 2 and shape[1] == num_blocks
        if blocks_first and kv_first:
            raise ValueError(
                f"{owner}: layer {name!r}: shape {shape} is ambiguous with num_blocks={num_blocks} "
                "(K/V-first or blocks-first); describe it with KVCacheTensorSpec"
            )
        if not (blocks_first or kv_first):
            raise ValueError(
                f"{owner}: layer {name!r}: shape {shape} has no block axis of size {num_blocks}. {_LAYOUT_HELP}"
            )
        groups = [(name, t)] if blocks_first else [(f"{name}.{g}", t[g]) for g in range(2)]
        for group_name, g in groups:
            if g[0].numel() == 0:
                # A region of empty blocks has no bytes to alias, and no block to move.
                raise ValueError(
                    f"{owner}: kv_caches[{name!r}] of shape {shape}: its blocks have no bytes (a block is "
                    f"{tuple(g.shape[1:])}, with no elements)"
                )
            width = _dense_bytes(g[0])
            if width is None:
                raise ValueError(
                    f"{owner}: layer {name!r}: a block of shape {tuple(g.shape[1:])} with strides {g.stride()[1:]} "
                    f"is not one contiguous byte span. {_LAYOUT_HELP}"
                )
            stride = g.stride(0) * g.element_size()
            if num_blocks > 1 and stride < width:
                raise ValueError(
                    f"{owner}: layer {name!r}: blocks overlap (block stride {stride} bytes < block size {width})"
                )
            found.append(_Placement(group_name, g, g.storage_offset() * g.element_size(), max(stride, width), width))

    # Drop aliases, then merge regions that sit side by side inside each block (same storage and
    # stride): one wider block copies faster and moves the same bytes.
    order = {p.name: i for i, p in enumerate(found)}  # report regions in kv_caches order
    merged: list[_Placement] = []
    for p in sorted(_unique(found), key=lambda p: (p.base.device.type, p.base.device.index or 0, p.address)):
        prev = merged[-1] if merged else None
        if (
            prev is not None
            and prev.base.device == p.base.device
            and prev.base.untyped_storage().data_ptr() == p.base.untyped_storage().data_ptr()
            and prev.stride == p.stride
            and prev.address + prev.width == p.address
            and prev.width + p.width <= prev.stride
        ):
            merged[-1] = _Placement(prev.name, prev.base, prev.offset, prev.stride, prev.width + p.width)
        else:
            merged.append(p)
    return _materialize(owner, sorted(merged, key=lambda p: order[p.name]), num_blocks)


def block_bytes(regions: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]) -> int:
    """Total bytes of one block across ``regions``: the row width of a packed gather buffer.

    Parameters
    ----------
    regions : sequence of Tensor, or mapping of str to Tensor
        uint8 regions ``[num_blocks, block_bytes]``, as :func:`resolve_regions` and
        :func:`infer_regions` return them; at least one.

    Raises
    ------
    ValueError
        ``regions`` is not a non-empty list, tuple or mapping of 2-D uint8 tensors: the cache
        tensors themselves, a single tensor, ``None``. The message names the argument, or the
        entry, and what it got.
    """
    return sum(r.shape[1] for r in byte_regions("kv_ops.block_bytes", "regions", regions))


__all__ = [
    "alias_bytes",
    "check_kv_caches",
    "KVCacheTensorSpec",
    "resolve_regions",
    "infer_regions",
    "regions_of",
    "block_bytes",
]
