"""The per-process registry: layer name -> this process's live resources for that layer.

Ops carry the name only. Every call looks the layer up here, so the flag address, the host slot
address and the row size are always those of the process that runs the op: a graph compiled in
one process and loaded in another (AOT) waits on the loader's flags, not the compiler's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .semaphore import CpuGpuSemaphore


@dataclass
class ArmedLayer:
    """What the ops need to serve one layer in this process.

    Attributes
    ----------
    name : str
        The layer's name (its qualified name in the model).
    flag : CpuGpuSemaphore
        Raised by the producer when the layer's rows are in ``slot``.
    slot : Tensor
        uint8 ``[max_tokens, row_bytes]`` in shared page-locked host memory.
    check : callable
        Raises if the producer has failed; host-side waits call it while they spin.
    out : Tensor or None
        The consumer's output buffer ``[max_tokens, dim]`` (on the GPU in the GPU process).
    """

    name: str
    flag: CpuGpuSemaphore
    slot: torch.Tensor
    check: Callable[[], None] = field(default=lambda: None)
    out: torch.Tensor | None = None

    @property
    def max_tokens(self) -> int:
        return self.slot.shape[0]

    @property
    def row_bytes(self) -> int:
        return self.slot.shape[1]


_armed: dict[str, ArmedLayer] = {}


def arm(layer: ArmedLayer) -> None:
    """Register ``layer`` under its name; a name is armed once until disarmed."""
    if layer.name in _armed:
        raise ValueError(f"ple_ops: layer {layer.name!r} is already armed in this process")
    if layer.slot.dtype != torch.uint8 or layer.slot.dim() != 2:
        raise ValueError(f"ple_ops: slot of {layer.name!r} must be uint8 [max_tokens, row_bytes]")
    _armed[layer.name] = layer


def disarm(name: str) -> None:
    _armed.pop(name, None)


def lookup(name: str) -> ArmedLayer:
    """The armed layer called ``name``; an unknown name raises and lists the armed ones."""
    layer = _armed.get(name)
    if layer is None:
        raise RuntimeError(f"ple_ops: no layer named {name!r} is armed in this process (armed: {sorted(_armed)})")
    return layer


def armed_names() -> list[str]:
    return sorted(_armed)


__all__ = ["ArmedLayer", "arm", "disarm", "lookup", "armed_names"]
