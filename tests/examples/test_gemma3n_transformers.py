"""examples/gemma3n_transformers.py's tiny configuration on the CPU, in a subprocess: stock
transformers Gemma 3n, compiled generate() with a static cache, stock and with its per-layer
table served by ple_ops.host_embedding; the tokens must be identical."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")  # the hf extra (.ci/env.sh installs it)

ROOT = Path(__file__).resolve().parents[2]


def test_gemma3n_generate_gives_the_same_tokens_with_the_table_in_host_memory():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "examples/gemma3n_transformers.py", "--config", "tiny", "--device", "cpu"]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=800)
    out = result.stdout
    assert result.returncode == 0, f"{out}\n{result.stderr[-4000:]}"
    assert out.splitlines()[0].startswith("Gemma3nForCausalLM (tiny: hidden 64, 2 layers, PLE 24"), out
    assert out.splitlines()[-1].startswith("gemma3n transformers: tokens match"), out
    assert "| in the model (stock) |" in out and "| page-locked host (host_embedding) |" in out, out


@pytest.mark.parametrize(
    "args, named",
    [
        (["--repeats", "0"], "--repeats"),
        (["--new-tokens", "1"], "--new-tokens"),
        (["--batch", "-2"], "--batch"),
        (["--prompt-len", "x"], "--prompt-len"),
        (["--device", "nonsense"], "--device"),
        (["--model", "gemma2"], "--model"),
    ],
)
def test_bad_arguments_are_refused_by_name_before_any_model_is_built(args, named):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "examples/gemma3n_transformers.py", "--config", "tiny", *args]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert named in result.stderr and "Gemma3nForCausalLM" not in result.stdout, result.stderr
