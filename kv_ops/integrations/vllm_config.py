"""The kv_connector_extra_config keys OffloadOpsSpec parses itself, each checked when the spec is made."""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Mapping

from ..cuda.arguments import path
from ..transfer.engine_arguments import PATHS

WHERE = "OffloadOpsSpec: kv_connector_extra_config"

#: The ``kv_ops_`` keys, each with the :class:`kv_ops.OffloadEngine` argument it sets.
ENGINE_KEYS = {"kv_ops_path": "path", "kv_ops_crossover_file": "crossover_file"}


def engine_kwargs(extra_config: Mapping) -> dict:
    """The engine's arguments the ``kv_ops_`` keys set, checked here, on the scheduler side, so
    that a slip is refused before any worker or host memory exists (the engine would see it only
    when the worker is built, under its own argument names). A ``kv_ops_`` key this spec does not
    know is refused: vLLM passes every key through, so a misspelt one would be silently ignored."""
    unknown = sorted(key for key in extra_config if isinstance(key, str) and key.startswith("kv_ops_"))
    unknown = [key for key in unknown if key not in ENGINE_KEYS]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, ENGINE_KEYS, n=1)
        hint = f' (did you mean "{close[0]}"?)' if close else ""
        raise ValueError(
            f'{WHERE} "{key}" is not a kv_ops key{hint}; the kv_ops_ keys are '
            + ", ".join(f'"{k}"' for k in ENGINE_KEYS)
        )
    kwargs = {}
    if "kv_ops_path" in extra_config:
        value = extra_config["kv_ops_path"]
        # The engine's own list of paths: one rule, wherever the path is given.
        if not isinstance(value, str) or value not in PATHS:
            raise ValueError(f'{WHERE} "kv_ops_path" must be one of {", ".join(map(repr, PATHS))}, got {value!r}')
        kwargs["path"] = value
    value = extra_config.get("kv_ops_crossover_file")
    if value is not None:  # None: no file, the engine's default
        kwargs["crossover_file"] = path("OffloadOpsSpec", 'kv_connector_extra_config "kv_ops_crossover_file"', value)
    return kwargs


def cpu_bytes_to_use(extra_config: Mapping) -> int:
    """``cpu_bytes_to_use`` as a positive whole number of bytes, checked before vLLM's CPU spec
    reads it with ``int(value)``: vLLM would take -1 for a size and fail later on a negative
    count, truncate 1.5 to 1, and fail on ``"1GB"`` or ``"²"`` with ``int()``'s message, none of
    which names the key."""
    value = extra_config.get("cpu_bytes_to_use")
    if value is None:  # in vLLM's words, which its own tests expect
        raise ValueError(
            "OffloadOpsSpec: cpu_bytes_to_use must be specified in kv_connector_extra_config: the bytes "
            f"of host memory to offload into (e.g. {16 << 30} for 16 GiB)"
        )
    number = whole_number(value)
    if number is None or number < 1:
        raise ValueError(
            f'{WHERE} "cpu_bytes_to_use" must be a positive whole number of bytes (e.g. {16 << 30} for 16 GiB, '
            f"which vllm serve's --kv-transfer-config also takes unquoted as 16G), got {value!r}"
        )
    return number


def whole_number(value) -> int | None:
    """``value`` as an ``int`` where it is a whole number, else None: an integer (Python's or
    numpy's; not a bool), a float with no fraction (vLLM's ``--kv-offloading-size`` makes GiB
    times 2**30, a float), or a string of ASCII digits (with spaces around it, as ``int()``
    takes it; ``str.isdigit`` alone passes ``"²"``, which ``int()`` refuses)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return int(value) if math.isfinite(value) and float(value).is_integer() else None
    if isinstance(value, str):
        digits = value.strip()
        return int(digits) if digits.isascii() and digits.isdigit() else None
    return None


__all__ = ["ENGINE_KEYS", "cpu_bytes_to_use", "engine_kwargs", "whole_number"]
