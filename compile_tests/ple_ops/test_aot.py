"""AOT reload: process A compiles the decode step ahead of time and saves it; process B starts
fresh, with its own offload process and its own (shifted) addresses, loads the artifact and must
get the eager result. The same harness shows the raw-pointer design failing."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def run(*args, check=True):
    # Run as a module from the repository root, so that the root (the packages) precedes tests/
    # (the harness's helpers) on sys.path: tests/ple_ops must not shadow the ple_ops package.
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    )
    cmd = [sys.executable, "-m", "ple_aot_harness", *args]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if check and result.returncode != 0:
        raise AssertionError(f"{args[0]} failed ({result.returncode}):\n{result.stdout}\n{result.stderr[-4000:]}")
    return result


def addresses(output: str) -> str:
    return next(line for line in output.splitlines() if line.startswith("slot addresses:"))


@pytest.mark.parametrize("device", DEVICES)
def test_artifact_loaded_in_a_fresh_process_gives_the_eager_result(tmp_path, device):
    path = str(tmp_path / "step.aot")
    saved = run("save", path, "name", device)
    loaded = run("load", path, "name", device)
    assert addresses(saved.stdout) != addresses(loaded.stdout)  # B's slots live elsewhere
    assert "MATCH" in loaded.stdout.splitlines(), loaded.stdout


def test_raw_pointer_arguments_are_baked_into_the_artifact_and_fail_in_the_loader(tmp_path):
    path = str(tmp_path / "raw.aot")
    saved = run("save", path, "raw", "cpu")
    loaded = run("load", path, "raw", "cpu", check=False)
    baked = addresses(saved.stdout).split(":", 1)[1].strip(" []").split(", ")[0].strip("'")
    assert loaded.returncode != 0
    assert f"slot address {baked} is not armed in this process" in loaded.stderr, loaded.stderr[-3000:]
