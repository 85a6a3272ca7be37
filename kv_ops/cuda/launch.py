"""How both packages' Triton kernels launch: their shape (programs, tile bytes, warps), the alignment rule, and the direct launch of a kernel compiled before."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
import triton

# At most this many programs (one CTA each) run: a copy shares the GPU with the forward pass,
# and eight SMs already saturate a PCIe Gen5 x16 link (figures: docs/measurements.md).
NUM_PROGRAMS = 8
# Bytes one program moves per loop iteration, and the warps that move them. Host->GPU is the
# hard direction: every load crosses PCIe before its store can issue, so each program needs many
# bytes in flight: 32 KiB over 16 warps (16 B per thread per access, 4 accesses), tuned by
# benchmarks/block_copy.py --tune (the best of its grid host->GPU with 8 programs; figures:
# docs/measurements.md).
TILE_BYTES = 32768
NUM_WARPS = 16


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``): on the CPU, with
    host addresses."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def alignment(values: Sequence[int]) -> int:
    """Largest power of two, at most 16, that divides every value (0 divides nothing: 16).

    The byte alignment a kernel may assume of addresses built from these offsets and strides.
    Public so that tests check the rule itself, not only the copies that depend on it.
    """
    g = 0
    for v in values:
        g = math.gcd(g, v)
    return 16 if g == 0 else min(16, g & -g)


# The Triton shim: the functions below are the one place either package reaches into Triton past
# @jit, into the compiled-kernel object (run, function, packed_metadata) and the launch hooks in
# triton.knobs.runtime. Why: @jit's launch path binds and specialises every argument on every call,
# which costs more host time than the copy's launch; a kernel compiled before is launched as @jit
# itself launches it, and only where @jit would do nothing more (same device, no profiler hook).
# What breaks it: a Triton release that changes CompiledKernel.run's argument list (this is
# Triton 3.6 to 3.9's), renames function or packed_metadata (then direct_launcher answers False
# and every launch goes through @jit: slower, still right), or moves the hooks out of knobs.runtime
# (then a direct launch raises AttributeError).


def _launch_hooks() -> bool:
    """Whether a launch hook is installed (a profiler's): then every launch goes through @jit,
    which feeds it."""
    runtime = triton.knobs.runtime
    return any(
        hook is not None and getattr(hook, "calls", True)
        for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook)
    )


def direct_launcher(handle) -> bool:
    """Whether what ``@jit`` returned can be launched by :func:`launch_compiled` (a compiled
    kernel; the interpreter returns none)."""
    return all(hasattr(handle, name) for name in ("run", "function", "packed_metadata"))


def launch_compiled(compiled, device: torch.device, programs: int, stream: int, args: tuple) -> bool:
    """Launch a kernel ``@jit`` compiled before with the same specialisation, on ``programs``
    programs and the raw ``stream`` handle, skipping ``@jit``'s binder (which costs more host time
    than the launch). Returns False, launching nothing, where the caller must go through ``@jit``:
    another device is current (the compiled function belongs to ``device``'s context) or a launch
    hook is installed (a profiler's, which only ``@jit`` feeds)."""
    if torch.cuda.current_device() != device.index or _launch_hooks():
        return False
    # Exactly what @jit's run() does once it has the kernel (Triton 3.6 to 3.9).
    compiled.run(programs, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *args)
    return True


__all__ = ["NUM_PROGRAMS", "TILE_BYTES", "NUM_WARPS", "interpreting", "alignment", "direct_launcher", "launch_compiled"]
