"""Copy plans for the copy engines (pure, vectorised) and their launch: batched and 2-D driver calls.

A copy is planned on the host, vectorised: runs of ids that are consecutive on both sides merge
into one copy where both regions keep their blocks back to back, and every copy becomes a
(destination, source, size) triple in three int64 tensors. Those tensors are the descriptor
arrays themselves: ``cuMemcpyBatchAsync`` is called through ctypes with their data pointers, so
no Python object is built per block. Where the driver lacks the batched call (before CUDA 12.8),
the same plan runs as one ``cuMemcpyAsync`` per copy.

Copy engines need no SMs and share the link better than kernels (both directions at once), but
pay a fixed host and driver cost per copy and cannot be captured into a CUDA graph. On the CPU,
:func:`run_on_host` executes the same plan with ``memmove``, so the engine's copy-engine paths
run, plan for plan, in CI.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ..cuda.capture import refuse_capture
from ..cuda.driver import c_function, check_code, check_driver, copy_calls, driver, driver_context
from ..validation import check_host_ids, check_widths

# Ask the driver for copy engines that overlap with compute (CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE).
# A module setting, read when a launcher is made, so a benchmark can compare both.
PREFER_OVERLAP_WITH_COMPUTE = True

# One batched call takes at most this many copies; a larger plan is split (the driver documents
# no limit, this keeps each descriptor array modest).
MAX_COPIES_PER_CALL = 1 << 16


OP = "kv_ops.dma"  # how errors name this module

# --- planning ------------------------------------------------------------------------------------


@dataclass
class Plan:
    """Copies for one transfer: ``dsts[i] <- srcs[i]``, ``sizes[i]`` bytes (contiguous int64 numpy
    arrays: the descriptor arrays the driver reads)."""

    dsts: np.ndarray
    srcs: np.ndarray
    sizes: np.ndarray

    @property
    def count(self) -> int:
        return self.sizes.size


_EMPTY = np.empty(0, dtype=np.int64)


def host_array(ids) -> np.ndarray:
    """Ids (a CPU tensor or an array) as a 1-D int64 numpy array, without a copy where possible."""
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    return np.asarray(ids, dtype=np.int64).reshape(-1)


def run_starts(src_ids, dst_ids) -> tuple[np.ndarray, np.ndarray]:
    """Start index and length of each run of pairs whose ids both go up by one."""
    src_ids, dst_ids = host_array(src_ids), host_array(dst_ids)
    n = src_ids.size
    if n == 0:
        return _EMPTY, _EMPTY
    breaks = (np.diff(src_ids) != 1) | (np.diff(dst_ids) != 1)
    starts = np.flatnonzero(np.concatenate(([True], breaks)))
    lengths = np.diff(starts, append=n)
    return starts, lengths


# A pair (src, dst) as one int64 word, src in the high half: a run is where the word goes up by
# exactly this (both ids by one; with ids in [0, 2**31), no other pair of differences sums to it).
_RUN_STEP = (1 << 32) + 1


def count_runs(src_ids: np.ndarray, dst_ids: np.ndarray) -> int:
    """How many runs :func:`run_starts` finds, for int64 ids in ``[0, 2**31)`` (the engine's, checked),
    in four numpy operations: auto's pick needs only this, on every call, and one pass over packed
    words is cheaper than the two differences compared apart (figures: docs/measurements.md)."""
    n = src_ids.size
    if n < 2:
        return n
    words = (src_ids << 32) | dst_ids
    return int(np.count_nonzero(words[1:] - words[:-1] != _RUN_STEP)) + 1


def back_to_back(region: torch.Tensor) -> bool:
    """Whether a region's blocks follow each other in memory (a run of them is one span)."""
    return region.stride(0) == region.shape[1] or region.shape[0] == 1


def _merges(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether a run of consecutive ids is one copy for this region pair."""
    return back_to_back(src) and back_to_back(dst)


def count_copies(src: list[torch.Tensor], dst: list[torch.Tensor], num_pairs: int, runs: tuple) -> int:
    """How many copies :func:`plan_copies` issues for ``num_pairs`` pairs forming ``runs``."""
    return sum(runs[0].size if _merges(s, d) else num_pairs for s, d in zip(src, dst))


class Planner:
    """Plans copies between two fixed lists of regions; every address except the ids' is bound once.

    ``src[r]`` and ``dst[r]`` are uint8 ``[num_blocks, block_bytes]`` regions with contiguous rows
    (any row stride) and equal block sizes. Each plan is a few numpy broadcasts over all regions
    at once, whatever their number. Ids are trusted: :func:`plan_copies` checks them, and the
    engine checked them when the call came in.
    """

    def __init__(self, src: list[torch.Tensor], dst: list[torch.Tensor]):
        check_widths(OP, src, dst)
        self.src_limit = min(s.shape[0] for s in src) if src else 0
        self.dst_limit = min(d.shape[0] for d in dst) if dst else 0
        # Per group (regions whose runs merge into one copy, and the rest): base addresses, block
        # strides and widths as [regions, 1] columns.
        self.groups = []
        merged = [_merges(s, d) for s, d in zip(src, dst)]
        for merge in (True, False):
            pick = [r for r, m in enumerate(merged) if m == merge]
            if pick:
                column = lambda values: np.array(values, dtype=np.int64).reshape(-1, 1)  # noqa: E731
                self.groups.append(
                    (
                        merge,
                        column([src[r].data_ptr() for r in pick]),
                        column([src[r].stride(0) for r in pick]),
                        column([dst[r].data_ptr() for r in pick]),
                        column([dst[r].stride(0) for r in pick]),
                        column([src[r].shape[1] for r in pick]),
                    )
                )

    def plan(self, src_ids: np.ndarray, dst_ids: np.ndarray, runs: tuple | None = None) -> Plan:
        if src_ids.size == 0 or not self.groups:
            return Plan(_EMPTY, _EMPTY, _EMPTY)
        if runs is None and self.groups[0][0]:
            runs = run_starts(src_ids, dst_ids)
        dsts, srcs, sizes = [], [], []
        for merge, s_base, s_stride, d_base, d_stride, width in self.groups:
            if merge:
                # A run of consecutive blocks is one contiguous span on both sides: one copy.
                starts, count = runs
                s_first, d_first = src_ids[starts], dst_ids[starts]
                sizes.append((width * count).ravel())
            else:
                s_first, d_first = src_ids, dst_ids
                sizes.append(np.repeat(width.ravel(), src_ids.size))
            # [regions, copies]: every region's copies in one broadcast.
            srcs.append((s_base + s_first * s_stride).ravel())
            dsts.append((d_base + d_first * d_stride).ravel())
        if len(sizes) == 1:
            return Plan(dsts[0], srcs[0], sizes[0])
        return Plan(np.concatenate(dsts), np.concatenate(srcs), np.concatenate(sizes))


def plan_copies(
    src: list[torch.Tensor],
    dst: list[torch.Tensor],
    src_ids,
    dst_ids,
    runs: tuple | None = None,
) -> Plan:
    """Plan ``dst[r][dst_ids[i]] = src[r][src_ids[i]]`` for every region pair r.

    ``src[r]`` and ``dst[r]`` are uint8 ``[num_blocks, block_bytes]`` regions with contiguous
    rows (any row stride), ids are 1-D integer host tensors or arrays of equal length. Ids are
    checked against every region, so no copy can reach outside one. ``runs`` is
    ``run_starts(src_ids, dst_ids)`` when the caller already has it.
    """
    src_ids, dst_ids = host_array(src_ids), host_array(dst_ids)
    if src_ids.shape != dst_ids.shape:
        raise ValueError(
            f"{OP}: ids must be 1-D and of equal length, got {tuple(src_ids.shape)} and {tuple(dst_ids.shape)}"
        )
    planner = Planner(src, dst)
    if src_ids.size == 0 or not src:
        return Plan(_EMPTY, _EMPTY, _EMPTY)
    # The last guard before raw addresses: an id outside the smallest region would be a wild copy.
    check_host_ids(OP, "src_ids", src_ids, planner.src_limit)
    check_host_ids(OP, "dst_ids", dst_ids, planner.dst_limit)
    return planner.plan(src_ids, dst_ids, runs)


# --- the driver calls ----------------------------------------------------------------------------

_P, _N = ctypes.c_void_p, ctypes.c_size_t


@functools.cache
def _entry_points() -> tuple[object | None, object, int]:
    """(batched call or None, per-copy cuMemcpyAsync, CUDA version of the batched signature)."""
    drv = driver()
    (version,) = check_driver(drv.cuDriverGetVersion(), "cuDriverGetVersion")
    memcpy = copy_calls()[0]
    batch, batch_version = None, 0
    if version >= 13000:
        # CUDA 13: (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream)
        batch, batch_version = c_function("cuMemcpyBatchAsync", 13000, _P, _P, _P, _N, _P, _P, _N, _P), 13000
    elif version >= 12080:
        # CUDA 12.8: the same with size_t* failIdx before the stream.
        batch, batch_version = c_function("cuMemcpyBatchAsync", 12080, _P, _P, _P, _N, _P, _P, _N, _P, _P), 12080
    if batch is None:
        batch_version = 0
    return batch, memcpy, batch_version


@functools.cache
def _stream_order_attributes(prefer_overlap: bool):
    """One attribute set for every copy: read the source in stream order.

    STREAM order is what makes a store correct: the source is GPU memory that the compute
    before the copy writes. (ANY would let the engine read it early.)
    """
    drv = driver()

    attrs = drv.CUmemcpyAttributes()
    attrs.srcAccessOrder = drv.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    if prefer_overlap:
        attrs.flags = int(drv.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE)
    first = (ctypes.c_size_t * 1)(0)
    return attrs, first


class _Memcpy2D(ctypes.Structure):
    """The driver's ``CUDA_MEMCPY2D``; with ``CU_MEMORYTYPE_UNIFIED`` on both sides only the
    device addresses, pitches and the extent are read."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


_CU_MEMORYTYPE_UNIFIED = 4


class Copy2D(NamedTuple):
    """``height`` rows of ``width`` bytes: row ``j`` from ``src + j * src_pitch`` to ``dst + j *
    dst_pitch``. One copy-engine operation however many rows: strided pieces of consecutive
    blocks (a region's columns of a run of mirror rows) move as one, at the link's full rate for
    rows of a block's width (figures: docs/measurements.md). A named tuple: a start of a
    32-layer model makes one per layer and piece, and a frozen dataclass costs several times as
    much to make."""

    dst: int
    dst_pitch: int
    src: int
    src_pitch: int
    width: int
    height: int


def run_2d_on_host(copy: Copy2D) -> None:
    """Execute one :class:`Copy2D` row by row with ``memmove`` (host memory on both sides)."""
    for j in range(copy.height):
        ctypes.memmove(copy.dst + j * copy.dst_pitch, copy.src + j * copy.src_pitch, copy.width)


def batched_copy_abi() -> int:
    """The CUDA version whose ``cuMemcpyBatchAsync`` signature the driver gave us (13000 or
    12080), or 0 where it has none (then :func:`launch` loops one ``cuMemcpyAsync`` per copy)."""
    return _entry_points()[2]


def has_batched_copy() -> bool:
    """Whether the driver offers ``cuMemcpyBatchAsync`` (else :func:`launch` loops per copy)."""
    return batched_copy_abi() != 0


class Launcher:
    """Enqueues plans on one created stream: the entry points, the stream handle and the copy
    attributes are bound once, so a launch is one ctypes call per :data:`MAX_COPIES_PER_CALL`.

    Callers make sure the stream is not being captured (the engine's streams never are; the
    public :func:`launch` asks the driver first) and call from inside
    :func:`kv_ops.cuda.driver.driver_context` of the stream's device (a path enters it once per
    transfer).
    """

    def __init__(self, stream: torch.cuda.Stream):
        if stream.cuda_stream == 0:  # (the batched call refuses it)
            raise ValueError("kv_ops.dma: the legacy default stream cannot take batched copies; pass a created stream")
        self.stream = stream
        self.device = stream.device
        self.handle = ctypes.c_void_p(stream.cuda_stream)
        self._batch, self._memcpy, version = _entry_points()
        # Held for the launcher's life: the driver reads the attribute struct at every call, and
        # it lives inside the cuda-bindings object (a bare getPtr() would dangle once it is freed).
        self._attrs, self._first = _stream_order_attributes(PREFER_OVERLAP_WITH_COMPUTE)
        # The arguments after the three descriptor arrays and the count, in the driver's order.
        self._tail = [_P(self._attrs.getPtr()), ctypes.cast(self._first, _P), 1]
        if version == 12080:
            self._fail_index = ctypes.c_size_t(0)
            self._tail.append(ctypes.cast(ctypes.pointer(self._fail_index), _P))
        self._tail.append(self.handle)
        # One 2-D descriptor for every 2-D copy: the driver reads it during the call.
        self._2d = _Memcpy2D()
        self._2d.srcMemoryType = self._2d.dstMemoryType = _CU_MEMORYTYPE_UNIFIED
        self._memcpy_2d = c_function("cuMemcpy2DAsync", 12000, _P, _P)

    def __call__(self, plan: Plan) -> None:
        count = plan.count
        if count == 0:
            return
        if self._batch is None:
            for dst, src, size in zip(plan.dsts.tolist(), plan.srcs.tolist(), plan.sizes.tolist()):
                check_code(self._memcpy(dst, src, size, self.handle), "cuMemcpyAsync")
            return
        # The descriptor arrays are plain int64 arrays; the driver reads them during the call.
        dsts, srcs, sizes = plan.dsts.ctypes.data, plan.srcs.ctypes.data, plan.sizes.ctypes.data
        for lo in range(0, count, MAX_COPIES_PER_CALL):
            n = min(MAX_COPIES_PER_CALL, count - lo)
            code = self._batch(dsts + 8 * lo, srcs + 8 * lo, sizes + 8 * lo, n, *self._tail)
            check_code(code, f"cuMemcpyBatchAsync({n} copies)")

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """One ``cuMemcpyAsync`` of ``nbytes`` between two addresses (unified addressing: GPU or
        page-locked host memory on either side), e.g. a transfer's ids into the GPU."""
        check_code(self._memcpy(dst, src, nbytes, self.handle), "cuMemcpyAsync")

    def bind_2d(self, copy: Copy2D) -> Callable[[int], None]:
        """``copy`` with every field but its width bound once, in a descriptor of its own: the
        returned call stores the width and enqueues the copy, one driver call (a hot path's copy
        of a prefix that grows, as an eager step's slot loads make per layer)."""
        m = _Memcpy2D()
        m.srcMemoryType = m.dstMemoryType = _CU_MEMORYTYPE_UNIFIED
        m.srcDevice, m.srcPitch, m.dstDevice, m.dstPitch = copy.src, copy.src_pitch, copy.dst, copy.dst_pitch
        m.Height = copy.height
        call, descriptor, handle = self._memcpy_2d, ctypes.byref(m), self.handle  # byref keeps m alive

        def enqueue(width: int) -> None:
            m.WidthInBytes = width
            check_code(call(descriptor, handle), "cuMemcpy2DAsync")

        return enqueue

    def copy_2d(self, copy: Copy2D) -> None:
        """One ``cuMemcpy2DAsync`` of ``copy``, through the launcher's one descriptor."""
        m = self._2d
        m.srcDevice, m.srcPitch, m.dstDevice, m.dstPitch = copy.src, copy.src_pitch, copy.dst, copy.dst_pitch
        m.WidthInBytes, m.Height = copy.width, copy.height
        check_code(self._memcpy_2d(ctypes.byref(m), self.handle), "cuMemcpy2DAsync")


def launch(plan: Plan, stream: torch.cuda.Stream) -> None:
    """Enqueue ``plan`` on ``stream`` (a created stream: the batched call refuses the legacy one).

    Not capturable: the driver rejects batched copies during stream capture, so this raises
    instead, before anything is enqueued. Capture the kernel path (:func:`kv_ops.copy_blocks`).
    """
    if plan.count == 0:
        return
    if stream.cuda_stream == 0:
        raise ValueError("kv_ops.dma: the legacy default stream cannot take batched copies; pass a created stream")
    refuse_capture(OP, "the DMA path cannot be captured into a CUDA graph", "use kv_ops.copy_blocks", stream=stream)
    with driver_context(stream.device):
        Launcher(stream)(plan)


def run_on_host(plan: Plan) -> None:
    """Execute ``plan`` copy by copy with ``memmove``: what the copy engines do, for host memory.

    Every address and size the driver would be handed is used as is, so a wrong plan corrupts
    or crashes here as it would on the GPU.
    """
    for dst, src, size in zip(plan.dsts.tolist(), plan.srcs.tolist(), plan.sizes.tolist()):
        ctypes.memmove(dst, src, size)


def enqueue_copies(
    src: list[torch.Tensor],
    dst: list[torch.Tensor],
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    stream: torch.cuda.Stream,
    runs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> int:
    """Plan and enqueue a block copy on ``stream``; returns the number of copies issued.

    Named apart from the op ``kv_ops.copy_blocks`` (the kernel, compile-safe) and from
    ``reference.copy_blocks`` (its pure-torch oracle, which returns the skipped pairs).
    """
    plan = plan_copies(src, dst, src_ids, dst_ids, runs)
    launch(plan, stream)
    return plan.count


__all__ = [
    "Plan",
    "Copy2D",
    "run_2d_on_host",
    "Planner",
    "Launcher",
    "plan_copies",
    "count_runs",
    "host_array",
    "run_starts",
    "back_to_back",
    "count_copies",
    "launch",
    "run_on_host",
    "enqueue_copies",
    "batched_copy_abi",
    "has_batched_copy",
]
