"""The main job, as CI runs it: examples/decode_loop.py's small configuration on the CPU, in a
subprocess (it spawns an offload process and a second process that loads the AOT artifact),
with the disk tier: preempted sequences are stored and resumed ones loaded by the step itself
(each step planned and staged while the step before runs), come back layer by layer from host memory, and by load, flush, then step from host memory and
from disk."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_decode_loop_matches_with_preemption_and_aot_reload(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "examples/decode_loop.py", "--config", "small", "--disk", str(tmp_path)]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = result.stdout
    assert result.returncode == 0, f"{out}\n{result.stderr[-4000:]}"
    assert out.splitlines()[-1] == "decode loop: tokens match", out
    blocks = r"KV pressure \(\d+ of \d+ blocks, "
    # The step stored the preempted blocks and loaded the resumed ones itself (StepTransfers):
    # no engine path moved them, and every row of that run is bitwise equal to the run without
    # pressure (a resumed sequence reads its loaded blocks: a load that did not happen shows).
    in_step = re.search(
        blocks + r"host memory, resume step\): (\d+) preemptions, (\d+) resumptions, 0 layer-wise loads, "
        r"every logits row bitwise equal",
        out,
    )
    assert in_step and int(in_step.group(1)) >= 1 and int(in_step.group(2)) >= 1, out
    staged = re.search(
        r"^KV pressure, host memory, resume step: .*stored ([\d.]+) KiB and loaded ([\d.]+) KiB by the steps "
        r"themselves \(kv_ops.StepTransfers\); per stage, median \(max\) of (\d+): [\d.]+ \([\d.]+\) us of host "
        r"time, while the step before ran$",
        out,
        re.MULTILINE,
    )
    assert staged and float(staged.group(1)) > 0 and float(staged.group(2)) > 0 and int(staged.group(3)) >= 2, out
    for direction, done in [("store", "stored"), ("load", "loaded")]:
        line = (
            rf"^  steps that {done} only \(\d+\): .* from the launch to the step's end, .* {direction} at [\d.]+ GB/s$"
        )
        assert re.search(line, out, re.MULTILINE), out
    # Preemption happened in host memory, and the resumed blocks came back layer by layer (one
    # LayerwiseLoads.start per resumed step, each reported as the engine's "layerwise" path),
    # every row of that run bitwise equal to the run without pressure.
    layerwise = re.search(
        blocks + r"host memory, resume layerwise\): (\d+) preemptions, (\d+) resumptions, (\d+) layer-wise loads, "
        r"every logits row bitwise equal",
        out,
    )
    assert layerwise and int(layerwise.group(1)) >= 1 and int(layerwise.group(2)) >= 1, out
    assert 1 <= int(layerwise.group(3)) <= int(layerwise.group(2)), out
    # The same workload by load, flush, then step (the comparison), and through the disk tier,
    # which has no layer-wise path: both bitwise equal, neither used it.
    for tier in ["host memory", "disk"]:
        flushed = re.search(
            blocks + tier + r", resume flush\): (\d+) preemptions, \d+ resumptions, 0 layer-wise loads, "
            r"every logits row bitwise equal",
            out,
        )
        assert flushed and int(flushed.group(1)) >= 1, out
    # Every layer's wait ran at every host run of the compiled step (on the CPU every step runs
    # it), in this process and in the one that loaded the AOT artifact.
    waits = re.findall(r"layer-wise waits: every layer's wait ran at each of the step's (\d+) host runs", out)
    assert len(waits) == 2 and all(int(n) > 10 for n in waits), out
    # Process B loaded the saved step, made its own StepTransfers and LayerwiseLoads of the names,
    # preempted and resumed by the step's own transfers, then through the disk tier, and
    # reproduced every logits row.
    for tier, mode, loads in [("host memory", "step", "0"), ("disk", "flush", "0")]:
        reloaded = re.search(
            rf"AOT reload in a fresh process \({tier}, resume {mode}\): (\d+) logits rows bitwise equal, (\d+) "
            rf"preemptions, {loads} layer-wise loads, tokens match",
            out,
        )
        assert reloaded and int(reloaded.group(1)) > 100 and int(reloaded.group(2)) >= 1, out
    # The report compares the resume steps, each row timed over at least one resumed step.
    for label in ["staged, loaded by the step itself", "layer-wise loads, then the step", "load, flush, then the step"]:
        row = re.search(rf"^\| {label} \| (\d+) \| \d+ \| \d+ \| [\d.]+ \|$", out, re.MULTILINE)
        assert row and int(row.group(1)) >= 1, out
    # Each pressure run counts the preemptions whose host blocks were one run (kv_ops.HostBlockAllocator).
    # This workload's host side has room for every block of it, so each preempted sequence got one.
    runs = re.findall(
        r"^KV pressure, .*: (\d+) preemptions \((\d+) stored to one run of host blocks\)", out, re.MULTILINE
    )
    assert len(runs) == len(re.findall(r"^KV pressure, ", out, re.MULTILINE)) >= 2, out
    assert all(int(n) >= 1 and single == n for n, single in runs), out
    # Every pressure run's stores were replayed back to back on its engine, WARM_REPEATS times
    # each, as the in-loop stores' same-run baseline (the step's own stores have no call to compare).
    replays = re.findall(
        r"the same (\d+) stores replayed back to back on this engine after the run \((\d+) calls\): .* "
        r"([\d.]+)x the replayed median",
        out,
    )
    assert len(replays) == len(re.findall(r"^KV pressure, .*resume (?!step)", out, re.MULTILINE)) >= 2, out
    assert all(int(calls) == 10 * int(n) >= 10 and float(x) > 0 for n, calls, x in replays), out
    # Both transports ran against the model that holds its table.
    assert "| offload process |" in out and "| host gather |" in out, out
    # ... and the table in the model and the first transport (the offload process) decoded the
    # workload in turn, 3 rounds each (tokens checked: a difference is a MISMATCH), each round's
    # ratio reported: the same workload three times each, so as many steps, a multiple of 3.
    assert "decoding in turn, 3 rounds each" in out, out
    in_turn, steps = out[out.index("decoding in turn") :], {}
    for label in ["in the model", "offload process"]:
        row = re.search(rf"^\| {label} \| (\d+) \| \d+ \| ([\d.]+) \| (.*) \|$", in_turn, re.MULTILINE)
        assert row, out
        steps[label] = int(row.group(1))
        if label == "in the model":
            assert row.group(2) == "1.000" and row.group(3) == "-", out
        else:
            assert len(row.group(3).split(" / ")) == 3 and float(row.group(2)) > 0, out
    assert steps["in the model"] == steps["offload process"] > 0 and steps["in the model"] % 3 == 0, out
    assert "MISMATCH" not in out, out
    assert list(tmp_path.iterdir()) == []  # the disk tier left nothing behind


def test_a_disk_that_is_no_directory_is_a_usage_error_before_any_work(tmp_path):
    # The engine that would refuse it is built only after every transport is compiled and captured.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    a_file = tmp_path / "a_file"
    a_file.write_bytes(os.urandom(64))
    for disk, why in [(tmp_path / "missing", "does not exist"), (a_file, "is not a directory")]:
        cmd = [sys.executable, "examples/decode_loop.py", "--config", "small", "--disk", str(disk)]
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 2, result.stdout + result.stderr
        assert result.stdout == "" and "Traceback" not in result.stderr, result.stdout + result.stderr
        assert f"error: argument --disk: {str(disk)!r} {why}" in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
