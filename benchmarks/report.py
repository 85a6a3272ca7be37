"""What the benchmark scripts share for their results: the CSV file and the matplotlib figure."""

from __future__ import annotations

import csv
from pathlib import Path


def columns(rows: list[dict], first: list[str] | tuple[str, ...] = ()) -> list[str]:
    """``first``, then every other key of ``rows`` in the order it first appears."""
    return list(first) + [k for k in dict.fromkeys(k for r in rows for k in r) if k not in first]


def write_csv(
    path: Path, rows: list[dict], fieldnames: list[str], digits: int | None = None, ignore_extra: bool = False
) -> None:
    """Write ``rows`` under ``fieldnames``; floats rounded to ``digits`` when given. A key not in
    ``fieldnames`` raises, unless ``ignore_extra`` (a script whose rows carry working fields)."""
    if digits is not None:
        rows = [{k: round(v, digits) if isinstance(v, float) else v for k, v in r.items()} for r in rows]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fieldnames, extrasaction="ignore" if ignore_extra else "raise")
        w.writeheader()
        w.writerows(rows)


def can_plot(path: Path) -> bool:
    """Whether matplotlib is there to draw ``path``; says so when it is not (the CSV and the table
    are the results, the figure only helps to read them)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"matplotlib is not installed: no {path.name}", flush=True)
        return False
    return True


def figure(ncols: int, figsize: tuple[float, float], **subplots):
    """``(fig, axes)``: one row of ``ncols`` axes, drawn with Agg (the scripts run on machines with
    no display). Call :func:`can_plot` first: this imports matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=figsize, **subplots)


def save_figure(fig, path: Path) -> None:
    """Lay out ``fig``, write it to ``path`` and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["can_plot", "columns", "figure", "save_figure", "write_csv"]
