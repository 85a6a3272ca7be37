"""Every reach of both packages into torch's private names, each with why and what would break it.

The one torch shim: nothing else in kv_ops or ple_ops reads a private torch name (``torch._check``
and ``torch._check_value`` excepted: they are torch's documented way for a fake to state a
condition). A torch release that renames or removes one of these breaks only this module; its
tests (and the callers' tests) say which.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn


def current_raw_stream(index: int) -> int:
    """The raw handle of this thread's current stream on device ``index`` (no Stream object)."""
    # Why: torch.cuda.current_stream() builds a Stream object per call, which costs host time on
    # every launch; the raw handle is what Inductor's generated code reads. Breaks if torch renames
    # or drops torch._C._cuda_getCurrentRawStream (Inductor would break with it).
    return torch._C._cuda_getCurrentRawStream(index)


def current_raw_stream_reader() -> Callable[[], int]:
    """A call that returns the raw handle of the current device's current stream, as it is at
    that call: torch's private readers where this torch has them, else
    ``torch.cuda.current_stream().cuda_stream``."""
    # Why: as current_raw_stream, and without asking which device is current through a Python
    # Stream. Looked up by name so that a torch without them falls back to the public call
    # (slower, same handle) rather than failing.
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    device = getattr(torch._C, "_cuda_getDevice", None)
    if raw is not None and device is not None:
        return lambda: raw(device())
    return lambda: torch.cuda.current_stream().cuda_stream


def cudagraph_trees_recording() -> bool:
    """Whether this thread is inside a recording of Inductor's CUDA-graph trees
    (``mode="reduce-overhead"``), recognised by the trees' recording frame on this thread's stack.

    Never imports Inductor: a first import during a capture makes CUDA calls that invalidate it,
    and trees that were never imported are not recording.
    """
    # Why: torch has no public way to tell the trees' capture (replayed before the call returns)
    # from a plain torch.cuda.graph capture; the capture stream cannot tell them apart either.
    # Breaks if torch renames CUDAGraphNode._record or moves the recording out of it (then this
    # returns False, and a prepared step captured by the trees is refused as stale). sys._getframe
    # is CPython's, present on every interpreter torch supports.
    cudagraph_trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if cudagraph_trees is None:
        return False
    record = cudagraph_trees.CUDAGraphNode._record.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is record:
            return True
        frame = frame.f_back
    return False


def enable_aot_compile() -> None:
    """Switch on Dynamo's ahead-of-time compile where this torch has the switch."""
    # Why: torch <= 2.11 refuses .aot_compile() unless torch._dynamo.config.enable_aot_compile is
    # on, and there is no public switch. A release that drops the flag is harmless (the hasattr
    # skips it); one that keeps the name but gives it another meaning breaks this.
    if hasattr(torch._dynamo.config, "enable_aot_compile"):
        torch._dynamo.config.enable_aot_compile = True


def has_forward_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has a forward hook or forward pre-hook of its own (not global ones)."""
    # Why: nn.Module has no public call that lists its hooks; a hook changes what forward returns,
    # so a module with one is not a plain row lookup. Breaks if torch renames _forward_hooks or
    # _forward_pre_hooks (then this raises AttributeError, refusing every module loudly).
    return bool(module._forward_hooks or module._forward_pre_hooks)


def mark_static_address(tensor: torch.Tensor) -> None:
    """Tell Dynamo that ``tensor`` keeps its address for the life of the compiled code, so that a
    CUDA graph reads it in place instead of copying it in at each replay."""
    # Why: torch has no public spelling of it (torch.compiler does not export it), and without it
    # the compiled step copies the tensor into the graph's own buffer at every replay. Breaks if
    # torch moves or renames torch._dynamo.mark_static_address.
    torch._dynamo.mark_static_address(tensor)


class CastGuard(nn.Module):
    """A module whose :meth:`before_apply` sees every ``fn`` that ``.to()``, ``.half()``,
    ``.float()``, ``.cuda()`` and the like apply to a model holding it, before anything is applied
    to it."""

    # Why: torch has no public hook for a model's cast or move; every such call goes through
    # Module._apply, child by child. Breaks if torch renames _apply or routes those calls
    # elsewhere (then before_apply is never called: the guard is silently off).
    def _apply(self, fn, recurse=True):
        self.before_apply(fn)
        return super()._apply(fn, recurse)

    def before_apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Raise to refuse ``fn``; the default lets every one through."""


__all__ = [
    "CastGuard",
    "current_raw_stream",
    "current_raw_stream_reader",
    "cudagraph_trees_recording",
    "enable_aot_compile",
    "has_forward_hooks",
    "mark_static_address",
]
