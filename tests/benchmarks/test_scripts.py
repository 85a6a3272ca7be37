"""Every script in benchmarks/ and examples/ answers --help with its usage, and every GPU-only
benchmark refuses a machine without CUDA with the one line and status of benchmarks/common.py
(hf_offload.py refuses bad arguments before that).

Each script imports torch (seconds), so all of them run at once, in subprocesses started by one
fixture, and the tests read their results."""

import argparse
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import common  # noqa: E402  benchmarks/common.py: the line and the status asserted

# The scripts are the files that run as one; the others are the modules they import.
SCRIPTS = sorted(
    str(path.relative_to(ROOT))
    for folder in ("benchmarks", "examples")
    for path in (ROOT / folder).glob("*.py")
    if 'if __name__ == "__main__":' in path.read_text()
)
GPU_ONLY = [
    "benchmarks/block_copy.py",
    "benchmarks/engine.py",
    "benchmarks/hf_offload.py",
    "benchmarks/layerwise.py",
    "benchmarks/layerwise_parts.py",
    "benchmarks/ple_latency.py",
]


def out_dir(factory, script: str) -> Path:
    """The --out a GPU-only benchmark is given without CUDA: never made."""
    return factory.getbasetemp() / f"out-{Path(script).stem}"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """(exit status, stdout, stderr) of every run: ``(script, "--help")`` for each script, and
    ``(script, "no CUDA")`` for each GPU-only benchmark, CUDA hidden, --out a folder not there yet."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        CUDA_VISIBLE_DEVICES="",
    )
    runs = {(s, "--help"): [s, "--help"] for s in SCRIPTS}
    for s in GPU_ONLY:
        runs[s, "no CUDA"] = [s, "--out", str(out_dir(tmp_path_factory, s))]
    procs = {
        key: subprocess.Popen(
            [sys.executable, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for key, argv in runs.items()
    }
    out = {}
    try:
        for key, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=240)
            out[key] = (proc.returncode, stdout, stderr)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


def test_the_scripts_are_found():
    assert set(GPU_ONLY) <= set(SCRIPTS), SCRIPTS
    for script in ("benchmarks/demo.py", "benchmarks/host_cost.py", "examples/decode_loop.py"):
        assert script in SCRIPTS, SCRIPTS
    assert "benchmarks/common.py" not in SCRIPTS and "benchmarks/engine_bandwidth.py" not in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_prints_the_usage_and_exits_0(results, script):
    status, stdout, stderr = results[script, "--help"]
    assert status == 0, f"{stdout[-2000:]}\n{stderr[-2000:]}"
    assert stdout.startswith(f"usage: {Path(script).name}"), stdout[:500]
    assert "-h, --help" in stdout, stdout
    # Nothing ran: no measurement, no device line, no results.
    assert "MISMATCH" not in stdout and "bytes match" not in stdout, stdout


@pytest.mark.parametrize("script", GPU_ONLY)
def test_a_gpu_only_benchmark_without_cuda_says_so_in_one_line(results, script, tmp_path_factory):
    status, stdout, stderr = results[script, "no CUDA"]
    assert status == common.NO_CUDA_STATUS != 0, f"{stdout[-2000:]}\n{stderr[-2000:]}"
    line = f"{Path(script).name}: needs a CUDA device (torch.cuda.is_available() is False); nothing measured"
    assert stderr.splitlines() == [line], stderr
    assert stdout == "", stdout
    assert not out_dir(tmp_path_factory, script).exists()  # refused before --out is made


@pytest.mark.parametrize("script", GPU_ONLY)
def test_a_gpu_only_benchmark_lists_out_in_its_help(results, script):
    stdout = results[script, "--help"][1]
    assert re.search(r"^  --out OUT\b", stdout, re.MULTILINE), stdout


def test_matmuls_leave_sms_puts_both_settings_back_and_none_changes_nothing():
    import torch

    blas = torch.backends.cuda.preferred_blas_library()
    with common.matmuls_leave_sms(None):
        assert torch.backends.cuda.preferred_blas_library() == blas
    torch._C._set_sm_carveout_experimental(3)  # the block leaves none, whatever was set before
    if torch.cuda.is_available():
        with common.matmuls_leave_sms(8):
            assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
            assert torch._C._get_sm_carveout_experimental() == 8
    else:  # a CPU build has no cuBLASLt: setting it fails, and the block undoes what it set
        with pytest.raises(RuntimeError, match="cuBLASLt"), common.matmuls_leave_sms(8):
            pass
    assert torch.backends.cuda.preferred_blas_library() == blas
    assert torch._C._get_sm_carveout_experimental() is None


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--shapes", "8x4"], "argument --shapes: expected LAYERSxBATCHxSEQUENCExCAPACITY"),
        (["--shapes", "8x4x2048x0"], "got '8x4x2048x0'"),
        (["--shapes", "8xAx2048x1"], "got '8xAx2048x1'"),
        (["--shapes", ","], "--shapes: give at least one shape"),
        (["--shapes", "8x4x2048x1", "--graph-shapes", "8x16x2048x4"], "--graph-shapes: 8x16x2048x4 not among --shapes"),
        (["--reps", "0"], "argument --reps: must be at least 1, got 0"),
        (["--merge", "no-such-run.csv"], "argument --merge: no such file: 'no-such-run.csv'"),
    ],
)
def test_hf_offload_refuses_bad_arguments_before_anything_runs(argv, says, tmp_path, capsys, monkeypatch):
    # Refused as arguments, before the CUDA check and before --out is made: a mistyped sweep must
    # not cost a GPU machine's start.
    pytest.importorskip("transformers")
    hf = importlib.import_module("hf_offload")
    monkeypatch.setattr(common.torch.cuda, "is_available", lambda: True)  # the refusal is not the CUDA one
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        hf.main(["--out", str(out), *argv])
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err
    assert not out.exists()


def test_hf_offload_runs_every_shape_with_cuda_graphs_unless_told_otherwise():
    pytest.importorskip("transformers")
    hf = importlib.import_module("hf_offload")
    shapes = hf.shapes("8x4x2048x1,8x16x2048x4")
    assert shapes == ((8, 4, 2048, 1), (8, 16, 2048, 4))
    args = argparse.Namespace(shapes=shapes, graph_shapes=None)
    hf.check_shapes(argparse.ArgumentParser(), args)
    assert args.graph_shapes == shapes
    args = argparse.Namespace(shapes=shapes, graph_shapes=hf.shapes(""))
    hf.check_shapes(argparse.ArgumentParser(), args)
    assert args.graph_shapes == ()


@pytest.mark.parametrize("ahead", [False, True])
def test_hf_offload_groups_a_steps_copy_kernels_as_ours_launches_them(ahead):
    # The timeline groups a step's copy kernels by count: one per streamed layer, and with
    # load_ahead one more per first load (the step's own, left empty by the claim).
    pytest.importorskip("transformers")
    import torch
    from transformers import LlamaConfig, StaticCache

    hf = importlib.import_module("hf_offload")
    from kv_ops.integrations.transformers import HostOffloadedCache

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    cache = HostOffloadedCache(config=cfg, max_cache_len=16, load_ahead=ahead)
    keys = torch.randn(1, 2, 1, 16)
    cache.allocate(keys, keys.clone())
    assert hf.copy_launches(cache) == 7 + (2 if ahead else 0)  # 7 of 8 layers streamed, 2 first loads
    assert hf.copy_launches(StaticCache(config=cfg, max_cache_len=16)) is None
    cache.close()
