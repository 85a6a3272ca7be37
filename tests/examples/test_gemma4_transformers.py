"""examples/gemma4_transformers.py's tiny configuration on the CPU, in a subprocess: stock
transformers Gemma 4, compiled generate() with a static cache, then with its per-layer table
served by ple_ops.host_embedding through the model's own accessors, with a static cache and with
kv_ops's HostOffloadedCache streaming two of its three full-attention layers; the tokens must
be identical and the memory lines present."""

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("transformers.models.gemma4", reason="this transformers release has no Gemma 4")

ROOT = Path(__file__).resolve().parents[2]


def run(args, timeout):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "examples/gemma4_transformers.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def mib(pattern: str, out: str) -> float:
    found = re.search(pattern, out)
    assert found, f"{pattern!r} not in\n{out}"
    return float(found.group(1))


def test_gemma4_generate_gives_the_same_tokens_with_the_table_and_the_kv_cache_in_host_memory():
    result = run(["--config", "tiny", "--device", "cpu"], timeout=800)
    out = result.stdout
    assert result.returncode == 0, f"{out}\n{result.stderr[-4000:]}"
    assert out.splitlines()[0].startswith("Gemma4ForCausalLM (tiny: hidden 64, 8 layers, PLE 24"), out
    assert "per-layer table: [512, 192] torch.float32" in out, out
    # Three full-attention layers own a cache (the last two layers reuse earlier ones'); a budget
    # of two keeps the first and streams the other two through one shared slot.
    assert (
        "full-attention KV: layers [1, 3, 5] own a cache; HostOffloadedCache keeps [1] on the cpu and streams [3, 5]"
        in out
    )
    static = mib(r"StaticCache holds ([0-9.]+) MiB", out)
    offloaded = mib(r"HostOffloadedCache ([0-9.]+) MiB\n", out)
    freed = mib(r"memory freed by HostOffloadedCache: ([0-9.]+) MiB", out)
    assert 0 < offloaded < static and freed == pytest.approx(static - offloaded, abs=0.002), out
    assert mib(r"streamed per decode step at a run's end: ([0-9.]+) MiB host to", out) > 0, out
    for row in ("| in the model (stock) | StaticCache |", "| page-locked host (host_embedding) | StaticCache |"):
        assert row in out, out
    assert "| page-locked host (host_embedding) | HostOffloadedCache |" in out, out
    assert out.splitlines()[-1] == "gemma4 transformers: tokens match (24 tokens)", out


@pytest.mark.parametrize(
    "args, named",
    [
        (["--config", "e4b"], "--config"),
        (["--new-tokens", "1"], "--new-tokens"),
        (["--kv-layers", "1"], "--kv-layers"),
        (["--max-cache-len", "20"], "--max-cache-len"),
    ],
)
def test_bad_arguments_are_refused_by_name_before_any_model_is_built(args, named):
    result = run(["--config", "tiny", *args], timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert named in result.stderr and "ForCausalLM" not in result.stdout, result.stderr


@pytest.fixture
def example(monkeypatch):
    """examples/gemma4_transformers.py as a module (its flags are gemma3n_transformers.run_arguments')."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    return importlib.import_module("gemma4_transformers")


@pytest.mark.parametrize(
    "args, said",
    [
        (["--device", "meta"], ["argument --device", "must be the CPU or a CUDA device, got 'meta'"]),
        (["--device", "cuda:99"], ["argument --device", "'cuda:99'"]),
        (["--backend", "bogus"], ["argument --backend", "no backend 'bogus'"]),
        # One position past the tiny Gemma 4 config's 256 (prompt + new tokens).
        (
            ["--prompt-len", "245", "--new-tokens", "12"],
            ["--prompt-len 245", "--new-tokens 12", "max_position_embeddings 256"],
        ),
    ],
)
def test_what_the_run_cannot_do_is_a_usage_error_in_parse(example, capsys, args, said):
    """parse() runs before any model is built; a usage error: exit status 2, no traceback."""
    with pytest.raises(SystemExit) as exited:
        example.parse(["--config", "tiny", *args])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith("usage: ") and "Traceback" not in err, err
    for words in said:
        assert words in err, err


def test_parse_fills_in_the_defaults_and_returns_the_config(example):
    args, device, cfg = example.parse(["--config", "tiny", "--device", "cpu"])
    assert (args.batch, args.new_tokens, args.repeats, args.max_cache_len) == (2, 12, 2, 4 * (16 + 12))
    assert device == torch.device("cpu") and cfg.model_type == "gemma4_text" and args.attention == "eager"


def test_a_reference_that_does_not_repeat_fails_and_says_which_runs_agree(example, capsys):
    # Run 0 is the warm-up: here it alone differs, and every timed run of every model agrees.
    a, b = torch.randint(0, 9, (2, 4)), torch.randint(10, 19, (2, 4))
    tokens = {"stock": [a, b, b.clone()], "host": [b, b.clone()], "host+kv": [a.clone(), b]}
    assert example.verdict(tokens, torch.device("cpu"), 1, 1) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "gemma4 transformers: the reference does not repeat (stock run 1 gives other tokens)",
        "  stock: runs 0-2 give tokens a b b",
        "  host: runs 0-1 give tokens b b",
        "  host+kv: runs 0-1 give tokens a b",
    ]
