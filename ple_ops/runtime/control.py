"""ControlBlock: the shared words of the PLE step transaction, and the messages on the runtime's pipe.

Both processes build the same :class:`ControlBlock` (the runtime ``create()``s it, the worker
``attach()``es it); every offset is computed here, once, from ``(max_tokens, num_layers)``.

The block is one page-locked shared buffer (device-mapped in the GPU process)::

    line 0    runtime words   REQUEST, NUM_TOKENS, STOP                    (int64)
    line 1    worker words    TAKEN, SERVED, FAILED, WORKER_LAYER, WORKER_PHASE (int64)
    ids       int64 [max_tokens], from line 2
    layers    one 64-byte line per layer:
              +0  flag       int32  DONE when the layer's rows are in its slot (worker raises;
                                    the consumer's release resets)
              +4  waiting    int32  WAITING from just before a stream waits on the flag until
                                    that step's release (written by GPU stream operations)
              +8  delivered  int64  the last step whose rows the worker published (worker)

Words written by different agents sit on different cache lines where it matters (the runtime's
request and the worker's progress), so that spinning on one does not bounce the other.

The protocol, for step ``s``:

* runtime: once ``TAKEN == s - 1`` (the worker copied the last ids), write the ids and count,
  release fence, ``REQUEST = s``;
* worker: copy the ids, ``TAKEN = s``; then per layer: compute the rows, wait until
  ``flag == RESET`` (the previous step's rows are no longer being pulled), store the rows,
  release fence, ``flag = DONE``, then ``delivered = s``; finally ``SERVED = s``;
* stream, per layer: ``waiting = WAITING``, wait ``flag == DONE``, pull; at release: wait
  ``flag == DONE``, ``waiting = IDLE``, ``flag = RESET``.

Hence ``waiting == WAITING and flag == RESET and delivered == REQUEST``, held for a while, means a
stream waits for rows that no prepared step will produce: the watchdog's "stuck" condition.
"""

from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass

import torch

from ..semaphore import IDLE, WAITING, CpuGpuSemaphore
from .shared_memory import SharedHandle, SharedHostBuffer

LINE = 64  # bytes: one cache line


class Word(enum.IntEnum):
    """The int64 header words; a word's byte offset is ``8 * word``."""

    REQUEST = 0  # last requested step; the runtime bumps it last, after NUM_TOKENS and the ids
    NUM_TOKENS = 1  # ids in the requested step
    STOP = 2  # nonzero: the worker exits at its next wait
    TAKEN = 8  # last step whose ids the worker copied; the runtime writes new ids only after it
    SERVED = 9  # last step the worker finished (every layer published, poisoned or not)
    FAILED = 10  # last step whose rows the worker could not compute; its StepFailed is on the pipe first
    WORKER_LAYER = 11  # index of the layer the worker is busy with (diagnostics)
    WORKER_PHASE = 12  # a Phase (diagnostics: what a late worker is doing)


_HEADER_WORDS = 16  # two lines


class Phase(enum.IntEnum):
    """What the worker is doing, for the runtime's timeout message."""

    IDLE = 0
    COMPUTING = 1
    AWAITING_RESET = 2
    PUBLISHING = 3


@dataclass(frozen=True)
class ControlHandle:
    """What the worker needs to attach the control block. Picklable, no CUDA."""

    buffer: SharedHandle
    max_tokens: int
    num_layers: int


@dataclass(frozen=True)
class _Layout:
    """Byte offsets of the block, from its geometry alone."""

    max_tokens: int
    num_layers: int

    @property
    def ids(self) -> int:
        return _HEADER_WORDS * 8

    @property
    def layers(self) -> int:
        return -(-(self.ids + 8 * self.max_tokens) // LINE) * LINE

    def flag(self, i: int) -> int:
        return self.layers + i * LINE

    def waiting(self, i: int) -> int:
        return self.flag(i) + 4

    def delivered(self, i: int) -> int:
        return self.flag(i) + 8

    @property
    def nbytes(self) -> int:
        return self.layers + max(1, self.num_layers) * LINE


class ControlBlock:
    """The shared words of one runtime: header, step ids, and per-layer flag/waiting/delivered.

    Use :meth:`create` in the GPU process and :meth:`attach` (with :attr:`handle`) in the worker.
    Header words are read and written through ctypes (a plain aligned 8-byte load or store, far
    cheaper from Python than tensor indexing): :meth:`get`, :meth:`set`.

    Attributes
    ----------
    words : ctypes array of int64
        The header words, indexed by :class:`Word` (or its int value): what :meth:`get` and
        :meth:`set` read and write, for a hot path that binds it once.
    ids : Tensor
        int64 ``[max_tokens]``, the requested step's token ids.
    flags, waiting : list of CpuGpuSemaphore
        Per layer: the rows-ready flag and the stream-is-waiting word (device-mapped when the
        block was created with ``map_for_gpu``).
    """

    def __init__(self, buffer: SharedHostBuffer, max_tokens: int, num_layers: int, map_for_gpu: bool):
        layout = _Layout(max_tokens, num_layers)
        if buffer.handle.nbytes != layout.nbytes:
            raise ValueError(f"ControlBlock: buffer of {buffer.handle.nbytes} bytes, layout needs {layout.nbytes}")
        self.buffer = buffer  # owns the mapping that the ctypes views below point into
        self.max_tokens = max_tokens
        self.num_layers = num_layers
        base = buffer.bytes.data_ptr()
        self.words = (ctypes.c_int64 * _HEADER_WORDS).from_address(base)
        self.ids = buffer.view(layout.ids, (max_tokens,), torch.int64)
        self.flags = [
            CpuGpuSemaphore.in_host_memory(buffer.view(layout.flag(i), (1,), torch.int32), map_for_gpu=map_for_gpu)
            for i in range(num_layers)
        ]
        self.waiting = [
            CpuGpuSemaphore.in_host_memory(buffer.view(layout.waiting(i), (1,), torch.int32), map_for_gpu=map_for_gpu)
            for i in range(num_layers)
        ]
        self._delivered = [ctypes.c_int64.from_address(base + layout.delivered(i)) for i in range(num_layers)]

    @classmethod
    def create(cls, max_tokens: int, num_layers: int, map_for_gpu: bool, tag: str | None = None) -> "ControlBlock":
        """A new zeroed block (flags RESET, streams IDLE, nothing requested or served).

        ``map_for_gpu`` page-locks the buffer and resolves the device addresses of the flags and
        waiting words, so that GPU streams can wait on and write them; ``tag`` goes into the
        buffer's file name (:class:`SharedHostBuffer`).
        """
        layout = _Layout(max_tokens, num_layers)
        buffer = SharedHostBuffer(layout.nbytes, register=map_for_gpu, tag=tag)
        try:
            buffer.bytes.zero_()
            return cls(buffer, max_tokens, num_layers, map_for_gpu)
        except BaseException:
            buffer.unlink()  # the caller never gets the block, so it could not remove the name
            raise

    @classmethod
    def attach(cls, handle: ControlHandle) -> "ControlBlock":
        """The block made by another process (host access only: no CUDA)."""
        return cls(SharedHostBuffer.attach(handle.buffer), handle.max_tokens, handle.num_layers, map_for_gpu=False)

    @property
    def handle(self) -> ControlHandle:
        return ControlHandle(self.buffer.handle, self.max_tokens, self.num_layers)

    def get(self, word: Word) -> int:
        return self.words[word]

    def set(self, word: Word, value: int) -> None:
        self.words[word] = value

    def delivered(self, layer: int) -> int:
        """The last step whose rows the worker published for ``layer``."""
        return self._delivered[layer].value

    def set_delivered(self, layer: int, step: int) -> None:
        self._delivered[layer].value = step

    def unlink(self) -> None:
        """Remove the block's file name (the mappings stay valid)."""
        self.buffer.unlink()


# --- messages on the runtime <-> worker pipe ------------------------------------------------------


@dataclass(frozen=True)
class LayerSpec:
    """One PLE layer as the worker built it: its name, the rows its forward_impl returns, and
    ``rows``, its table's row count where the worker gathers the layer's rows from its table (a
    pure lookup: an id outside ``[0, rows)`` fails the step there, so the runtime's ``prepare``
    refuses it first), else None (computed rows: the worker cannot tell which ids are valid)."""

    name: str
    dim: int
    dtype: torch.dtype
    rows: int | None = None

    @property
    def row_bytes(self) -> int:
        return self.dim * self.dtype.itemsize


@dataclass(frozen=True)
class LayersReport:
    """Worker -> runtime, first: the model is built; these are its PLE layers, in module order."""

    layers: tuple[LayerSpec, ...]


@dataclass(frozen=True)
class Attach:
    """Runtime -> worker: the control block and one slot buffer per layer (in the report's order)."""

    control: ControlHandle
    slots: tuple[SharedHandle, ...]


@dataclass(frozen=True)
class Ready:
    """Worker -> runtime: attached; serving steps."""


@dataclass(frozen=True)
class WorkerFailed:
    """Worker -> runtime: the worker is exiting on this exception (start-up or serving)."""

    traceback: str


@dataclass(frozen=True)
class StepFailed:
    """Worker -> runtime: ``step``'s rows could not be computed from ``layer`` on; they are poisoned.

    Sent before the worker writes ``Word.FAILED`` and raises the poisoned flags, so that whoever
    sees either finds this message on the pipe.
    """

    step: int
    layer: str
    traceback: str


__all__ = [
    "ControlBlock",
    "ControlHandle",
    "Word",
    "Phase",
    "IDLE",
    "WAITING",
    "LINE",
    "LayerSpec",
    "LayersReport",
    "Attach",
    "Ready",
    "WorkerFailed",
    "StepFailed",
]
