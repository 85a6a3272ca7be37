"""AOT reload: process A compiles a store+load step ahead of time and saves it; process B starts
fresh with other tensors holding other bytes, loads it, and the bytes must move as the reference
moves them on B's tensors (nothing from A may be baked into the artifact)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def run(*args):
    # Run as a module from the repository root, so the packages precede tests/ on sys.path.
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    )
    result = subprocess.run(
        [sys.executable, "-m", "kv_aot_harness", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"{args[0]} failed ({result.returncode}):\n{result.stdout}\n{result.stderr[-4000:]}"
    return result.stdout


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_step_loaded_in_a_fresh_process_moves_that_process_bytes(tmp_path, device):
    path = str(tmp_path / "kv_step.aot")
    run("save", path, device)
    loaded = run("load", path, device)
    assert "MATCH" in loaded.splitlines(), loaded
