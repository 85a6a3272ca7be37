"""``python -m kv_ops.tools.doctor``: the machine checks kv_ops and ple_ops depend on, each with its fix, and ``measure_link``.

One module per kind of check (``cuda``, ``link``, ``storage``), each check a function there with
what only it uses; ``REPORT`` below puts each in the report, in order. A new check is a function
in its kind's module and a line in ``REPORT``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Iterable
from fractions import Fraction

import torch

from ...cuda.arguments import cuda_device, index, path
from ...cuda.arguments import seconds as seconds_argument
from .common import CUDA_CHECKS, NO_CUDA, CheckResult, Options, ReportLine
from .cuda import check_batched_copy, check_driver_version, check_host_register, check_stream_memory_ops
from .link import LinkBandwidth, check_pcie_link, measure_link
from .storage import check_o_direct, check_shm

# The report's lines in order. Each ``run`` looks its check up by name in this package when it
# runs (a lambda, not the function itself), so a check patched here is the one that runs.
REPORT: list[ReportLine] = [
    ReportLine("driver", lambda o: check_driver_version(o.device)),
    ReportLine("stream memory ops", lambda o: check_stream_memory_ops(o.device)),
    ReportLine("host register", lambda o: check_host_register(o.device)),
    ReportLine("batched copy", lambda o: check_batched_copy(o.device)),
    ReportLine("PCIe link", lambda o: check_pcie_link(o.device, o.seconds)),
    ReportLine("/dev/shm", lambda o: check_shm(o.ple_bytes)),
    ReportLine("O_DIRECT {dir}", lambda d: check_o_direct(d), each_dir=True),
]


# --- running and reporting -----------------------------------------------------------------------


def _guarded(name: str, check, *args) -> CheckResult:
    # One broken check must not hide the others, and the report never shows a traceback.
    try:
        return check(*args)
    except ImportError as e:
        fix = "pip install cuda-bindings" if (getattr(e, "name", None) or "").startswith("cuda") else None
        return CheckResult(name, "fail", f"{type(e).__name__}: {e}", fix)
    except Exception as e:
        return CheckResult(name, "fail", f"{type(e).__name__}: {e}")


def run_checks(
    device: torch.device | str | int | None = None,
    ple_bytes: int = 0,
    dirs: list[str] | tuple[str, ...] = (),
    seconds: float = 1.0,
) -> list[CheckResult]:
    """Run every check, in report order; exceptions become ``fail`` results.

    Parameters
    ----------
    device : device, optional
        The CUDA device to check; the current one by default (where torch sees no CUDA device,
        the CUDA checks then report ``skip``). A device given must be a CUDA device of this machine.
    ple_bytes : int
        Bytes the PLE runtime will need in ``/dev/shm``; 0 only reports the free space.
    dirs : sequence of str
        Candidate disk-tier directories, each checked for O_DIRECT: a list, even of one.
    seconds : float
        Time for the link bandwidth measurement.

    Returns
    -------
    list of CheckResult

    Raises
    ------
    ValueError
        For an argument out of its rule, naming it and its value, before any check runs.
    """
    options = checked_options(device, ple_bytes, dirs, seconds)
    results = []
    for line in REPORT:
        if line.each_dir:
            results += [_guarded(line.name.format(dir=d), line.run, d) for d in options.dirs]
        else:
            results.append(_guarded(line.name, line.run, options))
    return results


def checked_options(device, ple_bytes, dirs, seconds) -> Options:
    """:func:`run_checks`'s arguments, each checked by its rule (a ``ValueError`` naming it)."""
    if device is not None:  # None keeps the report of a machine without CUDA: skip lines
        device = cuda_device("run_checks", device)
    ple_bytes = index("run_checks", "ple_bytes", ple_bytes)
    # A string is iterable: its characters would each be checked as a directory ("/" among them).
    if isinstance(dirs, (str, bytes, os.PathLike)) or not isinstance(dirs, Iterable):
        raise ValueError(f"run_checks: dirs must be a list of directories, got {dirs!r} (one directory: [{dirs!r}])")
    dirs = tuple(path("run_checks", f"dirs[{i}]", d) for i, d in enumerate(dirs))
    return Options(device, ple_bytes, dirs, seconds_argument("run_checks", "seconds", seconds))


def format_report(results: list[CheckResult]) -> str:
    """The aligned summary table that :func:`main` prints.

    Parameters
    ----------
    results : list of CheckResult

    Returns
    -------
    str
        One line per check, a ``fix:`` line under each check that has one, and a count by status.
    """
    width = max([len("check")] + [len(r.name) for r in results])
    indent = " " * (width + 2 + 6 + 2)
    lines = [f"{'check':<{width}}  status  detail", f"{'-' * width}  ------  {'-' * 6}"]
    for r in results:
        lines.append(f"{r.name:<{width}}  {r.status:<6}  {r.detail}")
        if r.fix:
            lines.append(f"{indent}fix: {r.fix}")
    counts = {s: sum(r.status == s for r in results) for s in ("ok", "warn", "fail", "skip")}
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)


_UNITS = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}


def parse_bytes(text: str) -> int:
    """A size as ``--ple-bytes`` takes it: bytes, or with a K, M, G or T suffix (powers of 1024;
    ``KiB``/``KB`` alike), fractions allowed (``1.5k``). Raises ``argparse.ArgumentTypeError``.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (a number of bytes, or with K, M, G or T)")
    # Exact arithmetic: a fraction of a byte is refused, not floored (0.5 would become 0, which
    # means "no plan to check").
    size = Fraction(m.group(1)) * (1 << _UNITS[m.group(2).lower()])
    if size.denominator != 1:
        raise argparse.ArgumentTypeError(f"not a whole number of bytes: {text!r} is {float(size):g} bytes")
    return int(size)


def parse_device(text: str) -> torch.device:
    """A device as ``--device`` takes it: ``cuda``, ``cuda:N`` or an index ``N``, a CUDA device of
    this machine. Raises ``argparse.ArgumentTypeError``."""
    value = int(text) if re.fullmatch(r"[-+]?\d+", text) else text
    try:
        return cuda_device("--device", value, "value")
    except ValueError as e:
        hint = "" if torch.cuda.is_available() else "; leave --device out for the report of a machine without CUDA"
        raise argparse.ArgumentTypeError(str(e).removeprefix("--device: ") + hint) from None


def parse_dir(text: str) -> str:
    """A directory as ``--dir`` takes it: any non-empty name (the check reports one that is missing)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty directory name (pass a directory, e.g. --dir /nvme/kv)")
    return text


def main(argv: list[str] | None = None) -> int:
    """Command line: print the report; return 1 if any check failed, else 0.

    Parameters
    ----------
    argv : list of str, optional
        Arguments (``sys.argv[1:]`` by default): ``--ple-bytes N``, ``--dir DIR ...``, ``--device``.

    Returns
    -------
    int
        The exit status: warnings and skips are not failures.
    """
    parser = argparse.ArgumentParser(
        prog="python -m kv_ops.tools.doctor",
        description="Check that this machine can run kv_ops and ple_ops, with a fix for each problem found.",
    )
    parser.add_argument(
        "--ple-bytes",
        type=parse_bytes,
        default=0,
        metavar="N",
        help="bytes the PLE runtime will need in /dev/shm (K, M, G, T suffixes: powers of 1024); default 0: just report",
    )
    parser.add_argument(
        "--dir",
        dest="dirs",
        action="extend",
        nargs="+",
        type=parse_dir,
        default=[],
        metavar="DIR",
        help="disk-tier directory to check for O_DIRECT",
    )
    parser.add_argument(
        "--device", type=parse_device, default=None, help="CUDA device to check, cuda:N or N (default: the current one)"
    )
    args = parser.parse_args(argv)
    try:
        results = run_checks(args.device, args.ple_bytes, args.dirs)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print(format_report(results))
    return 1 if any(r.status == "fail" for r in results) else 0


__all__ = [
    "CheckResult",
    "LinkBandwidth",
    "measure_link",
    "check_driver_version",
    "check_stream_memory_ops",
    "check_host_register",
    "check_batched_copy",
    "check_pcie_link",
    "check_shm",
    "check_o_direct",
    "run_checks",
    "format_report",
    "parse_bytes",
    "parse_device",
    "parse_dir",
    "checked_options",
    "REPORT",
    "ReportLine",
    "Options",
    "main",
    "NO_CUDA",
    "CUDA_CHECKS",
]
