"""The plain arguments every public entry point of kv_ops and ple_ops shares: counts and devices, one rule each."""

from __future__ import annotations

import numbers

import torch


def positive_int(owner: str, what: str, value) -> int:
    """``value`` as an ``int`` when it is an integer >= 1, else a ``ValueError`` naming all three.

    Python and numpy integers pass. ``bool`` is refused (``True`` blocks is a slip, never a size)
    and so is ``2.0``: a float where a count belongs is a unit mistake more often than not.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{owner}: {what} must be a positive integer, got {value!r}")
    return int(value)


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


__all__ = ["positive_int", "device", "cuda_device"]
