"""examples/hf_offload.py's tiny configuration on the CPU, in a subprocess: stock generate() with
kv_ops's HostOffloadedCache must give the tokens of transformers' StaticCache, eagerly and compiled."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

ROOT = Path(__file__).resolve().parents[2]


def run(args, timeout=600):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "examples/hf_offload.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_generate_with_the_host_offloaded_cache_gives_the_static_caches_tokens(mode):
    result = run(["--mode", mode])
    out = result.stdout
    assert result.returncode == 0, f"{out}\n{result.stderr[-4000:]}"
    assert (
        out.splitlines()[0]
        == f"hf offload on cpu: Llama tiny, 5 layers, batch 2, prompt 12, 6 new tokens, {mode}, eager attention"
    )
    assert "(3 slots of 5)" in out, out
    assert out.splitlines()[-1] == "hf offload: tokens match (12 tokens)", out


@pytest.mark.gpu
def test_on_a_gpu_at_8b_widths_generate_with_the_host_offloaded_cache_gives_the_static_caches_tokens():
    """The example's CUDA defaults: 8 layers of Llama-3-8B, batch 4, a 4096-token prompt, 32 new tokens."""
    result = run([])
    out = result.stdout
    assert result.returncode == 0, f"{out}\n{result.stderr[-4000:]}"
    assert out.splitlines()[0].startswith("hf offload on cuda: Llama 8b, 8 layers, batch 4, prompt 4096"), out
    assert out.splitlines()[-1] == "hf offload: tokens match (128 tokens)", out


def test_a_bad_mode_is_refused_by_name():
    result = run(["--mode", "fast"], timeout=120)
    assert result.returncode == 2 and "--mode" in result.stderr, result.stderr


@pytest.fixture
def example(monkeypatch):
    """examples/hf_offload.py as a module, its build() refusing: a usage error must come first."""
    # By path, under a name of its own: benchmarks/hf_offload.py is a module "hf_offload" too.
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    spec = importlib.util.spec_from_file_location("hf_offload_example_under_test", ROOT / "examples/hf_offload.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def refuse_to_build(*args, **kwargs):
        raise AssertionError("a model was built before the arguments were refused")

    monkeypatch.setattr(module, "build", refuse_to_build)
    return module


@pytest.mark.parametrize("flag", ["--layers", "--batch", "--prompt", "--new-tokens"])
@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_a_count_below_one_or_not_an_integer_is_a_usage_error_before_any_model_is_built(example, capsys, flag, value):
    with pytest.raises(SystemExit) as exited:
        example.main([flag, value])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith("usage: ") and "Traceback" not in err, err
    assert f"argument {flag}: " in err, err


def test_counts_not_given_take_the_devices_defaults_and_given_ones_stand(example):
    cuda = torch.cuda.is_available()
    args = example.parse([])
    want = ("8b", 8, 4, 4096, 32) if cuda else ("tiny", 5, 2, 12, 6)
    assert (args.size, args.layers, args.batch, args.prompt, args.new_tokens) == want
    args = example.parse(["--layers", "1", "--batch", "1", "--prompt", "1", "--new-tokens", "1"])
    assert (args.layers, args.batch, args.prompt, args.new_tokens) == (1, 1, 1, 1)
