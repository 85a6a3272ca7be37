"""Copy plans for the copy engines (pure, vectorised) and their launch: one batched driver call.

A copy is planned on the host, vectorised: runs of ids that are consecutive on both sides merge
into one copy where both regions keep their blocks back to back, and every copy becomes a
(destination, source, size) triple in three int64 tensors. Those tensors are the descriptor
arrays themselves: ``cuMemcpyBatchAsync`` is called through ctypes with their data pointers, so
no Python object is built per block. Where the driver lacks the batched call (before CUDA 12.8),
the same plan runs as one ``cuMemcpyAsync`` per copy.

Copy engines need no SMs and share the link better than kernels (both directions at once), but
pay about 1-2 us per copy and cannot be captured into a CUDA graph. On the CPU,
:func:`run_on_host` executes the same plan with ``memmove``, so the engine's copy-engine paths
run, plan for plan, in CI.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from .driver import check_driver, driver, driver_context, stream_is_capturing
from .validation import check_ids_values, check_widths

# Ask the driver for copy engines that overlap with compute (CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE).
# A module setting, read at every launch, so a benchmark can compare both.
PREFER_OVERLAP_WITH_COMPUTE = True

# One batched call takes at most this many copies; a larger plan is split (the driver documents
# no limit, this keeps each descriptor array modest).
MAX_COPIES_PER_CALL = 1 << 16


OP = "kv_ops.dma"  # how errors name this module

# --- planning ------------------------------------------------------------------------------------


@dataclass
class Plan:
    """Copies for one transfer: ``dsts[i] <- srcs[i]``, ``sizes[i]`` bytes (int64 host tensors)."""

    dsts: torch.Tensor
    srcs: torch.Tensor
    sizes: torch.Tensor

    @property
    def count(self) -> int:
        return self.sizes.numel()


def run_starts(src_ids: torch.Tensor, dst_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Start index and length of each run of pairs whose ids both go up by one."""
    n = src_ids.numel()
    step = (src_ids[1:] - src_ids[:-1] == 1) & (dst_ids[1:] - dst_ids[:-1] == 1)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), (~step).nonzero().flatten() + 1])
    lengths = torch.diff(starts, append=torch.tensor([n]))
    return starts, lengths


def back_to_back(region: torch.Tensor) -> bool:
    """Whether a region's blocks follow each other in memory (a run of them is one span)."""
    return region.stride(0) == region.shape[1] or region.shape[0] == 1


def _merges(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether a run of consecutive ids is one copy for this region pair."""
    return back_to_back(src) and back_to_back(dst)


def count_copies(
    src: list[torch.Tensor], dst: list[torch.Tensor], num_pairs: int, runs: tuple[torch.Tensor, torch.Tensor]
) -> int:
    """How many copies :func:`plan_copies` issues for ``num_pairs`` pairs forming ``runs``."""
    return sum(runs[0].numel() if _merges(s, d) else num_pairs for s, d in zip(src, dst))


def _addresses(regions: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Base address and block stride of each region, as int64 columns ``[R, 1]``."""
    meta = torch.tensor([[r.data_ptr(), r.stride(0)] for r in regions], dtype=torch.int64)
    return meta[:, :1], meta[:, 1:]


def plan_copies(
    src: list[torch.Tensor],
    dst: list[torch.Tensor],
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    runs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Plan:
    """Plan ``dst[r][dst_ids[i]] = src[r][src_ids[i]]`` for every region pair r.

    ``src[r]`` and ``dst[r]`` are uint8 ``[num_blocks, block_bytes]`` regions with contiguous
    rows (any row stride), ids are 1-D integer host tensors of equal length. Ids are checked
    against every region, so no copy can reach outside one. The work is a handful of tensor
    operations over all regions at once, whatever their number. ``runs`` is
    ``run_starts(src_ids, dst_ids)`` when the caller already has it.
    """
    src_ids = src_ids.to("cpu", torch.int64)
    dst_ids = dst_ids.to("cpu", torch.int64)
    if src_ids.shape != dst_ids.shape or src_ids.dim() != 1:
        raise ValueError(
            f"{OP}: ids must be 1-D and of equal length, got {tuple(src_ids.shape)} and {tuple(dst_ids.shape)}"
        )
    check_widths(OP, src, dst)
    empty = torch.empty(0, dtype=torch.int64)
    if src_ids.numel() == 0 or not src:
        return Plan(empty, empty, empty)
    # The last guard before raw addresses: an id outside the smallest region would be a wild copy.
    check_ids_values(OP, "src_ids", src_ids, min(s.shape[0] for s in src))
    check_ids_values(OP, "dst_ids", dst_ids, min(d.shape[0] for d in dst))
    merged = [_merges(s, d) for s, d in zip(src, dst)]
    if any(merged):
        starts, lengths = runs if runs is not None else run_starts(src_ids, dst_ids)
    dsts, srcs, sizes = [], [], []
    for merge in (True, False):
        pick = [r for r, m in enumerate(merged) if m == merge]
        if not pick:
            continue
        s_base, s_stride = _addresses([src[r] for r in pick])
        d_base, d_stride = _addresses([dst[r] for r in pick])
        width = torch.tensor([[src[r].shape[1]] for r in pick], dtype=torch.int64)
        if merge:
            # A run of consecutive blocks is one contiguous span on both sides: one copy.
            s_first, d_first, count = src_ids[starts], dst_ids[starts], lengths
        else:
            s_first, d_first, count = src_ids, dst_ids, torch.ones_like(src_ids)
        # [regions, copies]: every region's copies in one broadcast.
        srcs.append((s_base + s_first * s_stride).flatten())
        dsts.append((d_base + d_first * d_stride).flatten())
        sizes.append((width * count).flatten())
    return Plan(torch.cat(dsts), torch.cat(srcs), torch.cat(sizes))


# --- the driver calls ----------------------------------------------------------------------------

_P, _N = ctypes.c_void_p, ctypes.c_size_t


@functools.cache
def _entry_points() -> tuple[object | None, object, int]:
    """(batched call or None, per-copy cuMemcpyAsync, CUDA version of the batched signature)."""
    drv = driver()

    (version,) = check_driver(drv.cuDriverGetVersion(), "cuDriverGetVersion")
    flags = drv.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT

    def proc(name: str, cuda_version: int):
        pfn, _status = check_driver(
            drv.cuGetProcAddress(name.encode(), cuda_version, flags), f"cuGetProcAddress({name})"
        )
        return int(pfn)

    # cuMemcpyAsync(dst, src, bytes, stream)
    memcpy = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, _N, _P)(proc("cuMemcpyAsync", 12000))
    batch, batch_version = None, 0
    if version >= 13000:
        # CUDA 13: (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream)
        pfn = proc("cuMemcpyBatchAsync", 13000)
        if pfn:
            batch, batch_version = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _P, _N, _P, _P, _N, _P)(pfn), 13000
    elif version >= 12080:
        # CUDA 12.8: the same with size_t* failIdx before the stream.
        pfn = proc("cuMemcpyBatchAsync", 12080)
        if pfn:
            batch, batch_version = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _P, _N, _P, _P, _N, _P, _P)(pfn), 12080
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


def batched_copy_abi() -> int:
    """The CUDA version whose ``cuMemcpyBatchAsync`` signature the driver gave us (13000 or
    12080), or 0 where it has none (then :func:`launch` loops one ``cuMemcpyAsync`` per copy)."""
    return _entry_points()[2]


def has_batched_copy() -> bool:
    """Whether the driver offers ``cuMemcpyBatchAsync`` (else :func:`launch` loops per copy)."""
    return batched_copy_abi() != 0


def _check(code: int, what: str) -> None:
    if code:
        drv = driver()

        check_driver((drv.CUresult(code),), what)


def launch(plan: Plan, stream: torch.cuda.Stream) -> None:
    """Enqueue ``plan`` on ``stream`` (a created stream: the batched call refuses the legacy one).

    Not capturable: the driver rejects batched copies during stream capture, so this raises
    instead, before anything is enqueued. Capture the kernel path (:func:`kv_ops.copy_blocks`).
    """
    if plan.count == 0:
        return
    if stream.cuda_stream == 0:
        raise ValueError("kv_ops.dma: the legacy default stream cannot take batched copies; pass a created stream")
    if stream_is_capturing(stream):
        raise RuntimeError("kv_ops.dma: the DMA path cannot be captured into a CUDA graph; use kv_ops.copy_blocks")
    batch, memcpy, batch_version = _entry_points()
    handle = ctypes.c_void_p(stream.cuda_stream)
    with driver_context(stream.device):
        if batch is None:
            for dst, src, size in zip(plan.dsts.tolist(), plan.srcs.tolist(), plan.sizes.tolist()):
                _check(memcpy(dst, src, size, handle), "cuMemcpyAsync")
            return
        attrs, first = _stream_order_attributes(PREFER_OVERLAP_WITH_COMPUTE)
        fail_index = ctypes.c_size_t(0)
        for lo in range(0, plan.count, MAX_COPIES_PER_CALL):
            hi = min(lo + MAX_COPIES_PER_CALL, plan.count)
            # The descriptor arrays are plain int64 tensors; the driver reads them during the call.
            args = [
                _P(plan.dsts.data_ptr() + 8 * lo),
                _P(plan.srcs.data_ptr() + 8 * lo),
                _P(plan.sizes.data_ptr() + 8 * lo),
                hi - lo,
                _P(attrs.getPtr()),
                ctypes.cast(first, _P),
                1,
            ]
            if batch_version == 12080:
                args.append(ctypes.cast(ctypes.pointer(fail_index), _P))
            _check(batch(*args, handle), f"cuMemcpyBatchAsync({hi - lo} copies)")


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
    "plan_copies",
    "run_starts",
    "back_to_back",
    "count_copies",
    "launch",
    "run_on_host",
    "enqueue_copies",
    "batched_copy_abi",
    "has_batched_copy",
]
