"""The layer-wise wait kernel: one program that holds a captured step's stream until a layer's landed flag reaches the generation the step waits for."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _globaltimer():
    # The GPU's nanosecond clock (PTX %globaltimer): Triton has no portable name for it.
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["layer", "timeout_ns"])
def _wait_landed_kernel(
    flags_ptr,  # int32 [1 + layers] on the device: [0] the generation the step waits for, written
    #             by each start on the caller's stream (so a replay reads the value of the last
    #             start enqueued before it); [1 + i] the generation whose layer-i blocks have
    #             landed, written after those copies (with the driver's memory fence before it)
    layer,
    timeout_ns,  # give up after this long (a backstop: every start publishes every layer)
    error_ptr,  # int64 [1]: incremented once when the wait gave up
):
    wanted = tl.load(flags_ptr, volatile=True)
    landed = tl.load(flags_ptr + 1 + layer, volatile=True)
    begin = _globaltimer()
    now = begin
    # Generations count up and wrap: the difference, as int32, orders them.
    while ((landed - wanted) < 0) & ((now - begin) < timeout_ns):
        landed = tl.load(flags_ptr + 1 + layer, volatile=True)
        now = _globaltimer()
    if (landed - wanted) < 0:
        tl.atomic_add(error_ptr, 1)


def wait_landed(flags: torch.Tensor, layer: int, timeout_ns: int, errors: torch.Tensor) -> None:
    """Launch, on the current stream, one program that returns once ``flags[1 + layer]`` has
    reached ``flags[0]``, read when it runs: what a captured step's layer-wise wait is (the
    value it waits for changes with every start, so it cannot be a constant of the graph).
    After ``timeout_ns`` it returns anyway and counts one error (:func:`kv_ops.error_count`)."""
    _wait_landed_kernel[(1,)](flags, layer, timeout_ns, errors, num_warps=1)


__all__ = ["wait_landed"]
