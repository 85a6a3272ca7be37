"""examples/gemma3n_transformers.py's tiny configuration on the CPU, in a subprocess: stock
transformers Gemma 3n, compiled generate() with a static cache, stock and with its per-layer
table served by ple_ops.host_embedding; the tokens must be identical."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


# --- usage errors, in-process: parse or main with model building refused ------------------------


def refuse_to_build(*args, **kwargs):
    raise AssertionError("a model was built before the arguments were refused")


@pytest.fixture
def example(monkeypatch):
    """examples/gemma3n_transformers.py as a module, its build() refusing: a usage error must come first."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    module = importlib.import_module("gemma3n_transformers")
    monkeypatch.setattr(module, "build", refuse_to_build)
    return module


def usage_error(capsys, call) -> str:
    """``call()``'s usage error: exit status 2 and argparse's usage line on stderr, no traceback."""
    with pytest.raises(SystemExit) as exited:
        call()
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert err.startswith("usage: ") and "error: " in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "args, said",
    [
        (["--device", "cuda:99"], ["argument --device", "'cuda:99'"]),
        (["--device", "meta"], ["argument --device", "must be the CPU or a CUDA device, got 'meta'"]),
        (["--device", "mps"], ["argument --device", "must be the CPU or a CUDA device, got 'mps'"]),
        (["--backend", "bogus"], ["argument --backend", "no backend 'bogus'", "inductor"]),
        # One position past the tiny config's 256 (prompt + new tokens).
        (
            ["--prompt-len", "250", "--new-tokens", "7"],
            ["--prompt-len 250", "--new-tokens 7", "257 positions", "max_position_embeddings 256"],
        ),
    ],
)
def test_what_the_run_cannot_do_is_a_usage_error_before_any_model_is_built(example, capsys, args, said):
    err = usage_error(capsys, lambda: example.main(["--config", "tiny", *args]))
    for words in said:
        assert words in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is there: --device cuda is valid")
def test_a_cuda_device_without_cuda_is_a_usage_error(example, capsys):
    err = usage_error(capsys, lambda: example.main(["--device", "cuda"]))
    assert "argument --device" in err and "no CUDA device" in err, err


def test_flags_not_given_take_the_sizes_defaults_and_the_limit_itself_and_debug_backends_pass(example):
    args, device, cfg = example.parse(["--config", "tiny", "--device", "cpu"])
    assert (args.batch, args.new_tokens, args.repeats, args.backend) == (2, 12, 2, "inductor")
    assert device == torch.device("cpu") and cfg.max_position_embeddings == 256
    args, _, _ = example.parse(["--config", "tiny", "--prompt-len", "244", "--backend", "aot_eager"])
    assert args.prompt_len + args.new_tokens == 256 and args.backend == "aot_eager"


@pytest.mark.parametrize("family", ["gemma3n", "gemma4"])
def test_the_tiny_models_logits_depend_on_the_per_layer_table(family, monkeypatch):
    # The example's "tokens match" can catch a wrong row only if the table reaches the logits:
    # Gemma 3n's AltUp correction scale, zero as transformers initialises it, would cancel it.
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    module = importlib.import_module("gemma3n_transformers")
    cfg = module.config("tiny", family)
    model = module.build(cfg, torch.device("cpu"), torch.float32)
    ids = torch.randint(3, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = model(ids).logits
        table = model.get_per_layer_input_embeddings().weight
        table[ids[0, 3]] += torch.randn(table.shape[1], generator=torch.Generator().manual_seed(6))
        assert not torch.equal(model(ids).logits, before)
