"""The per-process registry: layer name -> this process's live resources for that layer.

Ops carry the name only. Every call looks the layer up here, so the flag address, the host slot
address and the row size are always those of the process that runs the op: a graph compiled in
one process and loaded in another (AOT) waits on the loader's flags, not the compiler's.

A layer armed by an :class:`~ple_ops.OffloadRuntime` also carries a :class:`StepGuard`: the ops
ask it, before they wait or release, whether that can end in this step's rows (a step is
prepared, the token count matches, no capture is recording a prepared step) and, on the CPU
path, let it do the waiting. Layers armed by hand (tests, benchmarks) have none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from kv_ops.cuda.arguments import seconds, shown, text
from kv_ops.cuda.registration import find_named

from .semaphore import CpuGpuSemaphore

# The OffloadRuntime's default step_timeout, and the bound of a host wait on a layer armed by
# hand: no runtime's watchdog frees that wait, so it gives up by itself (ArmedLayer.timeout).
STEP_TIMEOUT_S = 30.0


@runtime_checkable
class StepGuard(Protocol):
    """What the ops ask the owner of an armed layer (the runtime's step transaction).

    Every method raises (an ``OffloadError``) when the operation cannot end in this step's rows.
    """

    def host_wait(self, name: str, num_tokens: int | None) -> None:
        """CPU path: block until this step's rows for ``name`` are in its slot (bounded)."""

    def host_release(self, name: str) -> None:
        """CPU path: reset ``name``'s flag once this step's rows were published (bounded)."""

    def before_stream_wait(self, name: str, num_tokens: int | None, captured: bool) -> None:
        """GPU path: check before a wait on ``name`` is enqueued, or recorded (``captured``: the
        op asked :func:`kv_ops.cuda.capture.capturing` once and passes its answer on)."""

    def before_stream_release(self, name: str, captured: bool) -> bool:
        """GPU path: check before a release is enqueued (or recorded, ``captured``); False when
        this step already released it."""


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
        uint8 ``[max_tokens, row_bytes]`` in shared page-locked host memory. Fixed once the layer
        is made: ``max_tokens``, ``row_bytes`` and ``slot_address`` are read from it then.
    check : callable
        Raises if the producer has failed; host-side waits call it while they spin.
    out : Tensor or None
        The consumer's output buffer ``[max_tokens, dim]`` (on the GPU in the GPU process).
    waiting : CpuGpuSemaphore or None
        The layer's stream-is-waiting word (see :mod:`ple_ops.runtime.control`). When present, a GPU wait
        writes ``WAITING`` to it first, and a GPU release waits for the flag, writes ``IDLE``,
        then resets the flag.
    guard : StepGuard or None
        The runtime's step checks; ``None`` for a layer armed by hand.
    timeout : float
        Seconds a host wait on a layer armed by hand waits for the flag before it raises
        ``ProducerFailed`` (default :data:`STEP_TIMEOUT_S`); a guarded layer's waits are bounded
        by its guard (the runtime's ``step_timeout``).
    """

    name: str
    flag: CpuGpuSemaphore
    slot: torch.Tensor
    check: Callable[[], None] = field(default=lambda: None)
    out: torch.Tensor | None = None
    waiting: CpuGpuSemaphore | None = None
    guard: StepGuard | None = None
    timeout: float = STEP_TIMEOUT_S
    # Bound once from the slot, which stays the same tensor while the layer is armed: every op
    # call reads them.
    max_tokens: int = field(init=False, repr=False, compare=False)
    row_bytes: int = field(init=False, repr=False, compare=False)
    slot_address: int = field(init=False, repr=False, compare=False)
    # (address, driver handle) of the last output buffer a GPU copy wrote (ple_ops.ops).
    bound_out: tuple | None = field(default=None, init=False, repr=False, compare=False)
    # The slot as a CUDA tensor over its page-locked bytes, for captured copies (ple_ops.ops).
    device_slot: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.slot, torch.Tensor):
            return  # arm() refuses it, naming the field: nothing to bind
        if self.slot.dim() == 2:  # arm() refuses any other slot, with its own message
            self.max_tokens, self.row_bytes = self.slot.shape
        self.slot_address = self.slot.data_ptr()


_armed: dict[str, ArmedLayer] = {}
# Names disarmed with a reason (their runtime closed): a lookup raises that reason, not "unknown".
_gone: dict[str, Callable[[], BaseException]] = {}


def _check_layer(layer: ArmedLayer) -> None:
    """Each field of ``layer`` is what :class:`ArmedLayer` says it is, else a ``ValueError`` from
    ``ple_ops.arm`` naming the field, the layer and the value (its name was checked first)."""
    of = f"of {layer.name!r} must be"
    if not isinstance(layer.flag, CpuGpuSemaphore):
        raise ValueError(f"ple_ops.arm: layer.flag {of} a CpuGpuSemaphore, got {shown(layer.flag)}")
    slot = layer.slot
    if not isinstance(slot, torch.Tensor) or slot.device.type != "cpu" or slot.dtype != torch.uint8 or slot.dim() != 2:
        raise ValueError(
            f"ple_ops.arm: layer.slot {of} a uint8 [max_tokens, row_bytes] tensor in host memory, got {shown(slot)}"
        )
    if not slot.is_contiguous():
        raise ValueError(
            f"ple_ops.arm: layer.slot {of} contiguous, got shape {tuple(slot.shape)} with strides {slot.stride()}"
        )
    bound = tuple(getattr(layer, field, None) for field in ("slot_address", "max_tokens", "row_bytes"))
    if bound != (slot.data_ptr(), *slot.shape):  # the ops read these, not the slot
        raise ValueError(
            f"ple_ops.arm: layer.slot of {layer.name!r} was replaced after the layer was made, which binds its "
            f"address and shape: make a new ArmedLayer with the slot {shown(slot)}"
        )
    if not callable(layer.check):
        raise ValueError(
            f"ple_ops.arm: layer.check {of} a callable that raises if the producer failed, got {layer.check!r}"
        )
    if layer.out is not None and not isinstance(layer.out, torch.Tensor):
        raise ValueError(f"ple_ops.arm: layer.out {of} a tensor or None, got {layer.out!r}")
    if layer.waiting is not None and not isinstance(layer.waiting, CpuGpuSemaphore):
        raise ValueError(f"ple_ops.arm: layer.waiting {of} a CpuGpuSemaphore or None, got {shown(layer.waiting)}")
    if layer.guard is not None and not isinstance(layer.guard, StepGuard):
        raise ValueError(f"ple_ops.arm: layer.guard {of} a StepGuard or None, got {shown(layer.guard)}")
    seconds("ple_ops.arm", f"layer.timeout of {layer.name!r}", layer.timeout)


def arm(layer: ArmedLayer) -> None:
    """Register ``layer`` under its name; a name is armed once until disarmed.

    Every field is checked first (a ``ValueError`` naming it): its name a non-empty string, its
    slot a contiguous uint8 ``[max_tokens, row_bytes]`` CPU tensor (the ops copy its first rows as
    one run of bytes from its address, which a strided slot's rows are not), its flag and waiting
    word semaphores, its check callable.
    """
    if not isinstance(layer, ArmedLayer):
        raise ValueError(f"ple_ops.arm: layer must be an ArmedLayer, got {shown(layer)}")
    text("ple_ops.arm", "layer.name", layer.name)
    if layer.name in _armed:
        raise ValueError(
            f"ple_ops: layer {layer.name!r} is already armed in this process (by an OffloadRuntime still "
            "open, or by hand): close() that runtime first, or use it as `with OffloadRuntime(...) as rt:`; "
            "a layer armed by hand is freed by ple_ops.disarm(name)"
        )
    _check_layer(layer)
    _gone.pop(layer.name, None)
    _armed[layer.name] = layer


def disarm(name: str, error: Callable[[], BaseException] | None = None) -> None:
    """Forget ``name``. With ``error``, later lookups of the name raise ``error()`` until it is re-armed."""
    _armed.pop(name, None)
    if error is not None:
        _gone[name] = error


def lookup(name: str, op: str = "ple_ops.lookup") -> ArmedLayer:
    """The armed layer called ``name``; an unknown name is a ``ValueError`` from ``op`` that lists
    the armed ones (a name disarmed with a reason raises that reason)."""
    layer = _armed.get(name)
    if layer is None:
        gone = _gone.get(name)
        if gone is not None:
            raise gone()
        return find_named(_armed, name, op, "armed layer")
    return layer


def armed_names() -> list[str]:
    return sorted(_armed)


__all__ = ["ArmedLayer", "StepGuard", "arm", "disarm", "lookup", "armed_names", "STEP_TIMEOUT_S"]
