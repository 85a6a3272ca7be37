"""kv_ops.cuda.driver: the one place the CUDA driver bindings are imported, lazily, and every call checked."""

import enum
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from kv_ops.cuda import driver as driver_module

ROOT = Path(__file__).resolve().parents[2]


class _Result(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1


def _fake_driver(**calls) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        CUresult=_Result,
        cuGetErrorString=lambda err: (_Result.CUDA_SUCCESS, b"invalid argument"),
        CUpointer_attribute=types.SimpleNamespace(CU_POINTER_ATTRIBUTE_DEVICE_POINTER=1),
        **calls,
    )


def test_check_driver_returns_the_outputs_and_raises_naming_the_call(monkeypatch):
    monkeypatch.setattr(driver_module, "driver", _fake_driver)
    assert driver_module.check_driver((_Result.CUDA_SUCCESS, 7, 8), "cuThing") == (7, 8)
    with pytest.raises(RuntimeError, match=r"cuThing failed: CUDA_ERROR_INVALID_VALUE \(1\): invalid argument"):
        driver_module.check_driver((_Result.CUDA_ERROR_INVALID_VALUE,), "cuThing")


def test_device_pointer_refuses_memory_not_mapped_for_the_gpu(monkeypatch):
    fake = _fake_driver(cuPointerGetAttribute=lambda attr, ptr: (_Result.CUDA_ERROR_INVALID_VALUE, 0))
    monkeypatch.setattr(driver_module, "driver", lambda: fake)
    with pytest.raises(ValueError, match="not page-locked memory mapped for the GPU"):
        driver_module.device_pointer(torch.zeros(4))


def test_both_packages_import_without_cuda_bindings_and_the_error_names_it():
    # A CPU-only install may lack cuda-bindings; only a driver call may need it, and the doctor
    # turns an ImportError whose name starts with "cuda" into "pip install cuda-bindings".
    probe = (
        "import sys\n"
        "for name in ('cuda', 'cuda.bindings', 'cuda.bindings.driver'):\n"
        "    sys.modules[name] = None\n"
        "import kv_ops, kv_ops.tools.doctor, ple_ops\n"
        "from kv_ops.cuda.driver import driver\n"
        "try:\n"
        "    driver()\n"
        "except ImportError as e:\n"
        "    print(e.name)\n"
    )
    run = [sys.executable, "-c", probe]
    out = subprocess.run(run, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().startswith("cuda")


def test_no_module_imports_the_bindings_but_kv_ops_driver():
    inline = re.compile(r"^\s*(from\s+cuda(\.\w+)*\s+import|import\s+cuda\b)", re.M)
    offenders = [
        str(path.relative_to(ROOT))
        for folder in ("kv_ops", "ple_ops", "examples", "benchmarks", "tests", "compile_tests")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path != ROOT / "kv_ops" / "cuda" / "driver.py" and inline.search(path.read_text())
    ]
    assert not offenders, f"import the driver through kv_ops.cuda.driver, not directly: {offenders}"


@pytest.mark.gpu
def test_a_fresh_thread_issues_driver_copies_inside_driver_context():
    # A fresh thread's runtime device already is cuda:0, so torch binds no driver context there;
    # without driver_context binding the primary one, cuMemcpyBatchAsync failed with
    # CUDA_ERROR_INVALID_VALUE (measured on the H200, from a worker thread of layer-wise loads).
    import threading

    import numpy as np

    from kv_ops.transfer import dma

    torch.cuda.init()
    src = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8).pin_memory()
    dst = torch.full((1 << 16,), 7, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    plan = dma.Plan(*(np.array([v], dtype=np.int64) for v in (dst.data_ptr(), src.data_ptr(), src.numel())))
    outcome = {}

    def work():
        try:
            with driver_module.driver_context(torch.device("cuda", 0)):
                (outcome["context"],) = driver_module.check_driver(driver_module.driver().cuCtxGetCurrent(), "get")
            dma.launch(plan, stream)
            stream.synchronize()
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert "error" not in outcome, outcome.get("error")
    (main,) = driver_module.check_driver(driver_module.driver().cuCtxGetCurrent(), "get")
    assert int(outcome["context"]) == int(main) != 0
    assert torch.equal(dst.cpu(), src)
