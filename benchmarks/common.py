"""What the benchmark scripts share: the command line, the CUDA requirement, failure capture, sizes,
timing a GPU call from CUDA-graph replays, matmuls that leave SMs to copies, and writing the
results (CSV, Markdown table, figure)."""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import traceback
from pathlib import Path

import torch

from report import can_plot, columns, figure, save_figure, write_csv  # this script's own directory

RESULTS = Path("benchmarks/results")  # --out's default, relative to the repository root
NO_CUDA_STATUS = 1  # the exit status of a GPU-only script on a machine without CUDA
# The engine's paths and the colour each is drawn in by every figure.
PATH_COLORS = {"kernel": "tab:blue", "staged": "tab:green", "dma": "tab:orange", "auto": "tab:red"}

# What failed, in order: a script records a failed measurement here and goes on with the others
# (a GPU run measures everything in one go), then ``finish`` exits non-zero.
FAILURES: list[str] = []


# --- the command line --------------------------------------------------------------------------


def parser(doc: str | None, quick: str | None = None) -> argparse.ArgumentParser:
    """The scripts' parser: ``doc`` as the description (kept as written), ``--out`` and, when
    ``quick`` is the help text of the shorter run, ``--quick``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--out",
        type=Path,
        default=RESULTS,
        help=f"folder for the CSV, the Markdown table and the PNG figure (default: {RESULTS})",
    )
    if quick is not None:
        p.add_argument("--quick", action="store_true", help=quick)
    return p


def parse(p: argparse.ArgumentParser, *, cuda: bool, argv: list[str] | None = None, check=None) -> argparse.Namespace:
    """The arguments, after ``check(p, args)`` (checks between arguments, which call ``p.error``)
    and the CUDA requirement (``cuda``: a GPU-only script, see :func:`require_cuda`); creates
    ``--out``. Bad arguments are refused before a machine without CUDA is."""
    args = p.parse_args(argv)
    if check is not None:
        check(p, args)
    if cuda:
        require_cuda(p.prog)
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def require_cuda(script: str) -> None:
    """Exit with :data:`NO_CUDA_STATUS` and one line on stderr unless a CUDA device is there: every
    GPU-only script refuses a machine without one alike, after ``--help`` has had its say."""
    if not torch.cuda.is_available():
        print(
            f"{script}: needs a CUDA device (torch.cuda.is_available() is False); nothing measured",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(NO_CUDA_STATUS)


def at_least(low: int):
    """An argparse type: a whole number of at least ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


at_least_one = at_least(1)


# --- failures ----------------------------------------------------------------------------------


def guard(what: str, fn, *args):
    """``fn(*args)``, or None after recording ``what`` in :data:`FAILURES` and printing the
    traceback: one failed measurement must not cost the others."""
    try:
        return fn(*args)
    except Exception:
        FAILURES.append(what)
        print(f"FAILED: {what}", flush=True)
        traceback.print_exc()
        sys.stderr.flush()
        return None


def finish() -> None:
    """Exit with status 1, naming them, if any measurement failed."""
    if FAILURES:
        print("failed: " + "; ".join(FAILURES), flush=True)
        sys.exit(1)


# --- sizes and the engine ----------------------------------------------------------------------


def kib(n: int) -> str:
    """``n`` bytes as "2 MiB", "64 KiB" or "512 B": the largest unit that divides it."""
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20} MiB"
    if n >= 1024 and n % 1024 == 0:
        return f"{n >> 10} KiB"
    return f"{n} B"


def picked(before: dict, after: dict) -> str:
    """Which paths served the calls between two snapshots of ``engine.path_counts``."""
    diff = {p: n - before.get(p, 0) for p, n in after.items() if n > before.get(p, 0)}
    if len(diff) <= 1:
        return next(iter(diff), "")
    total = sum(diff.values())
    return " + ".join(f"{p} {round(100 * n / total)}%" for p, n in sorted(diff.items(), key=lambda kv: -kv[1]))


# --- timing ------------------------------------------------------------------------------------


def time_graph(fn, reps: int = 15) -> float:
    """Median GPU seconds of one call of ``fn``: captured once in a CUDA graph (so Python's launch
    cost leaves no gaps between its kernels), replayed ``reps`` times, timed with CUDA events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside capture: compiles, builds the region tables
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del graph
    return statistics.median(times)


@contextlib.contextmanager
def matmuls_leave_sms(sms: int | None):
    """Inside the block, matmuls go through cuBLASLt and leave ``sms`` SMs to other kernels (the
    copy kernels beside them); None changes nothing. The carveout is read when a matmul is
    launched, so it must hold while a step is captured; cuBLASLt honours it, cuBLAS's own
    heuristics do not. Both settings are put back on the way out, also where setting one failed
    (a torch built without cuBLASLt)."""
    if sms is None:
        yield
        return
    blas = torch.backends.cuda.preferred_blas_library()
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        torch._C._set_sm_carveout_experimental(sms)
        yield
    finally:
        torch._C._set_sm_carveout_experimental(None)
        torch.backends.cuda.preferred_blas_library(blas)


# --- the results -------------------------------------------------------------------------------


def save(
    out: Path,
    name: str,
    rows: list[dict],
    fieldnames: list[str],
    *,
    table: str | None = None,
    plot=None,
    digits: int | None = None,
    ignore_extra: bool = False,
) -> None:
    """``name.csv`` in ``out`` (see ``report.write_csv`` for ``digits`` and ``ignore_extra``); with
    ``table``, ``name.md``, also printed; with ``plot(rows, path)``, ``name.png`` when matplotlib is
    there (a failed figure is recorded in :data:`FAILURES`: the CSV and the table are the results)."""
    write_csv(out / f"{name}.csv", rows, fieldnames, digits=digits, ignore_extra=ignore_extra)
    if table is not None:
        (out / f"{name}.md").write_text(table)
        print("\n" + table, flush=True)
    png = out / f"{name}.png"
    if plot is not None and can_plot(png):
        guard("plot", plot, rows, png)


def table_head(*cells: str) -> list[str]:
    """A Markdown table's header and rule lines: each cell is a column's title, a title that ends
    in ``:`` (the colon dropped) right-aligned, as numbers are."""
    titles = [c[:-1] if c.endswith(":") else c for c in cells]
    rule = ["---:" if c.endswith(":") else "---" for c in cells]
    return ["| " + " | ".join(titles) + " |", "| " + " | ".join(rule) + " |"]


__all__ = [
    "FAILURES",
    "NO_CUDA_STATUS",
    "PATH_COLORS",
    "RESULTS",
    "at_least",
    "at_least_one",
    "can_plot",
    "columns",
    "figure",
    "finish",
    "guard",
    "kib",
    "parse",
    "parser",
    "picked",
    "require_cuda",
    "save",
    "save_figure",
    "table_head",
    "time_graph",
    "write_csv",
]
