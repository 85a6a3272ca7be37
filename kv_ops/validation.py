"""What the block ops do with bad input: eager checks, and the counter of skipped pairs.

Two layers of defence:

* In eager mode every op checks its arguments before a byte moves and raises ``ValueError``
  naming the offending value. Shape, dtype and device checks read only metadata and always run.
  Id checks (range, duplicate destinations) read the id values, which for CUDA ids costs one
  device-to-host sync; they can be turned off for hot paths with :func:`set_id_checks`, and are
  skipped while a CUDA graph is being captured, where a sync is illegal.
* The kernels themselves never trust an id: a pair with an id outside ``[0, num_blocks)`` is
  skipped in every region and counted in a per-device counter that :func:`error_count` reads.
  That is what protects compiled and captured graphs, whose ids change after the checks ran.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

import numpy as np
import torch

from .cuda import arguments, host_memory
from .cuda.capture import capturing, refuse_capture
from .cuda.driver import check_code, copy_calls, current_stream_handle, driver_context

_id_checks = True
_counters: dict[torch.device, torch.Tensor] = {}


def set_id_checks(enabled: bool) -> bool:
    """Turn the eager id checks on or off for every op; returns the previous setting.

    Raises
    ------
    ValueError
        ``enabled`` is not a bool: ``"no"`` or ``None`` would otherwise be read by truthiness,
        the opposite of what was meant in one case or the other.

    Examples
    --------
    >>> previous = kv_ops.set_id_checks(False)   # hot path: trust the scheduler's ids
    """
    global _id_checks
    if not isinstance(enabled, (bool, np.bool_)):
        raise ValueError(f"set_id_checks: enabled must be True or False, got {enabled!r}")
    previous, _id_checks = _id_checks, bool(enabled)
    return previous


@contextlib.contextmanager
def id_checks(enabled: bool):
    """Context manager form of :func:`set_id_checks`."""
    previous = set_id_checks(enabled)
    try:
        yield
    finally:
        set_id_checks(previous)


def id_checks_enabled() -> bool:
    """Whether :func:`set_id_checks` has the id-value checks on (capture aside)."""
    return _id_checks


def should_check_ids(device: torch.device) -> bool:
    """Whether an op running now on ``device`` checks id values (needs a host sync on CUDA)."""
    return _id_checks and not capturing(device)


def error_counter(device: torch.device | str | int | None = None) -> torch.Tensor:
    """The int64 ``[1]`` tensor in which kernels on ``device`` count skipped pairs.

    The tensor lives for the whole process, so a captured graph may hold its address. Create it
    (any op's warm-up does) before capturing a graph; creating it during capture would record
    its zero-fill into the graph.
    """
    try:
        counter = _counters.get(device)  # a device seen before, as the ops pass it on every call
    except TypeError:  # unhashable (a list): no device; the rule below names it
        counter = None
    if counter is not None:
        return counter
    return _counter("kv_ops.error_counter", device)


def _counter(owner: str, device) -> torch.Tensor:
    """:func:`error_counter` past its fast path, with errors that name ``owner``, the call made."""
    device = arguments.device(owner, device)
    if device.type not in ("cuda", "cpu"):
        # The kernels run on GPUs and the CPU only; a meta counter would hold no count to read.
        raise ValueError(f"{owner}: device {device} has no error counter; pass a CUDA device or the CPU")
    counter = _counters.get(device)
    if counter is None:
        refuse_capture(
            "kv_ops",
            f"the error counter for {device} does not exist yet",
            "run the op once (warm-up) or call kv_ops.error_counter(device) before capturing a CUDA graph",
            device=device,
        )
        # Outside any CUDA-graph pool: the counter outlives every graph that uses it.
        counter = _counters[device] = host_memory.lasting_copy(torch.zeros(1, dtype=torch.int64), device)
    return counter


def error_count(device: torch.device | str | int | None = None) -> int:
    """Pairs skipped so far on ``device`` because an id was out of range (syncs the device).

    Raises
    ------
    ValueError
        ``device`` is no device, a CUDA device this machine lacks, or neither CUDA nor the CPU.
    """
    return int(_counter("kv_ops.error_count", device).item())


def reset_error_count(device: torch.device | str | int | None = None) -> None:
    """Set the counter of ``device`` to zero (stream-ordered on CUDA)."""
    _counter("kv_ops.reset_error_count", device).zero_()


# --- metadata checks (always on) -----------------------------------------------------------------


# --- the rules, one place: each condition and its words, used by the eager checks below and by ---
# --- the ops' fakes (which hand the condition to torch._check, as shapes may be symbolic there) ---


def holds_values(t: torch.Tensor) -> bool:
    # is_meta, not device.type (which makes a torch.device); a fake tensor, under torch.compile, is not meta.
    return not t.is_meta


def no_values_message(op: str, what: str) -> str:
    return f"{op}: {what} is a meta tensor, which holds no values; pass a tensor on the CPU or a GPU"


def check_fake_values(op: str, **sides) -> None:
    """An op's fake: no side is a meta tensor. A call with a real meta tensor among its arguments
    reaches the fake and nothing else (the dispatcher ranks the Meta kernel above every backend),
    where it would move nothing and return: so this is that call's eager check, and raises
    ``ValueError`` as the eager checks do. Each side is a tensor or a list of tensors."""
    for what, side in sides.items():
        named = [(what, side)] if isinstance(side, torch.Tensor) else [(f"{what}[{i}]", t) for i, t in enumerate(side)]
        for name, t in named:
            torch._check_value(holds_values(t), lambda name=name: no_values_message(op, name))


def region_ok(region: torch.Tensor) -> bool:
    return region.dim() == 2 and region.dtype == torch.uint8


def ids_ok(ids: torch.Tensor) -> bool:
    return ids.dim() == 1 and ids.dtype in (torch.int32, torch.int64)


def same_count(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> bool:
    return len(src) == len(dst)


def same_width(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape[1] == b.shape[1]


def length_ok(ids: torch.Tensor, length) -> bool:
    return ids.shape[0] == length


def packed_conditions(packed: torch.Tensor, rows, width):
    """The packed buffer's rule as conditions in order, each read only once those before it held
    (its shape is read only once it is 2-D): ``all()`` of them, or one ``torch._check`` each."""
    yield packed.dim() == 2 and packed.dtype == torch.uint8
    yield packed.shape[0] == rows
    yield packed.shape[1] == width


def region_message(op: str, what: str, i: int, region: torch.Tensor) -> str:
    return f"{op}: {what}[{i}] must be a 2-D uint8 region [num_blocks, block_bytes], got {region.dtype} {tuple(region.shape)}"


def region_count_message(op: str, num_src: int, num_dst: int) -> str:
    return f"{op}: {num_src} source regions but {num_dst} destination regions"


def width_message(op: str, i: int, src_bytes: int, dst_bytes: int) -> str:
    return f"{op}: region pair {i} has block sizes {src_bytes} (src) and {dst_bytes} (dst)"


def ids_message(op: str, what: str, ids: torch.Tensor) -> str:
    return f"{op}: {what} must be a 1-D int32 or int64 tensor, got {ids.dtype} {tuple(ids.shape)}"


def ids_length_message(op: str, what: str, num_ids: int, length: int) -> str:
    return f"{op}: {what} has {num_ids} ids, expected {length}"


def packed_message(op: str, what: str, packed: torch.Tensor, rows: int, width: int) -> str:
    return (
        f"{op}: {what} must be uint8 of shape ({rows}, {width}) = (ids, sum of block bytes), "
        f"got {packed.dtype} {tuple(packed.shape)}"
    )


# --- structural checks (eager) -------------------------------------------------------------------


def check_regions(op: str, what: str, regions: Sequence[torch.Tensor]) -> None:
    """Every region is a 2-D uint8 view whose rows are contiguous and do not overlap."""
    if len(regions) == 0:
        raise ValueError(f"{op}: {what} is an empty list of regions")
    for i, r in enumerate(regions):
        if not region_ok(r):
            raise ValueError(region_message(op, what, i, r))
        if r.shape[1] > 1 and r.stride(1) != 1:
            raise ValueError(f"{op}: {what}[{i}] has byte stride {r.stride(1)}; block bytes must be contiguous")
        if r.shape[0] > 1 and r.stride(0) < r.shape[1]:
            raise ValueError(f"{op}: {what}[{i}] blocks overlap: block stride {r.stride(0)} < block bytes {r.shape[1]}")


def check_ids_meta(op: str, what: str, ids: torch.Tensor, length: int | None = None) -> None:
    if not ids_ok(ids):
        raise ValueError(ids_message(op, what, ids))
    if length is not None and not length_ok(ids, length):
        raise ValueError(ids_length_message(op, what, ids.shape[0], length))


def check_widths(op: str, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> None:
    if not same_count(src, dst):
        raise ValueError(region_count_message(op, len(src), len(dst)))
    for i, (a, b) in enumerate(zip(src, dst)):
        if not same_width(a, b):
            raise ValueError(width_message(op, i, a.shape[1], b.shape[1]))


def check_packed(op: str, what: str, packed: torch.Tensor, rows: int, width: int) -> None:
    if not all(packed_conditions(packed, rows, width)):
        raise ValueError(packed_message(op, what, packed, rows, width))
    if width > 1 and packed.stride(1) != 1:
        raise ValueError(f"{op}: {what} must have contiguous rows, got strides {packed.stride()}")


def check_devices(
    op: str, device: torch.device, ids: Sequence[tuple[str, torch.Tensor]], data: Sequence[tuple[str, torch.Tensor]]
) -> None:
    """Ids sit on the kernel's ``device``. Data (regions, packed buffers) too, except that the CUDA
    kernel also reaches host (CPU) tensors, which must then be page-locked (checked when their
    device address is resolved)."""
    for what, t in ids:
        if t.device != device:
            raise ValueError(f"{op}: {what} is on {t.device}, but this call runs on {device}")
    for what, t in data:
        if t.device != device and not (device.type == "cuda" and t.device.type == "cpu"):
            raise ValueError(f"{op}: {what} is on {t.device}, but this call runs on {device}")


# --- value checks (eager, switchable) ------------------------------------------------------------


def check_ids_values(op: str, what: str, ids: torch.Tensor, limit: int, unique: bool = False) -> None:
    """Every id lies in ``[0, limit)``; with ``unique``, no id repeats. CUDA ids: one copy to the
    host (one sync), then the numpy check."""
    if ids.numel() == 0:
        return
    (values,) = _host_values(ids)
    check_host_ids(op, what, values, limit, unique)


def check_pair_values(op: str, src_ids: torch.Tensor, dst_ids: torch.Tensor, src_limit: int, dst_limit: int) -> None:
    """:func:`check_ids_values` of a copy's ids (sources in range; destinations in range and
    distinct), with one copy of both to the host (one sync for CUDA ids)."""
    if src_ids.numel() == 0:
        return
    src, dst = _host_values(src_ids, dst_ids)
    check_host_ids(op, "src_ids", src, src_limit)
    check_host_ids(op, "dst_ids", dst, dst_limit, unique=True)


class _Staging(threading.local):
    """Per thread: the page-locked bytes that CUDA ids are copied into to be checked."""

    tensor: torch.Tensor | None = None
    bytes: np.ndarray | None = None


_staging = _Staging()


def _host_values(*sides: torch.Tensor) -> list[np.ndarray]:
    """The values of 1-D int32/int64 id tensors (all on one device) as numpy arrays, valid until
    this thread's next call.

    CUDA ids are copied on the current stream into this thread's page-locked buffer, then that
    stream is waited for: what ``.cpu()`` waits for too, but two driver copies instead of torch's
    concatenation, allocation and pageable copy. The wait is most of what the checks cost an
    eager call: the call before may still be copying on that stream (:func:`set_id_checks`).
    """
    device = sides[0].device
    if device.type != "cuda":
        return [side.detach().numpy() for side in sides]
    sides = [side if side.is_contiguous() else side.contiguous() for side in sides]
    sizes = [side.numel() * side.element_size() for side in sides]
    offsets = [0]
    for size in sizes[:-1]:
        offsets.append(offsets[-1] + -(-size // 8) * 8)  # each side 8-byte aligned for its view
    total = offsets[-1] + sizes[-1]
    staging = _staging
    if staging.tensor is None or staging.tensor.numel() < total:
        staging.tensor = host_memory.pinned_empty(max(total, 1 << 16))
        staging.bytes = staging.tensor.numpy()
    base = staging.tensor.data_ptr()
    memcpy, synchronize = copy_calls()
    with driver_context(device):
        stream = current_stream_handle(device.index)
        for side, at, size in zip(sides, offsets, sizes):
            check_code(memcpy(base + at, side.data_ptr(), size, stream), "cuMemcpyAsync")
        check_code(synchronize(stream), "cuStreamSynchronize")
    return [
        staging.bytes[at : at + size].view(np.int32 if side.dtype == torch.int32 else np.int64)
        for side, at, size in zip(sides, offsets, sizes)
    ]


# Up to this many ids Python's min, max and set over a list beat numpy: each of numpy's four
# operations pays a fixed per-call cost that a scheduler's short list of ids does not amortise.
SMALL_IDS = 64


def check_host_ids(op: str, what: str, ids: np.ndarray | list | tuple, limit: int, unique: bool = False) -> None:
    """The id rule, for ids already on the host: every id lies in ``[0, limit)``; with ``unique``,
    no id repeats. ``ids`` is a 1-D integer numpy array or a list or tuple of ints. Up to
    :data:`SMALL_IDS` ids (a scheduler's short list) the check runs on a list, above it in numpy;
    the message is made only if an id is bad."""
    if type(ids) in (list, tuple):
        values = ids
    else:
        values = ids.tolist() if ids.size <= SMALL_IDS else None
    if values is not None:
        if not values or (min(values) >= 0 and max(values) < limit and not (unique and len(set(values)) < len(values))):
            return
        ids = np.asarray(ids, dtype=np.int64)
    if ids.size == 0:
        return
    if int(ids.min()) < 0 or int(ids.max()) >= limit:
        i = int(np.flatnonzero((ids < 0) | (ids >= limit))[0])
        raise ValueError(f"{op}: {what}[{i}] = {int(ids[i])} is outside [0, {limit})")
    if unique and ids.size > 1:
        ordered = np.sort(ids)
        repeated = ordered[1:][ordered[1:] == ordered[:-1]]
        if repeated.size:
            dup = int(repeated[0])  # the smallest repeated id
            where = np.flatnonzero(ids == dup).tolist()
            raise ValueError(f"{op}: {what} names block {dup} more than once (positions {where[:4]})")


def check_disjoint_ids(op: str, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """For a copy within one region: no block is both read and written (the order would race)."""
    both = torch.isin(dst_ids, src_ids)
    if bool(both.any()):
        i = int(both.nonzero()[0])
        raise ValueError(
            f"{op}: block {int(dst_ids[i])} is both a source and a destination (dst_ids[{i}]) of a copy "
            "within the same region"
        )


__all__ = [
    "set_id_checks",
    "id_checks",
    "should_check_ids",
    "error_counter",
    "error_count",
    "reset_error_count",
    "check_regions",
    "check_ids_meta",
    "check_widths",
    "check_packed",
    "check_devices",
    "check_ids_values",
    "check_host_ids",
    "SMALL_IDS",
    "check_pair_values",
    "id_checks_enabled",
    "check_disjoint_ids",
]
