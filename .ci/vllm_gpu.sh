#!/usr/bin/env bash
# vLLM's own GPU worker tests (tests/v1/kv_offload/cpu/test_gpu_worker.py) and this project's
# tests/integrations/test_vllm.py against kv_ops.integrations.vllm, on a CUDA machine without
# network and without vLLM, from the bundle that .ci/vllm_gpu_bundle.sh builds.
#
#   bash .ci/vllm_gpu_bundle.sh [VERSION...]  here, with registry access: builds .vllm-gpu/
#   bash .ci/vllm_gpu.sh [VERSION...]         on the CUDA machine, from a checkout with .vllm-gpu/
#                                   carried ($OUT, if set, gets one log per step and release; PY
#                                   picks the Python, default python3, which must have a CUDA
#                                   torch, triton, pytest)
#
# VERSION: vLLM releases of kv_ops.integrations.VLLM_VERSIONS, by default all of them; each runs
# the steps below on its own sources from the bundle.
#
# Why: vLLM's CUDA wheel cannot travel (built for one torch and CUDA, hundreds of MiB); its Python
# sources can, and vLLM's KV-offload code needs none of its compiled kernels. Steps: install the
# bundle's wheels into a temp folder, then per release unpack its vLLM sources there, print what
# vLLM makes of the machine (it must pick its CUDA platform by itself), then the two test runs,
# each under `timeout`. Exits non-zero if any step fails, the diagnosis included (vLLM not on CUDA
# counts as a failure).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
B=$PWD/.vllm-gpu
SUPPORTED=$(sed -n 's/^VLLM_VERSIONS = (\([^)]*\)).*/\1/p' kv_ops/integrations/__init__.py | tr -d '",')
VERSIONS=("$@")
[ "$#" -gt 0 ] || read -ra VERSIONS <<<"$SUPPORTED"
for VERSION in "${VERSIONS[@]}"; do
    if [[ " $SUPPORTED " != *" $VERSION "* ]]; then
        echo "vllm_gpu: vLLM $VERSION is not one of $SUPPORTED (VLLM_VERSIONS)" >&2
        exit 2
    fi
    if [ ! -f "$B/vllm-src-$VERSION.tar.xz" ] || [ ! -d "$B/tests/$VERSION" ]; then
        echo "vllm_gpu: no bundle for vLLM $VERSION in $B: run .ci/vllm_gpu_bundle.sh $VERSION, carry .vllm-gpu" >&2
        exit 2
    fi
done
[ -n "${OUT:-}" ] && mkdir -p "$OUT"
status=0
# step NAME SECONDS CMD...: CMD under timeout, its output also in $OUT/NAME.log; a failure counts.
step() {
    local name=$1 limit=$2 rc
    shift 2
    echo "=== $name: $*"
    timeout -k 10 "$limit" "$@" 2>&1 | if [ -n "${OUT:-}" ]; then tee "$OUT/$name.log"; else cat; fi
    rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc"
    [ "$rc" = 0 ] || status=1
}

# The wheels into a temp folder; per release, vLLM's sources (with the bundle's shims) beside them,
# both ahead on PYTHONPATH.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$tmp/site" \
    "$B"/wheels/*.whl || exit 1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
repo=$PWD
base_path=${PYTHONPATH:-}

for VERSION in "${VERSIONS[@]}"; do
    mkdir -p "$tmp/src-$VERSION"
    tar xJf "$B/vllm-src-$VERSION.tar.xz" -C "$tmp/src-$VERSION" || exit 1
    export PYTHONPATH="$tmp/site:$tmp/src-$VERSION:$repo${base_path:+:$base_path}"

    # What vLLM makes of this machine: imported from the bundle, without vllm._C, and its platform.
    step "01_diagnosis-$VERSION" 180 "$PY" - <<'EOF'
import importlib, importlib.metadata as md, sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
# pydantic, openai and httpx2 need typing_extensions>=4.16 and anyio>=4.10 from the machine.
print(" | ".join(f"{d} {md.version(d)}" for d in ("typing_extensions", "anyio", "transformers", "triton")))
import vllm
print("vllm", vllm.__version__, "from", vllm.__file__, "| metadata", md.version("vllm"))
try:
    importlib.import_module("vllm._C")
    print("vllm._C: present (unexpected: the bundle carries no compiled file)")
except ImportError as e:
    print("vllm._C: absent, as it should be:", e)
from vllm.platforms import current_platform as p
print("detected platform:", type(p).__name__, "device_type", p.device_type, "is_cuda", p.is_cuda())
import vllm.v1.kv_offload.cpu.gpu_worker, kv_ops.integrations.vllm
sys.exit(0 if p.is_cuda() else "vllm_gpu: vLLM did not select its CUDA platform")
EOF

    # vLLM's GPU worker tests through the plugin, as .ci/run runs vLLM's suite: from the extracted
    # folder (its empty pytest.ini keeps this project's settings out), the plugin on PYTHONPATH.
    cd "$B/tests/$VERSION" || exit 1
    PYTHONPATH="$repo/tests/integrations/vllm_suite:$PYTHONPATH" step "02_vllm_gpu_worker-$VERSION" 300 \
        "$PY" -m pytest -q -p no:cacheprovider -p offload_ops_vllm_plugin --timeout 300 -rsx \
        tests/v1/kv_offload/cpu/test_gpu_worker.py
    cd "$repo" || exit 1

    # This project's vLLM integration tests but the end-to-end one (it needs vLLM's compiled kernels).
    step "03_test_vllm-$VERSION" 240 "$PY" -m pytest -q -p no:cacheprovider -rsx tests/integrations/test_vllm.py \
        -k "not end_to_end"
done
echo "vllm_gpu: $([ "$status" = 0 ] && echo all steps passed || echo a step FAILED)"
exit "$status"
