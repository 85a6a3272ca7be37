"""examples/gemma4_transformers.py's tiny configuration on the CPU, in a subprocess: stock
transformers Gemma 4, compiled generate() with a static cache, stock and with its per-layer table
served by ple_ops.host_embedding through the model's own accessors; the tokens must be identical."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("transformers.models.gemma4", reason="this transformers release has no Gemma 4")

ROOT = Path(__file__).resolve().parents[2]


def run(args, timeout):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "examples/gemma4_transformers.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_gemma4_generate_gives_the_same_tokens_with_the_table_in_host_memory():
    result = run(["--config", "tiny", "--device", "cpu"], timeout=800)
    out = result.stdout
    assert result.returncode == 0, f"{out}\n{result.stderr[-4000:]}"
    assert out.splitlines()[0].startswith("Gemma4ForCausalLM (tiny: hidden 64, 4 layers, PLE 24"), out
    assert "per-layer table: [512, 96] torch.float32" in out, out
    assert "| in the model (stock) |" in out and "| page-locked host (host_embedding) |" in out, out
    assert out.splitlines()[-1] == "gemma4 transformers: tokens match (24 tokens)", out


@pytest.mark.parametrize(
    "args, named",
    [(["--model", "gemma5"], "--model"), (["--config", "e4b"], "--config"), (["--new-tokens", "1"], "--new-tokens")],
)
def test_bad_arguments_are_refused_by_name_before_any_model_is_built(args, named):
    result = run(["--config", "tiny", *args], timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert named in result.stderr and "ForCausalLM" not in result.stdout, result.stderr
