"""The kernels that a captured PLE step replays in place of stream memory operations.

Eagerly, a wait is ``cuStreamWaitValue32``, a reset ``cuStreamWriteValue32`` and the rows' copy
``cuMemcpyHtoDAsync``: a few microseconds of host time each. Captured, they become memory-operation
and memcpy nodes, and those make every ``cuGraphLaunch`` slow, where kernel nodes cost the launch
almost nothing (docs/design.md). So a capture records, per layer, the kernels below instead. They
do what the stream operations do, in the same order:

* wait:    ``waiting = WAITING``; spin until ``flag == DONE``; then the copy (a second kernel;
           a memcpy node from :data:`COPY_ENGINE_FROM` bytes, where the copy engine is faster).
* release: ``waiting = WAITING``; spin until ``flag == DONE``; ``waiting = IDLE``; ``flag = RESET``.

Memory model. The words live in page-locked host memory mapped for the GPU, or in device memory
for a hand-armed layer. Loads of the flag are ``ld.volatile`` (relaxed, system scope: each one
reads memory, never a stale cache line). Each store is followed by ``fence.sc.sys``. That way the
watchdog sees ``WAITING`` while the program still spins, and a producer that sees ``RESET``
finds ``IDLE`` already there. The stream operations keep that order: a ``cuStreamWriteValue32``
without ``NO_MEMORY_BARRIER`` is fenced. The wait ends with a fence too: the copy after it in
stream order sees the rows the producer stored before it raised the flag (release fence).

No timeout here: the runtime's watchdog frees a stream that waits on a dead or missing producer
by raising the flag, exactly as it frees a ``cuStreamWaitValue32``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kv_ops.cuda.launch import NUM_PROGRAMS, NUM_WARPS, TILE_BYTES, interpreting

from .semaphore import DONE, IDLE, RESET, WAITING

# Captured copies of at least this many bytes go to the copy engine (a memcpy node after the wait
# kernel) instead of the copy kernel: from there the kernel's lower read rate outweighs the memcpy
# node's fixed cost (benchmarks/ple_latency.py times both routes; docs/design.md).
COPY_ENGINE_FROM = 4 << 20

if interpreting():

    @triton.jit
    def _fence_system():
        # The interpreter runs each program on the host, in program order: nothing to fence (and
        # it cannot run PTX), so CI tests the kernels' logic on CPU tensors.
        return 0

else:

    @triton.jit
    def _fence_system():
        # fence.sc.sys: every store before it is visible to the host (and other devices) before
        # any memory operation after it. Triton has no name for a system-scope fence.
        return tl.inline_asm_elementwise(
            "fence.sc.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def _spin_until_raised(flag_ptr, done: tl.constexpr):
    flag = tl.load(flag_ptr, volatile=True)
    while flag != done:
        flag = tl.load(flag_ptr, volatile=True)


@triton.jit
def _store_fenced(ptr, value):
    tl.store(ptr, value)
    _fence_system()


@triton.jit
def _wait_kernel(
    flag_ptr,  # int32 [1]: the layer's flag; the producer raises it to DONE over the layer's rows
    waiting_ptr,  # int32 [1]: the layer's waiting word, read by the watchdog (unused without MARK)
    MARK: tl.constexpr,  # the layer has a waiting word (armed by a runtime)
    WAITING_VALUE: tl.constexpr,
    DONE_VALUE: tl.constexpr,
):
    if MARK:
        _store_fenced(waiting_ptr, WAITING_VALUE)
    _spin_until_raised(flag_ptr, DONE_VALUE)
    # Acquire: work after this kernel in stream order (the copy) sees the rows the producer
    # stored before it raised the flag, never a line cached from an earlier step.
    _fence_system()


@triton.jit
def _copy_kernel(
    src_ptr,  # uint8 [>= nbytes]: the layer's slot, page-locked host memory seen through its device address
    dst_ptr,  # uint8 [>= nbytes]: the layer's output buffer on the GPU
    nbytes,  # specialised: a multiple of 16 lets the masked loads and stores move 16 bytes at a time
    TILE: tl.constexpr,  # bytes one program moves per iteration
):
    # Tile t starts at t * TILE, a multiple of 16 that Triton can see (a loop counter stepping by
    # TILE would hide it): byte by byte, each load would be a PCIe read of its own.
    for tile in range(tl.program_id(0), tl.cdiv(nbytes, TILE), tl.num_programs(0)):
        offsets = tile * TILE + tl.arange(0, TILE)
        live = offsets < nbytes
        tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=live), mask=live)


@triton.jit
def _release_kernel(
    flag_ptr,  # int32 [1]: the layer's flag, reset here once the step's raise was seen
    waiting_ptr,  # int32 [1]: the layer's waiting word (unused without MARK)
    MARK: tl.constexpr,  # the layer has a waiting word: wait for the raise before the reset
    WAITING_VALUE: tl.constexpr,
    IDLE_VALUE: tl.constexpr,
    DONE_VALUE: tl.constexpr,
    RESET_VALUE: tl.constexpr,
):
    if MARK:
        # Never reset a flag before the raise it answers (ple_ops.ops.release says why).
        _store_fenced(waiting_ptr, WAITING_VALUE)
        _spin_until_raised(flag_ptr, DONE_VALUE)
        _store_fenced(waiting_ptr, IDLE_VALUE)
    _store_fenced(flag_ptr, RESET_VALUE)


def wait_copy(flag: torch.Tensor, waiting: torch.Tensor | None, src: torch.Tensor, dst: torch.Tensor, nbytes: int):
    """Launch, on the current stream, one program that marks ``waiting`` and spins until
    ``flag == DONE``, then (``nbytes > 0``) the copy of the first ``nbytes`` of ``src`` (the host
    slot's device view) into ``dst``.

    ``flag`` and ``waiting`` are one-element int32 CUDA tensors (device views of host words);
    ``src`` and ``dst`` are uint8 CUDA tensors. Returns Triton's handle of the copy kernel (its
    ``asm`` holds the PTX), or None when nothing was copied.

    Two kernels, not one: in a single kernel every warp would spin on the flag over host memory,
    which is slower than one warp's wait followed by the copy (docs/design.md).
    """
    _wait_kernel[(1,)](flag, flag if waiting is None else waiting, waiting is not None, WAITING, DONE, num_warps=1)
    if not nbytes:
        return None
    # The shape kv_ops' zero-copy kernel was tuned to for host-to-GPU reads (kv_ops.cuda.launch).
    programs = min(NUM_PROGRAMS, triton.cdiv(nbytes, TILE_BYTES))
    return _copy_kernel[(programs,)](src, dst, nbytes, TILE_BYTES, num_warps=NUM_WARPS)


def release(flag: torch.Tensor, waiting: torch.Tensor | None) -> None:
    """Launch, on the current stream, one program that resets ``flag`` (after its raise, with ``waiting``)."""
    _release_kernel[(1,)](
        flag, flag if waiting is None else waiting, waiting is not None, WAITING, IDLE, DONE, RESET, num_warps=1
    )


__all__ = ["wait_copy", "release", "COPY_ENGINE_FROM"]
