"""The plain arguments every public entry point of kv_ops and ple_ops shares (counts, indices, names, shapes, dtypes, seconds, regions, devices): one rule each."""

from __future__ import annotations

import numbers
import os
import reprlib
import sys
from collections.abc import Iterable, Mapping

import torch


def _integral(value) -> bool:
    """Whether ``value`` is an integer, Python's or numpy's. ``bool`` is not (``True`` blocks is a
    slip, never a size), nor is ``2.0``: a float where a count belongs is a unit mistake more
    often than not."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral)


def positive_int(owner: str, what: str, value) -> int:
    """``value`` as an ``int`` when it is an integer >= 1 (:func:`_integral`), else a ``ValueError``
    naming all three."""
    if not _integral(value) or value < 1:
        raise ValueError(f"{owner}: {what} must be a positive integer, got {value!r}")
    return int(value)


def integer(owner: str, what: str, value) -> int:
    """``value`` as an ``int`` when it is an integer of any sign (a count of tokens to forget
    given as ``-n``, :func:`_integral`), else a ``ValueError`` naming all three."""
    if not _integral(value):
        raise ValueError(f"{owner}: {what} must be an integer, got {shown(value)}")
    return int(value)


def index(owner: str, what: str, value) -> int:
    """``value`` as an ``int`` when it is an integer >= 0 (a layer, a position), else a
    ``ValueError`` naming all three (:func:`_integral`)."""
    if type(value) is int and value >= 0:  # the common case, without the ABC's isinstance
        return value
    if not _integral(value) or value < 0:
        raise ValueError(f"{owner}: {what} must be an integer >= 0, got {value!r}")
    return int(value)


def text(owner: str, what: str, value) -> str:
    """``value`` when it is a non-empty ``str`` (a name an op carries), else a ``ValueError``."""
    if type(value) is str and value:  # the common case first: ops check their name on every call
        return value
    if not isinstance(value, str) or not value:
        raise ValueError(f"{owner}: {what} must be a non-empty string, got {value!r}")
    return value


def flag(owner: str, what: str, value) -> bool:
    """``value`` as a ``bool`` when it is ``True`` or ``False`` (numpy's too), else a ``ValueError``
    naming all three: ``"no"`` or ``1`` would otherwise be read by truthiness, ``"no"`` as True."""
    # A numpy bool exists only once numpy is imported: this floor needs only torch, so it does not import it.
    numpy = sys.modules.get("numpy")
    if not isinstance(value, bool) and not (numpy is not None and isinstance(value, numpy.bool_)):
        raise ValueError(f"{owner}: {what} must be True or False, got {shown(value)}")
    return bool(value)


def shown(value) -> str:
    """``value`` as an error message names it: a tensor by its dtype, shape and device, a collection
    by its type and length, anything else by a repr cut short. Never a tensor's values: a KV
    cache's repr is thousands of numbers, and on a GPU printing them syncs the device."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    if isinstance(value, (list, tuple, Mapping, set, frozenset)):
        return f"{type(value).__name__} with {len(value)} entr{'y' if len(value) == 1 else 'ies'}"
    return reprlib.repr(value)


def tensor_list(owner: str, what: str, value) -> list[torch.Tensor]:
    """``value`` as a list when it is a list or tuple of tensors, else a ``ValueError``: a single
    tensor is refused, which ``list()`` would split into its rows, and so is a mapping (its
    values are the list meant)."""
    if isinstance(value, (list, tuple)):
        for i, t in enumerate(value):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{owner}: {what} must be a list of tensors, got {what}[{i}] = {shown(t)}")
        return list(value)
    hint = f"; pass its tensors, list({what}.values())" if isinstance(value, Mapping) else ""
    raise ValueError(f"{owner}: {what} must be a list of tensors, got {shown(value)}{hint}")


def rows(owner: str, what: str, value, count: int) -> torch.Tensor:
    """``value`` when it is a 1-D int32 or int64 tensor (what ``index_select`` takes) of ``count``
    row indices, each in ``[0, count)`` (beam search's reorder), else a ``ValueError`` naming the
    argument. On a GPU an index out of range is a device-side assert, which ends the process's
    use of CUDA, so the indices are read on the host first (a sync where they live on a GPU)."""
    indices = isinstance(value, torch.Tensor) and value.dtype in (torch.int32, torch.int64)
    if not indices or tuple(value.shape) != (count,):
        raise ValueError(
            f"{owner}: {what} must be a 1-D int32 or int64 tensor of {count} row indices, got {shown(value)}"
        )
    listed = value.tolist()
    if listed and not 0 <= min(listed) <= max(listed) < count:
        raise ValueError(f"{owner}: {what} holds rows {min(listed)} to {max(listed)}, outside [0, {count})")
    return value


def device(owner: str, value, what: str = "device") -> torch.device:
    """``value`` as a ``torch.device`` with its index: ``None`` means the current CUDA device where
    CUDA exists and the CPU elsewhere, ``"cuda"`` means ``cuda:<current>``, an int is a CUDA index.

    A CUDA device on a machine without CUDA, or an index past the last GPU, is a ``ValueError`` here,
    before anything is allocated (torch would raise its own ``AssertionError`` or ``RuntimeError``
    later, naming neither the caller nor the argument).
    """
    if value is None:
        value = "cuda" if torch.cuda.is_available() else "cpu"
    elif isinstance(value, bool) or not isinstance(value, (str, numbers.Integral, torch.device)):
        raise ValueError(f"{owner}: {what} must be a torch.device, a string or a CUDA index, got {value!r}")
    try:
        found = torch.device("cuda", int(value)) if isinstance(value, numbers.Integral) else torch.device(value)
    except (RuntimeError, ValueError) as error:
        raise ValueError(f"{owner}: {what} {value!r} is not a device ({error})") from None
    if found.type == "cpu":
        return torch.device("cpu")  # one CPU: "cpu:0" is the device a CPU tensor reports as "cpu"
    if found.type != "cuda":
        return found
    if not torch.cuda.is_available():
        raise ValueError(
            f"{owner}: {what} is {value!r}, but this machine has no CUDA device (torch.cuda.is_available() is False)"
        )
    index = torch.cuda.current_device() if found.index is None else found.index
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(
            f"{owner}: {what} is {value!r}, but this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    return torch.device("cuda", index)


def cuda_device(owner: str, value, what: str = "device") -> torch.device:
    """:func:`device`, for an entry point that only works on CUDA: ``None`` is the current GPU and a
    CPU device is a ``ValueError``."""
    if value is None and not torch.cuda.is_available():
        raise ValueError(
            f"{owner}: {what} defaults to the current CUDA device, but this machine has none "
            "(torch.cuda.is_available() is False)"
        )
    found = device(owner, "cuda" if value is None else value, what)
    if found.type != "cuda":
        raise ValueError(f"{owner}: {what} must be a CUDA device, got {value!r}")
    return found


def shape(owner: str, what: str, value) -> tuple[int, ...]:
    """``value`` as a shape tuple when it is an integer or a sequence of integers, else a
    ``ValueError`` naming all three (each an integer by :func:`_integral`); a string is refused
    rather than read as a sequence of characters."""
    if _integral(value):
        dims = (value,)
    elif isinstance(value, (str, bytes, torch.Tensor)) or not isinstance(value, Iterable):
        dims = None
    else:
        dims = tuple(value)
    if dims is None or not all(map(_integral, dims)):
        raise ValueError(f"{owner}: {what} must be an integer or a sequence of integers, got {value!r}")
    dims = tuple(int(d) for d in dims)
    if any(d < 0 for d in dims):
        raise ValueError(f"{owner}: negative dimension in {what} {dims}")
    return dims


def dtype(owner: str, what: str, value) -> torch.dtype:
    """``value`` when it is a ``torch.dtype``, else a ``ValueError``: torch takes no dtype names
    such as ``"float32"``, and ``None`` would reach torch as "the default", not as a mistake."""
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{owner}: {what} must be a torch.dtype (e.g. torch.uint8), got {value!r}")
    return value


def file_name_part(owner: str, what: str, value) -> str:
    """``value`` when it is a non-empty ``str`` that can stand inside one file name, else a
    ``ValueError``: a separator would put the file in another directory, and a NUL byte ends the
    name the kernel sees."""
    text(owner, what, value)
    for bad in ("/", os.sep, os.altsep, "\0"):
        if bad and bad in value:
            raise ValueError(f"{owner}: {what} goes into a file name and must not contain {bad!r}, got {value!r}")
    return value


def byte_regions(owner: str, what: str, value) -> list[torch.Tensor]:
    """The tensors of ``value``, in order, when it is a non-empty list or tuple, or mapping of
    names, of 2-D uint8 regions ``[num_blocks, block_bytes]``; else a ``ValueError`` naming the
    argument, or the entry, and what it is. Cache tensors themselves are not regions: their shape
    would be read as one."""
    if isinstance(value, Mapping):
        entries = [(f"{what}[{key!r}]", t) for key, t in value.items()]
    elif isinstance(value, (list, tuple)):
        entries = [(f"{what}[{i}]", t) for i, t in enumerate(value)]
    else:
        raise ValueError(f"{owner}: {what} must be a list or mapping of uint8 regions, got {shown(value)}")
    if not entries:
        raise ValueError(f"{owner}: {what} must hold at least one region, got {value!r}")
    for name, t in entries:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{owner}: {name} must be a 2-D uint8 region tensor, got {type(t).__name__}")
        if t.dim() != 2 or t.dtype != torch.uint8:
            raise ValueError(
                f"{owner}: {name} must be a 2-D uint8 region [num_blocks, block_bytes], got {t.dtype} "
                f"{tuple(t.shape)} (kv_ops.infer_regions or resolve_regions makes regions of cache tensors)"
            )
    return [t for _, t in entries]


def seconds(owner: str, what: str, value) -> float:
    """``value`` as a ``float`` when it is a finite number of seconds > 0, else a ``ValueError``
    naming all three. ``bool`` is refused: ``True`` where a timeout belongs is a slip, never a
    duration (and it would pass as one second)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < float("inf"):
        raise ValueError(f"{owner}: {what} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def path(owner: str, what: str, value) -> str:
    """``value`` as a ``str`` when it is a non-empty ``str``, or an ``os.PathLike`` giving one, with
    no NUL byte; else a ``ValueError`` naming all three. ``open()`` takes an int as a file
    descriptor (``True`` is fd 1, and a ``with`` closes the caller's stdout; 0 reads stdin and
    blocks), and ``None`` or bytes where a path belongs are slips."""
    name = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(name, str) or not name or "\0" in name:
        raise ValueError(f"{owner}: {what} must be a path (a non-empty str or os.PathLike), got {value!r}")
    return name


__all__ = [
    "positive_int",
    "integer",
    "index",
    "text",
    "flag",
    "shown",
    "tensor_list",
    "rows",
    "device",
    "cuda_device",
    "shape",
    "dtype",
    "file_name_part",
    "byte_regions",
    "seconds",
    "path",
]
