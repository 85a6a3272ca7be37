"""Block ids on the engine's hot path: their intake and host-side check, and the pool of what the GPU reads.

Ids are taken in once (lists, arrays or tensors) and checked on the host; what the GPU reads (id
blocks, the graphs fed from them) is reused only after it has.

A scheduler hands the engine Python lists. Turning one into a torch tensor and checking it with
torch costs a dozen tiny torch operations, each with its dispatch overhead; the same in numpy is
a few calls in all, and up to :data:`kv_ops.validation.SMALL_IDS` ids Python's own min, max and
set on a list cost less still (a short tensor or array is checked as a list; docs/measurements.md,
"Short id lists are checked as lists").
Ids already on the GPU are never read by the host (that would wait for the caller's stream):
they go to a path whose kernel reads them, which skips and counts an invalid pair
(:func:`kv_ops.error_count`) instead of raising.
"""

from __future__ import annotations

import reprlib
from collections import deque

import numpy as np
import torch

from ..cuda.host_memory import pinned_empty
from ..validation import SMALL_IDS, check_host_ids, ids_message, ids_ok, no_values_message

# What numpy makes of a list of integers: anything else is refused.
_INTEGER_KINDS = "iu"
# The dtypes an id array may have, as the ops' id tensors (kv_ops.validation.ids_ok).
_ARRAY_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
_BOOLS = frozenset((bool, np.bool_))


def take(op: str, what: str, ids, limit: int, unique: bool, device: torch.device) -> np.ndarray | torch.Tensor:
    """``ids`` as a 1-D int64 numpy array checked against ``[0, limit)`` (and for repeats with
    ``unique``), or, for a tensor on ``device`` (CUDA), as that tensor in int64, unchecked.

    Accepted: a flat list, tuple or other sequence of ints; a 1-D int32 or int64 numpy array;
    a 1-D int32 or int64 tensor on the CPU or on ``device``. Anything else is a ``ValueError``
    naming ``what`` and the dtype or shape: float ids would be truncated to another block
    (0.7 -> 0) and booleans become block 0 or 1; a 2-D id array is a caller's slip, never a
    transfer; meta tensors hold no values. The test is a dtype and ndim check, no conversion.
    The array may share memory with the caller's; the engine copies what it keeps beyond the call.
    """
    if isinstance(ids, torch.Tensor):
        return _take_tensor(op, what, ids, limit, unique, device)
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or ids.dtype not in _ARRAY_DTYPES:
            raise ValueError(
                f"{op}: {what} must be a 1-D int32 or int64 array, got a numpy {ids.dtype} array of shape {ids.shape}"
            )
        return _checked(op, what, ids, limit, unique)
    return _take_sequence(op, what, ids, limit, unique)


def _take_tensor(op: str, what: str, ids: torch.Tensor, limit: int, unique: bool, device: torch.device):
    """:func:`take` for a tensor: checked int64 numpy from the CPU, int64 unchecked on ``device``."""
    # is_meta / is_cpu, not device.type: each device query builds a new torch.device object,
    # host time on every call of the hot path.
    if ids.is_meta:
        raise ValueError(no_values_message(op, what))
    if not ids_ok(ids):
        raise ValueError(ids_message(op, what, ids))
    if ids.is_cpu:
        # A short list is cheaper to make and to check than an array: numpy's fixed cost per
        # call outweighs the work (docs/measurements.md, "Short id lists are checked as lists").
        if ids.numel() <= SMALL_IDS:
            values = ids.tolist()
            check_host_ids(op, what, values, limit, unique)
            return np.array(values, dtype=np.int64)
        return _checked(op, what, ids.numpy(), limit, unique)
    if ids.device == device:
        # int64 and contiguous, what the kernel path's compiled kernel was made for; each
        # conversion only where needed (a no-op .to is still a dispatched operation).
        if ids.dtype != torch.int64:
            ids = ids.to(torch.int64)
        return ids.contiguous()
    raise ValueError(f"{op}: {what} is on {ids.device}, but the engine's cache is on {device}")


def _take_sequence(op: str, what: str, ids, limit: int, unique: bool) -> np.ndarray:
    """:func:`take` for a list, tuple or other sequence of ints."""
    try:
        array = np.asarray(ids)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"{op}: {what} must be integer block ids, got {type(ids).__name__} ({e})") from None
    if array.size and (array.dtype.kind not in _INTEGER_KINDS or array.dtype == np.uint64):
        _refuse(op, what, ids, array)
    if array.ndim != 1:
        raise ValueError(
            f"{op}: {what} must be a flat sequence of ids, got {type(ids).__name__} of shape {array.shape}"
        )
    if array.size == 0:
        return array.astype(np.int64)  # [] is float64 to numpy, but holds no value to truncate
    # A bool is an int to numpy (True is block 1): among ints it is refused, not taken as a block.
    if not _BOOLS.isdisjoint(map(type, ids)):
        i, v = next((i, v) for i, v in enumerate(ids) if type(v) in _BOOLS)
        raise ValueError(f"{op}: {what}[{i}] is {v!r}, a bool, not a block id")
    if type(ids) in (list, tuple):
        check_host_ids(op, what, ids, limit, unique)  # on the list itself: its fast form
        return array.astype(np.int64, copy=False)
    return _checked(op, what, array, limit, unique)


def _checked(op: str, what: str, array: np.ndarray, limit: int, unique: bool) -> np.ndarray:
    array = array.astype(np.int64, copy=False)
    check_host_ids(op, what, array, limit, unique)
    return array


def _refuse(op: str, what: str, ids, array: np.ndarray) -> None:
    """Raise for a sequence that is not integer ids, naming what numpy made of it and the values
    (off the hot path: only a refused call gets here)."""
    raise ValueError(
        f"{op}: {what} must be integer block ids, got a {type(ids).__name__} of {array.dtype}: {reprlib.repr(ids)}"
    )


class IdBlock:
    """One page-locked int64 buffer of ``words`` ids, with its numpy view and device address."""

    __slots__ = ("tensor", "words", "address")

    def __init__(self, words: int):
        self.tensor = pinned_empty(words, dtype=torch.int64)
        self.words = self.tensor.numpy()
        self.address = self.tensor.data_ptr()  # UVA: the copy engines read it as it is


class Pool:
    """Things the GPU reads (page-locked id blocks, graphs fed from them), reused only after it has.

    A call takes one, writes it, enqueues the work that reads it, and gives it back with an event
    that completes after that work. They come back in issue order, so the oldest is the first
    that can be free: :meth:`take` reuses it once its event has fired, and otherwise makes one
    more. The pool grows to the number of calls in flight, once, and no further.

    Growing is not free: making a page-locked block (``cuMemHostRegister``) or capturing a graph
    waits for the device's default stream, whose queue may be the model's whole forward. So a
    pool must not grow spuriously, and the events it is handed are often the engine's recycled
    completion events (:class:`kv_ops.transfer.blocks.Events`), recorded again for a later
    transfer once reported. Such an event would look busy until that later transfer ends, and
    the pool would grow (and stall) under every sustained stream of calls. Hence the count: an
    event's ``records`` (set by ``Events``) changes only when it is recorded again, which
    happens only after its transfer was reported complete, so a changed count means the record
    this item waited for has run.
    """

    def __init__(self, make, initial: int = 2):
        self._make = make
        self.made = initial  # made so far: the pool's size
        self._free: deque = deque(make() for _ in range(initial))
        self._busy: deque[tuple[object, torch.cuda.Event, int]] = deque()

    def take(self):
        busy = self._busy
        while busy and _has_run(busy[0]):
            self._free.append(busy.popleft()[0])
        if self._free:
            return self._free.popleft()
        self.made += 1
        return self._make()

    def give(self, item, read: torch.cuda.Event) -> None:
        """``item`` may be rewritten once ``read`` has completed."""
        self._busy.append((item, read, getattr(read, "records", 0)))


def _has_run(entry) -> bool:
    _, event, records = entry
    return getattr(event, "records", 0) != records or event.query()


__all__ = ["take", "IdBlock", "Pool"]
