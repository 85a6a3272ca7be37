"""What ``path="auto"`` measures and picks (kv_ops.transfer.crossover).

On the CPU: the pick from hand-made cells (the fastest path of the nearest cell; a copy-engine
path within 5% of it wins), the table that shows it, the JSON file (round trip, another shape's
file or a corrupt one is ignored), crossover()'s use of the file, and an auto engine that follows
its crossover call by call over all three paths, byte for byte. On the GPU: a real measurement
covers every cell with plausible rates (its time printed, a benchmark figure), and an auto engine
keeps it in a file that a second engine reads back instead of measuring.
"""

import json
import os
import re
import time
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kv_ops
from kv_ops.transfer import crossover as crossover_mod
from kv_ops.transfer.crossover import CALLS, COUNTS, RUN, TOLERANCE, Cell, Crossover, measure, shape_key
from kv_ops.transfer.dma import count_runs
from kv_ops.transfer.paths import Blocks, DirectDmaPath, Direction, KernelPath, StagedPath

gpu = pytest.mark.gpu
COPY_ENGINES = {p.name: p.copy_engines for p in (KernelPath, StagedPath, DirectDmaPath)}
KEY = {"device": "NVIDIA H200", "widths": [256, 256, 192], "ring_bytes": 1 << 20, "torch": "2.13.0"}
STORE, LOAD = Direction.STORE, Direction.LOAD


def cells_of(direction, blocks, runs, **gbps):
    return [Cell(path, direction, blocks, runs, rate) for path, rate in gbps.items()]


def sample_crossover():
    """Stores: small calls favour the kernel, large random ones the staged path, large runs DMA.
    Loads, cells of their own: small ones the staged path, 32 random the kernel, runs DMA."""
    return Crossover(
        dict(KEY),
        cells_of("store", 4, 4, kernel=10.0, staged=3.0, dma=2.0)
        + cells_of("store", 256, 256, kernel=20.0, staged=30.0, dma=8.0)
        + cells_of("store", 256, 16, kernel=20.0, staged=25.0, dma=40.0)
        + cells_of("load", 4, 4, kernel=5.0, staged=9.0, dma=1.0)
        + cells_of("load", 32, 32, kernel=30.0, staged=5.0, dma=2.0)
        + cells_of("load", 256, 16, kernel=20.0, staged=10.0, dma=50.0),
    )


# --- the pick --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "direction, blocks, runs, pick",
    [
        (STORE, 4, 4, "kernel"),
        (STORE, 3, 3, "kernel"),  # nearest: 4 blocks in 4 runs
        (STORE, 300, 300, "staged"),  # nearest: 256 random blocks
        (STORE, 256, 16, "dma"),
        (STORE, 200, 12, "dma"),  # nearest: 256 blocks in runs of 16 (the run length counts too)
        (STORE, 256, 1, "dma"),  # one long run: still nearer the runs cell than the random one
        (STORE, 0, 1, "kernel"),  # an empty call: the smallest cell
        (LOAD, 4, 4, "staged"),  # each direction has its own cells
        (LOAD, 40, 40, "kernel"),
        (LOAD, 64, 4, "dma"),  # nearest: runs of 16
        (LOAD, 1024, 1024, "kernel"),  # larger than any cell: the largest random one
    ],
    ids=[
        "store-4",
        "store-3",
        "store-300-random",
        "store-256-runs",
        "store-200-runs-of-17",
        "store-one-run",
        "store-empty",
        "load-4",
        "load-40-random",
        "load-64-runs",
        "load-1024-random",
    ],
)
def test_choose_picks_the_fastest_path_of_the_nearest_cell(direction, blocks, runs, pick):
    assert sample_crossover().choose(direction, blocks, runs, COPY_ENGINES) == pick


def test_choose_says_none_where_nothing_was_measured_and_only_considers_the_paths_it_is_given():
    assert Crossover(dict(KEY)).choose(STORE, 16, 16, COPY_ENGINES) is None
    only_loads = Crossover(dict(KEY), cells_of("load", 4, 4, kernel=5.0, staged=9.0, dma=1.0))
    assert only_loads.choose(STORE, 4, 4, COPY_ENGINES) is None
    x = sample_crossover()
    assert x.choose(STORE, 256, 16, {"kernel": False, "staged": True}) == "staged"  # dma (40) is not offered
    assert x.choose(STORE, 256, 16, {"kernel": False}) == "kernel"
    assert x.choose(STORE, 256, 16, {}) is None


@pytest.mark.parametrize(
    "rates, engines, pick",
    [
        (dict(kernel=100.0, staged=95.5, dma=90.0), COPY_ENGINES, "staged"),  # 4.5% slower: spares the SMs
        (dict(kernel=100.0, staged=94.5, dma=94.0), COPY_ENGINES, "kernel"),  # 5.5% slower: the kernel
        (dict(kernel=100.0, staged=96.0, dma=99.0), COPY_ENGINES, "dma"),  # the fastest copy-engine path
        (dict(kernel=100.0, staged=101.0, dma=50.0), COPY_ENGINES, "staged"),  # simply the fastest
        (dict(kernel=50.0, staged=100.0, dma=97.0), COPY_ENGINES, "staged"),
        (dict(kernel=100.0, staged=50.0, dma=97.0), {"kernel": False, "staged": True, "dma": False}, "kernel"),
        (dict(dma=99.0, staged=99.0, kernel=100.0), COPY_ENGINES, "staged"),  # a tie: the first in PATH_NAMES
    ],
    ids=[
        "staged-within-5pct",
        "staged-beyond-5pct",
        "fastest-of-two-within",
        "staged-fastest",
        "kernel-slowest",
        "dma-counted-as-kernel",
        "exact-tie",
    ],
)
def test_a_copy_engine_path_within_5_percent_of_the_fastest_wins(rates, engines, pick):
    assert TOLERANCE == 0.05
    x = Crossover(dict(KEY), cells_of("store", 32, 32, **rates))
    assert x.choose(STORE, 32, 32, engines) == pick


def test_a_call_alone_is_picked_by_the_single_call_rate_and_one_behind_others_by_the_sustained_rate():
    # The H200's shape of it: back to back the staged path moves more, but one flushed call
    # finishes sooner on the kernel path, whose host time is half the staged path's.
    cells = [
        Cell("kernel", "store", 16, 16, 50.0, 46.0),
        Cell("staged", "store", 16, 16, 53.0, 40.0),
        Cell("dma", "store", 16, 16, 30.0, 25.0),
    ]
    x = Crossover(dict(KEY), cells)
    assert x.choose(STORE, 16, 16, COPY_ENGINES) == "staged"
    assert x.choose(STORE, 16, 16, COPY_ENGINES, alone=True) == "kernel"
    assert x.pick(STORE, 16, lambda: 16, COPY_ENGINES, alone=True) == "kernel"
    assert x.pick(STORE, 16, lambda: 16, COPY_ENGINES) == "staged"  # each remembered apart
    assert x.pick(STORE, 16, lambda: 16, COPY_ENGINES, alone=True) == "kernel"
    # The copy-engine tolerance holds for the single rate too: staged within 5% of the kernel.
    near = Crossover(
        dict(KEY), [Cell("kernel", "store", 16, 16, 50.0, 42.0), Cell("staged", "store", 16, 16, 53.0, 40.0)]
    )
    assert near.choose(STORE, 16, 16, COPY_ENGINES, alone=True) == "staged"
    # A cell without a single rate (a hand-made one) decides by its sustained rate either way.
    old = Crossover(dict(KEY), cells_of("store", 16, 16, kernel=50.0, staged=53.0))
    assert old.choose(STORE, 16, 16, COPY_ENGINES, alone=True) == "staged"


def test_a_call_alone_takes_the_least_host_time_among_the_paths_near_the_fastest_single_rate():
    # The H200's shape of it: staged within 5% of the kernel's single rate, at 2-3x its host time.
    cells = [
        Cell("kernel", "store", 16, 16, 50.0, 50.2, 76.0),
        Cell("staged", "store", 16, 16, 52.6, 47.9, 217.0),
        Cell("dma", "store", 16, 16, 49.4, 38.5, 170.0),
    ]
    x = Crossover(dict(KEY), cells)
    assert x.choose(STORE, 16, 16, COPY_ENGINES) == "staged"  # behind others: the copy engines
    assert x.choose(STORE, 16, 16, COPY_ENGINES, alone=True) == "kernel"
    # Near the fastest, the least host time wins even where it is a little slower...
    slower = [Cell("kernel", "store", 16, 16, 50.0, 48.0, 30.0), Cell("staged", "store", 16, 16, 52.0, 50.0, 150.0)]
    assert Crossover(dict(KEY), slower).choose(STORE, 16, 16, COPY_ENGINES, alone=True) == "kernel"
    # ... but not beyond TOLERANCE: then the fastest single call wins, whatever its host time.
    beyond = [Cell("kernel", "store", 16, 16, 50.0, 46.0, 30.0), Cell("staged", "store", 16, 16, 52.0, 50.0, 150.0)]
    assert Crossover(dict(KEY), beyond).choose(STORE, 16, 16, COPY_ENGINES, alone=True) == "staged"
    # Equal host times: the path named first.
    tie = [Cell("staged", "store", 16, 16, 50.0, 50.0, 40.0), Cell("kernel", "store", 16, 16, 50.0, 50.0, 40.0)]
    assert Crossover(dict(KEY), tie).choose(STORE, 16, 16, COPY_ENGINES, alone=True) == "kernel"
    # The host time survives a save and a load, and the table shows it.
    assert "| store | 16 | 16 | 50.0 / 50.2, 76 us | 52.6 / 47.9, 217 us | 49.4 / 38.5, 170 us | staged / kernel |" in (
        x.table().splitlines()
    )
    assert "kernel GB/s, sustained / single, host" in x.table().splitlines()[0]


def test_a_kept_host_time_round_trips(tmp_path):
    file = tmp_path / "crossover.json"
    x = Crossover(dict(KEY), [Cell("kernel", "load", 4, 4, 9.0, 8.0, 12.5)])
    x.save(str(file))
    assert Crossover.load(str(file), dict(KEY)).cells == x.cells


def test_pick_counts_the_runs_only_where_they_change_the_choice():
    x = sample_crossover()

    def never():
        raise AssertionError("counted the runs of a call whose pick does not depend on them")

    assert x.pick(STORE, 4, never, COPY_ENGINES) == "kernel"
    assert x.pick(STORE, 4, never, COPY_ENGINES) == "kernel"  # remembered
    # 64 stores: random ids are nearest the 256-random cell (staged), runs of 16 the runs cell (dma).
    asked = []
    assert x.pick(STORE, 64, lambda: asked.append(64) or 64, COPY_ENGINES) == "staged"
    assert x.pick(STORE, 64, lambda: asked.append(4) or 4, COPY_ENGINES) == "dma"
    assert asked == [64, 4]
    # Beyond RUN_FREE_BLOCKS the runs are always counted.
    assert x.pick(LOAD, crossover_mod.RUN_FREE_BLOCKS + 1, lambda: asked.append("big") or 1, COPY_ENGINES) == "dma"
    assert asked[-1] == "big"


def test_planned_picks_are_the_lazy_ones_and_a_call_of_a_planned_size_makes_no_choice(monkeypatch):
    planned, lazy = sample_crossover(), sample_crossover()
    planned.plan_picks(COPY_ENGINES)
    sizes = range(crossover_mod.RUN_FREE_BLOCKS + 1)
    keys = [(d, b, alone) for d in (STORE, LOAD) for b in sizes for alone in (False, True)]
    assert set(planned._run_free) == set(keys)
    for d, b, alone in keys:
        # The lazy pick of a size, with a run count that its answer may depend on.
        lazy.pick(d, b, lambda b=b: max(1, b // 4), COPY_ENGINES, alone)
        assert planned._run_free[(d, b, alone)] == lazy._run_free[(d, b, alone)]
    assert "" in planned._run_free.values() and set(planned._run_free.values()) - {""}  # both kinds occur
    free = [k for k in keys if planned._run_free[k]]

    def no_choice(*a, **k):
        raise AssertionError("a choice at a call of a planned size that does not depend on the runs")

    monkeypatch.setattr(planned, "choose", no_choice)
    for d, b, alone in free:
        assert planned.pick(d, b, lambda: 1, COPY_ENGINES, alone) == planned._run_free[(d, b, alone)]
    for d, b, alone in set(keys) - set(free):  # the pick depends on the runs: each one planned
        for r in range(1, b + 1):
            assert planned.pick(d, b, lambda r=r: r, COPY_ENGINES, alone) == lazy.choose(d, b, r, COPY_ENGINES, alone)
    planned.plan_picks(COPY_ENGINES)  # again (engines of one shape share it): nothing to find


def test_above_the_planned_sizes_pick_keeps_each_choice_and_starts_over_when_full(monkeypatch):
    x = sample_crossover()
    n = crossover_mod.RUN_FREE_BLOCKS + 36
    assert x.pick(STORE, n, lambda: n, COPY_ENGINES) == "staged"  # random ids: chosen
    chosen = []
    monkeypatch.setattr(x, "choose", lambda *a, **k: chosen.append(a[:3]) or "kernel")
    assert x.pick(STORE, n, lambda: n, COPY_ENGINES) == "staged"  # kept: not chosen again
    assert x.pick(STORE, n, lambda: 4, COPY_ENGINES) == "kernel"  # another run count: chosen
    assert chosen == [(STORE, n, 4)]
    monkeypatch.setattr(crossover_mod, "CHOICES_KEPT", 2)
    for runs in (8, 16, 32):
        x.pick(STORE, n, lambda runs=runs: runs, COPY_ENGINES)
    assert len(x._chosen) <= 2 and chosen[-1] == (STORE, n, 32)


@settings(max_examples=60, deadline=None)
@given(
    rates=st.lists(st.floats(1.0, 100.0), min_size=9, max_size=9),
    direction=st.sampled_from([STORE, LOAD]),
    ids=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 200)), max_size=80, unique_by=lambda t: t[0]),
)
def test_pick_is_choose_with_the_calls_own_run_count(rates, direction, ids):
    cells = []
    for i, (blocks, runs) in enumerate([(4, 4), (32, 32), (64, 4)]):
        k, s_, d = rates[3 * i : 3 * i + 3]
        cells += cells_of(direction.value, blocks, runs, kernel=k, staged=s_, dma=d)
    x = Crossover(dict(KEY), cells)
    gpu = np.array([g for g, _ in ids], dtype=np.int64)
    host = np.array([h for _, h in ids], dtype=np.int64)
    runs = count_runs(gpu, host)
    assert x.pick(direction, len(ids), lambda: runs, COPY_ENGINES) == x.choose(direction, len(ids), runs, COPY_ENGINES)


def test_the_table_shows_every_cell_and_the_pick():
    x = sample_crossover()
    lines = x.table().splitlines()
    assert lines[0] == "| direction | blocks | runs | kernel GB/s | staged GB/s | dma GB/s | auto picks |"
    assert lines[2:] == [
        "| store | 4 | 4 | 10.0 | 3.0 | 2.0 | kernel |",
        "| store | 256 | 256 | 20.0 | 30.0 | 8.0 | staged |",
        "| store | 256 | 16 | 20.0 | 25.0 | 40.0 | dma |",
        "| load | 4 | 4 | 5.0 | 9.0 | 1.0 | staged |",
        "| load | 32 | 32 | 30.0 | 5.0 | 2.0 | kernel |",
        "| load | 256 | 16 | 20.0 | 10.0 | 50.0 | dma |",
    ]
    # With single-call rates: both rates per path, and both picks.
    both = Crossover(dict(KEY), [Cell("kernel", "load", 32, 2, 45.0, 41.5), Cell("staged", "load", 32, 2, 48.0, 30.25)])
    assert both.table().splitlines() == [
        "| direction | blocks | runs | kernel GB/s, sustained / single | staged GB/s, sustained / single "
        "| auto picks, in flight / alone |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
        "| load | 32 | 2 | 45.0 / 41.5 | 48.0 / 30.2 | staged / kernel |",
    ]
    # A path never measured has no column.
    only_two = Crossover(dict(KEY), cells_of("load", 8, 1, kernel=10.0, dma=9.6))
    assert only_two.table().splitlines()[2:] == ["| load | 8 | 1 | 10.0 | 9.6 | dma |"]
    assert "staged" not in only_two.table()


# --- the file --------------------------------------------------------------------------------------


def test_save_and_load_round_trip_the_cells_exactly(tmp_path):
    x = sample_crossover()
    x.cells.append(Cell("dma", "load", 32, 2, 1 / 3, 2 / 7))  # rates that need every digit
    file = str(tmp_path / "crossover.json")
    x.save(file)
    assert os.listdir(tmp_path) == ["crossover.json"]  # written through a temporary, renamed
    kept = Crossover.load(file, dict(KEY))
    assert kept == x and kept is not x
    for direction in Direction:
        for blocks, runs in [(1, 1), (4, 4), (64, 64), (256, 16), (1000, 2)]:
            assert kept.choose(direction, blocks, runs, COPY_ENGINES) == x.choose(direction, blocks, runs, COPY_ENGINES)
    x.cells[0] = Cell("kernel", "store", 4, 4, 99.0)
    x.save(file)  # replaces the file
    assert Crossover.load(file, dict(KEY)).cells[0].gbps == 99.0 and os.listdir(tmp_path) == ["crossover.json"]


@pytest.mark.parametrize(
    "change",
    [dict(device="NVIDIA A100-SXM4-80GB"), dict(widths=[256, 256]), dict(ring_bytes=2 << 20), dict(torch="2.14.0")],
    ids=["device", "widths", "ring", "torch"],
)
def test_a_file_measured_for_another_shape_or_device_is_not_used(tmp_path, change):
    file = str(tmp_path / "crossover.json")
    sample_crossover().save(file)
    assert Crossover.load(file, {**KEY, **change}) is None
    assert Crossover.load(file, dict(KEY)) is not None
    assert Crossover.load(str(tmp_path / "absent.json"), dict(KEY)) is None


CORRUPT = [
    pytest.param(b"", id="empty"),
    pytest.param(b"{", id="truncated-object"),
    pytest.param(b"not json", id="text"),
    pytest.param(b"\xff\xfe\x00garbage", id="binary"),
    pytest.param(json.dumps({"key": KEY}).encode(), id="no-cells"),
    pytest.param(json.dumps({"key": KEY, "cells": 5}).encode(), id="cells-not-a-list"),
    pytest.param(json.dumps({"key": KEY, "cells": [{"path": "kernel"}]}).encode(), id="cell-missing-fields"),
    pytest.param(json.dumps({"key": KEY, "cells": [[1, 2]]}).encode(), id="cell-not-an-object"),
    pytest.param(
        json.dumps(
            {"key": KEY, "cells": [dict(path="dma", direction="load", blocks=4, runs=4, gbps=1, extra=1)]}
        ).encode(),
        id="cell-unknown-field",
    ),
    # Valid JSON that is not an object.
    pytest.param(b"[]", id="json-list"),
    pytest.param(b"null", id="json-null"),
    # Cells that would break the per-call choice later (log of 0, an unknown path, no rate).
    *[
        pytest.param(
            json.dumps(
                {"key": KEY, "cells": [dict(dict(path="dma", direction="load", blocks=4, runs=4, gbps=1.5), **bad)]}
            ).encode(),
            id=name,
        )
        for name, bad in [
            ("zero-blocks", {"blocks": 0}),
            ("zero-runs", {"runs": 0}),
            ("float-blocks", {"blocks": 4.5}),
            ("unknown-path", {"path": "warp"}),
            ("unknown-direction", {"direction": "sideways"}),
            ("negative-rate", {"gbps": -1.0}),
            ("text-rate", {"gbps": "fast"}),
            ("zero-single-rate", {"single_gbps": 0.0}),
            ("text-single-rate", {"single_gbps": "fast"}),
            ("infinite-single-rate", {"single_gbps": float("inf")}),
            ("negative-host-time", {"single_gbps": 1.0, "host_us": -3.0}),
            ("text-host-time", {"single_gbps": 1.0, "host_us": "quick"}),
            ("nan-host-time", {"single_gbps": 1.0, "host_us": float("nan")}),
        ]
    ],
]


@pytest.mark.parametrize("content", CORRUPT)
def test_a_corrupt_file_is_ignored(tmp_path, content):
    file = tmp_path / "crossover.json"
    file.write_bytes(content)
    assert Crossover.load(str(file), dict(KEY)) is None


def test_a_file_cut_short_is_ignored(tmp_path):
    file = tmp_path / "crossover.json"
    sample_crossover().save(str(file))
    whole = file.read_bytes()
    file.write_bytes(whole[: len(whole) // 2])
    assert Crossover.load(str(file), dict(KEY)) is None


def test_crossover_measures_once_writes_the_file_and_then_reads_it(tmp_path, monkeypatch):
    # The GPU parts stubbed out: the device name in the key, and the measurement (counted).
    measured = []

    def fake_measured(device, widths, ring_bytes):
        measured.append((device, widths, ring_bytes))
        return Crossover({**KEY, "widths": list(widths)}, sample_crossover().cells)

    monkeypatch.setattr(crossover_mod, "shape_key", lambda device, widths, ring_bytes: {**KEY, "widths": list(widths)})
    monkeypatch.setattr(crossover_mod, "measured_once", fake_measured)
    device, file = torch.device("cuda", 0), str(tmp_path / "crossover.json")
    first = crossover_mod.crossover(device, [256, 256, 192], 1 << 20, file)
    assert measured == [(device, (256, 256, 192), 1 << 20)] and first == sample_crossover()
    written = os.stat(file).st_mtime_ns
    assert Crossover.load(file, dict(KEY)) == first
    again = crossover_mod.crossover(device, [256, 256, 192], 1 << 20, file)
    assert len(measured) == 1 and again == first  # read back, not measured
    assert os.stat(file).st_mtime_ns == written  # and not rewritten
    # Another shape: the file does not fit, so it is measured and the file now holds the new shape.
    other = crossover_mod.crossover(device, [512], 1 << 20, file)
    assert len(measured) == 2 and other.cells == first.cells
    assert Crossover.load(file, {**KEY, "widths": [512]}) is not None and Crossover.load(file, dict(KEY)) is None
    # No file named: measured (this process's cache is the stub's business), nothing written.
    crossover_mod.crossover(device, [256, 256, 192], 1 << 20)
    assert len(measured) == 3 and os.listdir(tmp_path) == ["crossover.json"]


def random_crossover(seed):
    gen = torch.Generator().manual_seed(seed)
    rates = (1 + 99 * torch.rand(4, generator=gen)).tolist()
    return Crossover(
        dict(KEY),
        [
            Cell(p, d, 32, 2, r)
            for (p, d), r in zip([("kernel", "store"), ("staged", "store"), ("kernel", "load"), ("dma", "load")], rates)
        ],
    )


@pytest.mark.parametrize("where", ["a directory", "a missing directory"])
def test_crossover_refuses_a_file_that_cannot_be_written_before_measuring(tmp_path, monkeypatch, where):
    # The write came after the measurement: its result lost, a "<name>.<pid>.tmp" left behind.
    monkeypatch.setattr(crossover_mod, "measured_once", lambda *a: pytest.fail("measured"))
    target = tmp_path / "adir"
    target.mkdir()
    if where == "a directory":
        file, message = target, f"crossover: crossover_file {str(target)!r} is a directory; name a JSON file"
    else:
        file = tmp_path / "missing" / "x.json"
        message = f"crossover: crossover_file {str(file)!r} is in {str(file.parent)!r}, which is not a directory"
    with pytest.raises(ValueError) as info:
        crossover_mod.crossover(torch.device("cuda", 0), [256, 256, 192], 1 << 20, str(file))
    assert str(info.value).startswith(message)
    assert os.listdir(tmp_path) == ["adir"] and os.listdir(target) == []


@pytest.mark.parametrize("file", [True, 3, ""], ids=repr)
def test_crossover_refuses_what_is_not_a_path(file, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # True was a file name: "True.<pid>.tmp" here
    monkeypatch.setattr(crossover_mod, "measured_once", lambda *a: pytest.fail("measured"))
    with pytest.raises(ValueError, match=r"^crossover: crossover_file must be a path"):
        crossover_mod.crossover(torch.device("cuda", 0), [256], 1 << 20, file)
    with pytest.raises(ValueError, match=r"^Crossover.save: path must be a path"):
        random_crossover(1).save(file)
    assert os.listdir(tmp_path) == []


def test_a_save_whose_rename_fails_leaves_no_temporary_file(tmp_path):
    """The real write, onto a directory: the temporary file is written beside it, and the rename
    over the directory fails; the temporary file goes with the error."""
    target = tmp_path / "adir"
    target.mkdir()
    with pytest.raises(IsADirectoryError):
        random_crossover(2).save(str(target))
    assert os.listdir(tmp_path) == ["adir"] and os.listdir(target) == []
    x = random_crossover(3)
    x.save(str(tmp_path / "ok.json"))  # the same function still writes where it can
    assert Crossover.load(str(tmp_path / "ok.json"), dict(KEY)) == x and sorted(os.listdir(tmp_path)) == [
        "adir",
        "ok.json",
    ]


@pytest.mark.parametrize("where", ["a directory", "a missing directory"])
def test_an_engine_refuses_a_crossover_file_that_cannot_be_written_before_allocating(tmp_path, where):
    file = tmp_path if where == "a directory" else tmp_path / "missing" / "x.json"
    kv = {"attn0": torch.randint(0, 256, (2, 8, 2, 2, 32), dtype=torch.uint8).view(torch.bfloat16)}
    with pytest.raises(ValueError, match=rf"^OffloadEngine: crossover_file {re.escape(repr(str(file)))} is "):
        kv_ops.OffloadEngine(kv, 8, 8 * 256, path="auto", crossover_file=str(file))
    assert os.listdir(tmp_path) == []


# --- an auto engine follows its crossover per call --------------------------------------------------


def test_an_auto_engine_follows_its_crossover_call_by_call_on_every_path():
    """On the CPU an auto engine measures nothing; given the sample crossover, small stores go to
    the kernel, large random ones to the staged path, runs to DMA; small loads to the staged path,
    larger random ones to the kernel, runs to DMA. The counts follow choose() after every call,
    and every byte arrives."""
    gen = torch.Generator().manual_seed(21)
    nb, hosts = 300, 300
    kv = {
        "attn0": torch.randint(0, 256, (2, nb, 2, 2, 32), dtype=torch.uint8, generator=gen).view(torch.bfloat16),
        "mla1": torch.randint(0, 256, (nb, 2, 48), dtype=torch.uint8, generator=gen).view(torch.float16),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA: pinned_empty warns that it returns plain memory
        engine = kv_ops.OffloadEngine(kv, nb, hosts * 352, path="auto", ring_bytes=4 * 16 * 352)
    assert engine.crossover is None and engine.block_bytes == 352
    engine.crossover = sample_crossover()
    engine.mirror.copy_(torch.randint(0, 256, engine.mirror.shape, dtype=torch.uint8, generator=gen))
    mirror = engine.mirror.clone()
    cache = torch.cat(list(engine.regions.values()), dim=1).clone()

    def runs_of(count, length, limit):
        starts = torch.randperm(limit // length, generator=gen)[: count // length] * length
        return (starts[:, None] + torch.arange(length)).flatten()

    calls = [
        (STORE, torch.randperm(nb, generator=gen)[:3], torch.randperm(hosts, generator=gen)[:3], "kernel"),
        (STORE, torch.randperm(nb, generator=gen)[:250], torch.randperm(hosts, generator=gen)[:250], "staged"),
        (STORE, runs_of(240, 16, nb), runs_of(240, 16, hosts), "dma"),
        (LOAD, torch.randperm(nb, generator=gen)[:5], torch.randperm(hosts, generator=gen)[:5], "staged"),
        (STORE, torch.randperm(nb, generator=gen)[:4], torch.randperm(hosts, generator=gen)[:4], "kernel"),
        (LOAD, runs_of(64, 16, nb), runs_of(64, 16, hosts), "dma"),
        (LOAD, torch.randperm(nb, generator=gen)[:40], torch.randperm(hosts, generator=gen)[:40], "kernel"),
    ]
    expected = dict.fromkeys(COPY_ENGINES, 0)
    for direction, gpu_ids, host_ids, pick in calls:
        blocks = Blocks.of(direction, gpu_ids, host_ids)
        assert engine.crossover.choose(direction, blocks.count, blocks.num_runs, COPY_ENGINES) == pick
        expected[pick] += 1
        if direction is STORE:
            tid = engine.store(gpu_ids, host_ids)
            mirror[host_ids] = cache[gpu_ids]
            assert engine.flush().stores == [tid]
        else:
            tid = engine.load(host_ids, gpu_ids)
            cache[gpu_ids] = mirror[host_ids]
            assert engine.flush().loads == [tid]
        assert engine.path_counts == expected, pick
        assert torch.equal(engine.mirror, mirror), pick
        assert torch.equal(torch.cat(list(engine.regions.values()), dim=1), cache), pick


# --- on the GPU ------------------------------------------------------------------------------------


@gpu
def test_a_measurement_covers_every_cell_with_plausible_rates():
    # How long the sweep takes is a benchmark figure (printed below; docs/measurements.md), not a
    # bound: a loaded host stretches it with no bug to find.
    device = torch.device("cuda", torch.cuda.current_device())
    widths, ring = [4096, 4096, 1024], 1 << 20
    measure(device, widths, ring)  # warm-up: the kernels' first compile, the rings, pinned memory
    start = time.perf_counter()
    x = measure(device, widths, ring)
    elapsed = time.perf_counter() - start
    assert x.key == shape_key(device, widths, ring)
    want = sorted(
        (path, direction, blocks, runs)
        for path in COPY_ENGINES
        for direction in ("store", "load")
        for blocks in COUNTS  # 9 KiB rows: no count is capped
        for runs in {blocks, max(1, blocks // RUN)}
    )
    assert sorted((c.path, c.direction, c.blocks, c.runs) for c in x.cells) == want  # each cell once
    row_bytes = sum(widths)
    for c in x.cells:
        assert 0.01 < c.gbps < 200 and 0.01 < c.single_gbps < 200, c
        # The host time is a part of the single call: positive, and at most the call's duration.
        assert 0 < c.host_us * 1e3 <= c.blocks * row_bytes / c.single_gbps, c
        # One call includes its host time and its launch latency: with few descriptors it is never
        # faster than a stream of them by more than the noise of a few calls. With many it can be
        # (the H200 once measured a staged store of 256 scattered 9 KiB rows at 6.1 GB/s alone and
        # 4.1 GB/s in a stream of 4): a stream queues 1024 copies behind each other, a single call
        # 256 on idle engines.
        if c.runs * CALLS <= 128:
            assert c.single_gbps < 1.5 * c.gbps, c
    picks = {x.choose(Direction(c.direction), c.blocks, c.runs, COPY_ENGINES) for c in x.cells}
    assert picks <= set(COPY_ENGINES)
    print(x.table())
    print(f"the measurement took {elapsed:.2f} s")


@gpu
def test_an_auto_engine_keeps_its_crossover_in_a_file_that_a_second_engine_reads(tmp_path, monkeypatch):
    gen = torch.Generator().manual_seed(5)
    kv = {
        "attn0": torch.randint(0, 256, (2, 32, 4, 2, 32), dtype=torch.uint8, generator=gen).cuda().view(torch.bfloat16),
        "mla1": torch.randint(0, 256, (32, 4, 48), dtype=torch.uint8, generator=gen).cuda().view(torch.float16),
    }
    file = str(tmp_path / "crossover.json")

    def auto_engine():
        return kv_ops.OffloadEngine(kv, 32, 40 * 704, path="auto", crossover_file=file)

    first = auto_engine()
    key = shape_key(first.device, [256, 256, 192], kv_ops.transfer.engine.RING_BYTES)
    assert first.crossover.key == key and len(first.crossover.cells) > 0
    assert Crossover.load(file, key) == first.crossover  # written, for this shape
    written = os.stat(file).st_mtime_ns

    def refuse(*args):
        raise AssertionError("measured although the file holds this shape's crossover")

    monkeypatch.setattr(crossover_mod, "measured_once", refuse)
    second = auto_engine()
    assert second.crossover.cells == first.crossover.cells
    assert os.stat(file).st_mtime_ns == written and os.listdir(tmp_path) == ["crossover.json"]

    # What the file says is what the engine does: made-up cells in which only DMA was measured.
    made_up = Crossover(key, [Cell("dma", d, 4, 4, 1.0) for d in ("store", "load")])
    made_up.save(file)
    third = auto_engine()
    assert third.crossover == made_up
    want = torch.cat([r[[1, 2, 3]].cpu() for r in third.regions.values()], dim=1)
    third.store([1, 2, 3], [7, 8, 9])
    third.flush()
    assert third.path_counts == {"kernel": 0, "staged": 0, "dma": 1}
    assert torch.equal(third.mirror[7:10], want)
    for engine in (first, second, third):
        engine.close()


@gpu
def test_an_auto_engine_picks_by_the_single_rate_when_alone_and_by_the_sustained_rate_behind_others():
    gen = torch.Generator().manual_seed(8)
    kv = {"l0": torch.randint(0, 256, (2, 32, 4, 2, 32), dtype=torch.uint8, generator=gen).cuda().view(torch.bfloat16)}
    engine = kv_ops.OffloadEngine(kv, 32, 40 * 1024, path="auto")
    # Made-up cells for this shape: back to back staged is faster, alone the kernel.
    engine.crossover = Crossover(
        engine.crossover.key,
        [
            Cell(p, d, 4, 4, sustained, single)
            for d in ("store", "load")
            for p, sustained, single in [("kernel", 10.0, 9.0), ("staged", 12.0, 5.0), ("dma", 1.0, 1.0)]
        ],
    )
    cache = torch.cat([r.cpu() for r in engine.regions.values()], dim=1)
    engine.store([1, 2], [3, 4])
    engine.flush()
    assert engine.path_counts == {"kernel": 1, "staged": 0, "dma": 0}  # alone
    torch.cuda._sleep(200_000_000)  # the next store waits behind it: in flight
    engine.store([5, 6], [7, 8])
    engine.store([9, 10], [11, 12])  # behind the one in flight
    assert engine.path_counts == {"kernel": 2, "staged": 1, "dma": 0}
    engine.flush()
    engine.load([3, 4], [20, 21])  # alone again
    engine.flush()
    assert engine.path_counts == {"kernel": 3, "staged": 1, "dma": 0}
    for host, gpu_ids in (([3, 4], [1, 2]), ([7, 8], [5, 6]), ([11, 12], [9, 10])):
        assert torch.equal(engine.mirror[host], cache[gpu_ids])
    got = torch.cat([r.cpu() for r in engine.regions.values()], dim=1)
    assert torch.equal(got[[20, 21]], cache[[1, 2]])
    engine.close()


@gpu
def test_an_auto_engine_plans_its_picks_at_construction():
    # Found at each size's first call, they cost that call up to 64 choices (0.1-0.3 ms).
    kv = {"l0": torch.randn(2, 80, 4, 2, 32, device="cuda").bfloat16()}
    engine = kv_ops.OffloadEngine(kv, 80, 80 * 2 * 4 * 2 * 32 * 2, path="auto")
    sizes = range(crossover_mod.RUN_FREE_BLOCKS + 1)
    assert {(d, b, a) for d in (STORE, LOAD) for b in sizes for a in (False, True)} <= set(engine.crossover._run_free)
    made = []
    choose = engine.crossover.choose
    engine.crossover.choose = lambda *a, **k: made.append(a[1]) or choose(*a, **k)
    try:
        for n in (3, 10, 16, 37):  # sizes not called before: planned, so no call makes a choice
            engine.store(list(range(n)), list(range(40, 40 + n)))
            engine.flush()
        assert made == []
    finally:
        del engine.crossover.choose  # the crossover is shared by engines of this shape
        engine.close()
