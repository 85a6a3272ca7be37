"""What every doctor check shares: the report's types, the no-CUDA skip and the formatting helpers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

NO_CUDA = "no CUDA device (torch.cuda.is_available() is False)"
CUDA_CHECKS = ("driver", "stream memory ops", "host register", "batched copy", "PCIe link")

# O_DIRECT needs the buffer, the offset and the length aligned to the device's logical block
# size; 4 KiB is what kv_ops.transfer.disk uses, so it is what must work.
ALIGN = 4096


@dataclass(frozen=True)
class CheckResult:
    """One line of the report: ``status`` is ``"ok"``, ``"warn"``, ``"fail"`` or ``"skip"``."""

    name: str
    status: str
    detail: str
    fix: str | None = None


@dataclass(frozen=True)
class Options:
    """What the report was asked to check, as :func:`run_checks` took it; each check reads its part."""

    device: torch.device | str | int | None
    ple_bytes: int
    dirs: tuple[str, ...]
    seconds: float


@dataclass(frozen=True)
class ReportLine:
    """A check's place in the report: the line's ``name`` and ``run``, which calls the check.

    ``run`` takes the :class:`Options`; with ``each_dir`` the check reports one line per directory
    asked for instead, ``name`` is formatted with ``dir`` and ``run`` takes the directory.
    """

    name: str
    run: Callable[..., CheckResult]
    each_dir: bool = False


# --- helpers shared by several checks ------------------------------------------------------------


def skip_no_cuda(name: str, fix: str | None = None) -> CheckResult:
    return CheckResult(name, "skip", NO_CUDA, fix)


def cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def fmt_bytes(n: float) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{int(n)} B"


def device_attribute(drv, name: str, ordinal: int) -> int | None:
    # cuda-bindings renames attributes between major versions (the V1/V2 stream-memory-op
    # attributes, for one), so look each one up by name and tolerate its absence.
    attr = getattr(drv.CUdevice_attribute, name, None)
    if attr is None:
        return None
    err, value = drv.cuDeviceGetAttribute(attr, ordinal)
    return int(value) if err == drv.CUresult.CUDA_SUCCESS else None
