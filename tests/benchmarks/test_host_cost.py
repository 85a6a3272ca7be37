"""benchmarks/host_cost.py's smoke test: its tiny CPU configuration, run as CI runs scripts, in a
subprocess (the PLE rows spawn an offload process, which imports the script as its main module)."""

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CALLS = (
    "copy_blocks",
    "gather_blocks",
    "scatter_blocks",
    "store",
    "load",
    "poll",
    "flush",
    "prepare",
    "forward",
    "release",
)


def test_host_cost_quick_on_the_cpu_writes_every_call(tmp_path):
    # CUDA hidden: the CPU configuration (seconds) wherever the suite runs.
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        CUDA_VISIBLE_DEVICES="",
    )
    cmd = [sys.executable, "benchmarks/host_cost.py", "--quick", "--out", str(tmp_path)]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = result.stdout
    assert result.returncode == 0, f"{out[-4000:]}\n{result.stderr[-4000:]}"

    with open(tmp_path / "host_cost.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for call in CALLS:
        measured = [r for r in rows if r["call"] == call and r["status"] == "ok"]
        assert measured, f"no measured row for {call}"
        for r in measured:
            for key in ("host_p50_us", "host_p90_us"):
                value = float(r[key])
                assert math.isfinite(value) and value > 0, (call, key, r)
            assert float(r["host_p90_us"]) >= float(r["host_p50_us"]), r
    # Every engine path ran, and each transfer row sits beside its same-run baselines.
    assert {r["path"] for r in rows if r["call"] == "store"} == {"kernel", "staged", "dma", "auto"}
    for r in rows:
        if r["call"] in ("store", "load", "copy_blocks") and r["status"] == "ok" and not r["regime"]:
            assert float(r["copy_host_p50_us"]) > 0 and float(r["torch_host_p50_us"]) > 0, r
            # The floor's call-to-done over the row's, to the CSV's 4 digits (a loaded host can make
            # it round to 0).
            bw = float(r["copy_done_p50_us"]) / float(r["done_p50_us"])
            assert math.isclose(float(r["bw_vs_copy"]), bw, rel_tol=1e-3, abs_tol=1e-4), r
        if r["call"] in ("store", "load") and r["status"] == "ok":
            # ... and beside the floor timed right before each of its calls (regimes included).
            paired = float(r["paired_copy_host_p50_us"])
            assert paired > 0 and math.isclose(
                float(r["host_vs_paired_copy"]), float(r["host_p50_us"]) / paired, rel_tol=1e-3, abs_tol=1e-4
            ), r  # the CSV keeps 4 digits

    # The regime rows (on the CPU: after a host sweep), each engine's with its own floor.
    for path in ("kernel", "staged", "dma", "auto"):
        for direction in ("store", "load"):
            regime = [
                r for r in rows if (r["call"], r["path"], r["ids"]) == (direction, path, "list, after a host sweep")
            ]
            assert len(regime) == 4 and all(r["status"] == "ok" for r in regime), (path, direction, regime)
            for r in regime:
                assert r["regime"] == "list, after a host sweep", r
                assert float(r["host_vs_copy"]) > 0 and not r["torch_host_p50_us"], r
            floors = [r for r in rows if (r["call"], r["path"], r["ids"]) == ("copy_", path, r["regime"])]
            assert {int(f["blocks"]) for f in floors if f["dir"] == direction} == {1, 4, 16, 64}, floors

    table = (tmp_path / "host_cost.md").read_text()
    assert table.startswith("# Host cost per call"), table[:200]
    assert "| call | path | dir | ids | checks | blocks | host p50 us | host p90 us | call-to-done us |" in table
    assert "| host p50 / copy_ | host p50 / copy_ just before |" in table
    assert "# Host cost per call" in out  # printed too


def test_an_engine_row_is_divided_by_the_floor_measured_at_its_engine():
    # The host's speed can drift within a run: an engine's rows take the copy_ floor measured next
    # to them, the others the run's.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import host_cost

    def row(call, path, host, done=None):
        return dict(
            call=call,
            path=path,
            family="kv",
            dir="store",
            bytes=1 << 20,
            status="ok",
            host_p50_us=host,
            done_p50_us=done,
        )

    rows = [
        row("copy_", "-", 7.0, 30.0),
        row("copy_", "kernel", 14.0, 31.0),
        row("store", "kernel", 42.0, 62.0),
        row("store", "staged", 70.0, 60.0),  # no floor at its engine: the run's
        row("copy_blocks", "-", 49.0, 70.0),
        row("copy_", "kernel", 20.0, 40.0) | dict(regime="cold"),  # a regime's floor, at its engine
        row("store", "kernel", 100.0, 80.0) | dict(regime="cold"),
    ]
    host_cost.add_baselines(rows)
    kernel, staged, op, cold = rows[2], rows[3], rows[4], rows[6]
    assert cold["copy_host_p50_us"] == 20.0 and cold["host_vs_copy"] == 5.0 and cold["bw_vs_copy"] == 0.5
    assert kernel["copy_host_p50_us"] == 14.0 and kernel["host_vs_copy"] == 3.0
    assert kernel["bw_vs_copy"] == 31.0 / 62.0
    assert staged["copy_host_p50_us"] == 7.0 and staged["host_vs_copy"] == 10.0
    assert op["copy_host_p50_us"] == 7.0 and op["host_vs_copy"] == 7.0
