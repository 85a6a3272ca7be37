"""The block-copy operators ``torch.ops.kv_ops.*``: schema, fake, CPU and CUDA implementations.

Each op is registered through :func:`kv_ops.cuda.registration.register_op` (why not ``custom_op``
is said there), with a public wrapper carrying the docstring. Mixed-device calls (GPU regions
with host regions) dispatch to the CUDA implementation: the dispatcher picks the
highest-priority backend among all tensor arguments.

Ops carry tensors and counts only. Addresses (including the device address of page-locked host
memory) are resolved inside the implementation at call time, so nothing process-specific is
baked into a compiled artifact.

Per call, an eager op does only what depends on the call: a region list is checked and its copy
bound the first time it is seen (:class:`_RegionSets`, by the regions' identity), the ids are
checked (their values only with :func:`kv_ops.set_id_checks` on), and the kernel is launched
once, reading the ids where they are, through the compiled kernel's own launcher after the first
call (:meth:`kv_ops.kernels.BoundCopy.launch_kernel`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping, Sequence

import torch

from . import kernels, reference
from . import validation as V
from .cuda import capture
from .cuda.registration import register_op

Regions = Sequence[torch.Tensor] | Mapping[str, torch.Tensor]
_CPU = torch.device("cpu")


def _kernel_device(*groups: Sequence[torch.Tensor], default: torch.device | None = None) -> torch.device:
    """The CUDA device the kernel runs on: that of the first CUDA tensor among the arguments, else
    ``default`` (an op whose one implementation serves the CPU too)."""
    for group in groups:
        for t in group:
            if t.device.type == "cuda":
                return t.device
    if default is not None:
        return default
    raise AssertionError("CUDA kernel dispatched without a CUDA tensor")


def _region_list(op: str, what: str, regions: Regions) -> list[torch.Tensor] | tuple[torch.Tensor, ...]:
    """``regions`` as the op takes them; for an object that is no list, mapping or iterable, the
    ``TypeError`` of :func:`_refuse_types`, naming ``what``."""
    # A list or tuple goes to the op as it is (the schema takes either); the type test first,
    # as an isinstance against the Mapping ABC costs about a microsecond per call.
    if type(regions) in (list, tuple):
        return regions
    if isinstance(regions, Mapping):
        return list(regions.values())
    try:
        return list(regions)
    except TypeError:
        _refuse_types(op, **{what: regions})
        raise


def _check_id_tensors(op: str, **ids) -> None:
    """The public wrappers' one check before the op: a list would reach the op's schema and fail
    there with a RuntimeError that names no argument. (One isinstance per argument.)"""
    for what, value in ids.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"{op}: {what} must be a 1-D int32 or int64 tensor on the kernel's device, got "
                f"{type(value).__name__} (the ops take tensors, e.g. torch.tensor(ids, device=...); "
                "OffloadEngine also takes lists)"
            )


def _call(name: str, op, args: tuple, sides: dict) -> None:
    """Run the op ``name`` (``op(*args)``), as every wrapper does; where it fails, the type error
    of :func:`_refuse_types` first, else the op's own. The ``try`` costs a call that succeeds
    nothing."""
    try:
        op(*args)
    except (TypeError, RuntimeError, AttributeError):
        _refuse_types(name, **sides)
        raise


def _refuse_types(op: str, **sides) -> None:
    """After the op refused a call: a ``TypeError`` naming the side that is not a tensor (``out``,
    ``packed``) or not a list or mapping of tensors (regions), which torch's own error words as a
    schema mismatch or an attribute missing from ``None``; nothing if every side is well typed
    (the error was about something else). Only a failed call gets here (:func:`_call`)."""
    for what, side in sides.items():
        if what in ("out", "packed"):
            items = [(what, side)]
        elif isinstance(side, Mapping):
            items = [(f"{what}[{key!r}]", t) for key, t in side.items()]
        elif isinstance(side, (list, tuple)):
            items = [(f"{what}[{i}]", t) for i, t in enumerate(side)]
        else:
            raise TypeError(
                f"{op}: {what} must be a list or mapping of region tensors, got {type(side).__name__}"
            ) from None
        for name, t in items:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}") from None


def _refuse_mixed(op: str, src, dst) -> None:
    """Called when exactly one side is a mapping of regions. A ``ValueError`` when the other is a
    list or tuple: a list has no names to pair by, and by position a mapping built in another
    order would pair the wrong regions, unnoticed where their block sizes agree. Any other side
    (a single tensor, None) is :func:`_refuse_types`'s error, raised here: pairing by name would
    otherwise take ``set()`` of it, which iterates a tensor's rows and fails comparing them."""
    for named, listed, other in (("src", "dst", dst), ("dst", "src", src)):
        if isinstance(other, (list, tuple)):
            raise ValueError(
                f"{op}: {named} is a mapping of regions but {listed} is a {type(other).__name__}, which has no "
                "names to pair them by; pass two mappings (paired by name) or two lists (paired by position)"
            )
    _refuse_types(op, src=src, dst=dst)  # always raises: one side is neither a mapping nor a list


class _RegionSet:
    """One checked pair of sides and its bound kernel copy."""

    __slots__ = ("bound", "src_limit", "dst_limit", "same_region", "width", "refs")

    def __init__(self, bound, src_limit: int, dst_limit: int, same_region: bool = False, width: int = 0):
        self.bound = bound
        self.src_limit, self.dst_limit = src_limit, dst_limit  # ids are valid below these
        self.same_region = same_region  # a copy within one region: no block both read and written
        self.width = width  # a packed side's row: the regions' block bytes summed
        self.refs = ()


class _RegionSets:
    """Region lists seen before, found by the identity of their tensors.

    The structural checks (dtype, shape, strides, devices, block sizes) and the kernel's region
    table depend only on the regions, so they run once per list, not per call. An entry is keyed
    by the regions' ``id``s and dropped as soon as any of its tensors is freed (a weak reference's
    callback), so a live key always names the very tensors it was made from. A region whose
    storage is swapped in place (``set_``, ``resize_``) after its first use is not supported.
    """

    def __init__(self):
        self._sets: dict[tuple, _RegionSet] = {}

    def get(self, key: tuple) -> _RegionSet | None:
        return self._sets.get(key)

    def add(self, key: tuple, tensors: Sequence[torch.Tensor], entry: _RegionSet) -> _RegionSet:
        sets = self._sets

        def forget(_ref, key=key):
            sets.pop(key, None)

        entry.refs = tuple(weakref.ref(t, forget) for t in tensors)
        sets[key] = entry
        return entry


_sets = _RegionSets()


def _key(kind: str, device: torch.device, src, dst) -> tuple:
    return (
        kind,
        device,
        tuple(map(id, src)) if src is not None else None,
        tuple(map(id, dst)) if dst is not None else None,
    )


def _check_ids(op: str, device: torch.device, pairs: Sequence[tuple[str, torch.Tensor]], length: int | None) -> None:
    """Per call: each id tensor is 1-D int32/int64 of the call's length, on the kernel's device."""
    for what, ids in pairs:
        V.check_ids_meta(op, what, ids, length)
        V.check_devices(op, device, ids=[(what, ids)], data=())
        length = ids.shape[0]


# The fakes' contract: the eager checks' conditions and words (kv_ops.validation), each condition
# through torch._check, as shapes may be symbolic here.


def _check_fake_region(op: str, what: str, i: int, region: torch.Tensor) -> None:
    torch._check(V.region_ok(region), lambda: V.region_message(op, what, i, region))


def _check_fake_ids(op: str, what: str, ids: torch.Tensor) -> None:
    torch._check(V.ids_ok(ids), lambda: V.ids_message(op, what, ids))


def _check_fake_packed(op: str, regions, ids: torch.Tensor, what: str, packed: torch.Tensor) -> None:
    for i, r in enumerate(regions):
        _check_fake_region(op, "regions", i, r)
    _check_fake_ids(op, "ids", ids)
    rows, width = ids.shape[0], sum(r.shape[1] for r in regions)
    for ok in V.packed_conditions(packed, rows, width):
        torch._check(ok, lambda: V.packed_message(op, what, packed, rows, width))


# --- copy_blocks ---------------------------------------------------------------------------------


def _copy_blocks_fake(src, dst, src_ids, dst_ids):
    op = "kv_ops.copy_blocks"
    V.check_fake_values(op, src_ids=src_ids, dst_ids=dst_ids, src=src, dst=dst)
    torch._check(V.same_count(src, dst), lambda: V.region_count_message(op, len(src), len(dst)))
    for i, (a, b) in enumerate(zip(src, dst)):
        _check_fake_region(op, "src", i, a)
        _check_fake_region(op, "dst", i, b)
        torch._check(V.same_width(a, b), lambda i=i, a=a, b=b: V.width_message(op, i, a.shape[1], b.shape[1]))
    _check_fake_ids(op, "src_ids", src_ids)
    _check_fake_ids(op, "dst_ids", dst_ids)
    torch._check(
        V.length_ok(dst_ids, src_ids.shape[0]),
        lambda: V.ids_length_message(op, "dst_ids", dst_ids.shape[0], src_ids.shape[0]),
    )


def _copy_set(src, dst, device: torch.device) -> _RegionSet:
    """The checked, bound copy between these region lists (checked on first sight only)."""
    key = _key("copy", device, src, dst)
    found = _sets.get(key)
    if found is not None:
        return found
    op = "kv_ops.copy_blocks"
    V.check_regions(op, "src", src)
    V.check_regions(op, "dst", dst)
    V.check_widths(op, src, dst)
    V.check_devices(
        op,
        device,
        ids=[],
        data=[(f"src[{i}]", t) for i, t in enumerate(src)] + [(f"dst[{i}]", t) for i, t in enumerate(dst)],
    )
    same = any(a.data_ptr() == b.data_ptr() and a.device == b.device for a, b in zip(src, dst))
    bound = kernels.BoundCopy(device, src, dst) if device.type == "cuda" else None
    entry = _RegionSet(bound, reference.num_blocks(src), reference.num_blocks(dst), same)
    return _sets.add(key, [*src, *dst], entry)


def _check_copy_values(entry: _RegionSet, src_ids, dst_ids) -> None:
    op = "kv_ops.copy_blocks"
    V.check_pair_values(op, src_ids, dst_ids, entry.src_limit, entry.dst_limit)
    if entry.same_region:
        V.check_disjoint_ids(op, src_ids, dst_ids)


def _count_skipped(skipped: int) -> None:
    """Add the ids a CPU copy skipped (out of range, checks off) to the CPU's error counter, as
    the kernels add theirs on the device."""
    if skipped:
        V.error_counter(_CPU).add_(skipped)


def _copy_blocks_cpu(src, dst, src_ids, dst_ids) -> None:
    entry = _copy_set(src, dst, _CPU)
    _check_ids("kv_ops.copy_blocks", _CPU, [("src_ids", src_ids), ("dst_ids", dst_ids)], None)
    if V.should_check_ids(_CPU):
        _check_copy_values(entry, src_ids, dst_ids)
    _count_skipped(reference.copy_blocks(src, dst, src_ids, dst_ids))


def _copy_blocks_cuda(src, dst, src_ids, dst_ids) -> None:
    device = _kernel_device([src_ids, dst_ids], src, dst)
    entry = _copy_set(src, dst, device)
    _check_ids("kv_ops.copy_blocks", device, [("src_ids", src_ids), ("dst_ids", dst_ids)], None)
    if V.id_checks_enabled() and not capture.capturing():
        _check_copy_values(entry, src_ids, dst_ids)
    # The kernel reads the ids where they are: no copy of them, no graph (a capture records the
    # launch as a kernel node), and after the first call no Triton binder either.
    entry.bound(None, src_ids, dst_ids, src_ids.shape[0], V.error_counter(device))


register_op(
    "kv_ops",
    "copy_blocks(Tensor[] src, Tensor(a!)[] dst, Tensor src_ids, Tensor dst_ids) -> ()",
    fake=_copy_blocks_fake,
    cpu=_copy_blocks_cpu,
    cuda=_copy_blocks_cuda,
)


def copy_blocks(src: Regions, dst: Regions, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """Copy blocks between two sets of regions: ``dst[r][dst_ids[i]] = src[r][src_ids[i]]``.

    Every region pair moves in one kernel launch. Works GPU->GPU, GPU<->page-locked host memory
    (zero-copy: the kernel reaches host memory through its device address) and CPU->CPU.

    Parameters
    ----------
    src, dst : sequence of Tensor, or mapping of str to Tensor
        uint8 regions ``[num_blocks, block_bytes]`` (from :func:`kv_ops.resolve_regions`);
        ``src[r]`` and ``dst[r]`` have equal ``block_bytes`` but may differ in ``num_blocks``.
        Two mappings are paired by key and must have the same keys; two lists by position. A
        mapping and a list are refused: a list has no names to pair by. Checked when first
        seen; keep using the same tensors (the op finds them again by identity).
    src_ids, dst_ids : Tensor
        1-D int32/int64 of equal length ``n``, on the kernel's device (the GPU, if any region is
        on the GPU).

    Raises
    ------
    ValueError
        Before any byte moves: one of ``src`` and ``dst`` a mapping, the other a list; in
        eager mode, an id outside ``[0, num_blocks)``, a repeated
        destination id, mismatched block sizes, a wrong dtype or device, ids that are not
        tensors (a list: pass ``torch.tensor(ids, device=...)``), a meta tensor (it holds no
        values: the call would move nothing). Id checks can be turned off
        with :func:`kv_ops.set_id_checks`; then, and inside captured graphs, a pair with an
        out-of-range id is skipped and counted in :func:`kv_ops.error_count`.
    TypeError
        ``src`` or ``dst`` that is not a list or mapping of tensors (as ``gather_blocks`` and
        ``scatter_blocks`` refuse regions, ``out`` or ``packed`` that are not tensors).

    Examples
    --------
    >>> gpu = kv_ops.infer_regions(kv_caches, num_blocks)
    >>> host = {k: kv_ops.pinned_empty((num_host_blocks, r.shape[1])) for k, r in gpu.items()}
    >>> kv_ops.copy_blocks(gpu, host, gpu_ids, host_ids)      # store: GPU -> host
    """
    # The type tests first: a list skips the Mapping ABC's isinstance (see _region_list).
    src_named = type(src) not in (list, tuple) and isinstance(src, Mapping)
    dst_named = type(dst) not in (list, tuple) and isinstance(dst, Mapping)
    if src_named != dst_named:
        _refuse_mixed("kv_ops.copy_blocks", src, dst)
    if src_named:
        if set(src) != set(dst):
            raise ValueError(f"kv_ops.copy_blocks: src and dst name different regions: {sorted(src)} vs {sorted(dst)}")
        dst = {name: dst[name] for name in src}  # paired by name, whatever order each was built in
    _check_id_tensors("kv_ops.copy_blocks", src_ids=src_ids, dst_ids=dst_ids)
    args = (
        _region_list("kv_ops.copy_blocks", "src", src),
        _region_list("kv_ops.copy_blocks", "dst", dst),
        src_ids,
        dst_ids,
    )
    _call("kv_ops.copy_blocks", torch.ops.kv_ops.copy_blocks, args, {"src": src, "dst": dst})


# --- gather_blocks -------------------------------------------------------------------------------


def _gather_blocks_fake(regions, ids, out):
    V.check_fake_values("kv_ops.gather_blocks", ids=ids, regions=regions, out=out)
    _check_fake_packed("kv_ops.gather_blocks", regions, ids, "out", out)


def _packed_set(kind: str, op: str, regions, device: torch.device) -> _RegionSet:
    """The checked, bound copy between these regions and a packed side (gather or scatter)."""
    key = _key(kind, device, regions, None)
    found = _sets.get(key)
    if found is not None:
        return found
    V.check_regions(op, "regions", regions)
    V.check_devices(op, device, ids=[], data=[(f"regions[{i}]", t) for i, t in enumerate(regions)])
    bound = None
    if device.type == "cuda":
        bound = (
            kernels.BoundCopy(device, regions, None) if kind == "gather" else kernels.BoundCopy(device, None, regions)
        )
    limit = reference.num_blocks(regions)
    entry = _RegionSet(bound, limit, limit, width=sum(r.shape[1] for r in regions))
    return _sets.add(key, regions, entry)


def _packed_call(kind: str, regions, ids, packed) -> None:
    """One gather or scatter, the op's CPU and CUDA implementation alike: the ids, and the packed
    side against the regions' width (a scatter's ids are destinations, so they must not repeat),
    then the reference where every tensor is on the CPU, else the regions' bound kernel."""
    op, what = ("kv_ops.gather_blocks", "out") if kind == "gather" else ("kv_ops.scatter_blocks", "packed")
    device = _kernel_device([ids, packed], regions, default=_CPU)
    entry = _packed_set(kind, op, regions, device)
    _check_ids(op, device, [("ids", ids)], None)
    V.check_packed(op, what, packed, ids.shape[0], entry.width)
    V.check_devices(op, device, ids=[], data=[(what, packed)])
    if V.should_check_ids(device):
        V.check_ids_values(op, "ids", ids, entry.src_limit, unique=kind == "scatter")
    gather = kind == "gather"
    if device.type == "cpu":
        skipped = (
            reference.gather_blocks(regions, ids, packed) if gather else reference.scatter_blocks(packed, ids, regions)
        )
        _count_skipped(skipped)
    else:
        src_ids, dst_ids = (ids, None) if gather else (None, ids)
        entry.bound(packed, src_ids, dst_ids, ids.shape[0], V.error_counter(device))


register_op(
    "kv_ops",
    "gather_blocks(Tensor[] regions, Tensor ids, Tensor(a!) out) -> ()",
    fake=_gather_blocks_fake,
    cpu=functools.partial(_packed_call, "gather"),  # serves CUDA too
)


def gather_blocks(regions: Regions, ids: torch.Tensor, out: torch.Tensor) -> None:
    """Pack the chosen blocks of all regions into one contiguous buffer, for disk or network.

    ``out[i] = concat(regions[0][ids[i]], regions[1][ids[i]], ...)``.

    Parameters
    ----------
    regions : sequence of Tensor, or mapping of str to Tensor
        uint8 regions ``[num_blocks_r, block_bytes_r]``.
    ids : Tensor
        1-D int32/int64 ``[n]``.
    out : Tensor
        uint8 ``[n, sum(block_bytes_r)]`` with contiguous rows; GPU or page-locked host memory.
        Rows of skipped (out-of-range) ids are left unwritten.

    Examples
    --------
    >>> staging = kv_ops.pinned_empty((len(ids), kv_ops.block_bytes(regions)))
    >>> kv_ops.gather_blocks(regions, ids, staging)       # GPU regions -> one host buffer
    """
    _check_id_tensors("kv_ops.gather_blocks", ids=ids)
    args = (_region_list("kv_ops.gather_blocks", "regions", regions), ids, out)
    _call("kv_ops.gather_blocks", torch.ops.kv_ops.gather_blocks, args, {"regions": regions, "out": out})


# --- scatter_blocks ------------------------------------------------------------------------------


def _scatter_blocks_fake(packed, ids, regions):
    V.check_fake_values("kv_ops.scatter_blocks", ids=ids, packed=packed, regions=regions)
    _check_fake_packed("kv_ops.scatter_blocks", regions, ids, "packed", packed)


def _scatter_blocks_impl(packed, ids, regions) -> None:
    _packed_call("scatter", regions, ids, packed)


register_op(
    "kv_ops",
    "scatter_blocks(Tensor packed, Tensor ids, Tensor(a!)[] regions) -> ()",
    fake=_scatter_blocks_fake,
    cpu=_scatter_blocks_impl,  # serves CUDA too
)


def scatter_blocks(packed: torch.Tensor, ids: torch.Tensor, regions: Regions) -> None:
    """Unpack a buffer made by :func:`gather_blocks` into the chosen blocks of all regions.

    ``regions[r][ids[i]] = packed[i, col_r : col_r + block_bytes_r]``, ``col_r`` the sum of the
    block bytes of the regions before r.

    Parameters
    ----------
    packed : Tensor
        uint8 ``[n, sum(block_bytes_r)]`` with contiguous rows; GPU or page-locked host memory.
    ids : Tensor
        1-D int32/int64 ``[n]``, no id twice.
    regions : sequence of Tensor, or mapping of str to Tensor
        uint8 regions ``[num_blocks_r, block_bytes_r]``, written.

    Examples
    --------
    >>> kv_ops.scatter_blocks(staging, new_ids, regions)  # one host buffer -> GPU regions
    """
    _check_id_tensors("kv_ops.scatter_blocks", ids=ids)
    args = (packed, ids, _region_list("kv_ops.scatter_blocks", "regions", regions))
    _call("kv_ops.scatter_blocks", torch.ops.kv_ops.scatter_blocks, args, {"packed": packed, "regions": regions})


__all__ = ["copy_blocks", "gather_blocks", "scatter_blocks"]
