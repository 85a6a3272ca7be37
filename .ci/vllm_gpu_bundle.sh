#!/usr/bin/env bash
# Builds .vllm-gpu/, what a CUDA machine without network needs to run vLLM's own GPU worker tests
# (tests/v1/kv_offload/cpu/test_gpu_worker.py) against kv_ops.integrations.vllm with .ci/vllm_gpu.sh.
#
#   bash .ci/vllm_gpu_bundle.sh [VERSION...]   (from anywhere, on a machine that reaches PyPI;
#                                               python3 + pip)
#
# VERSION: vLLM releases of kv_ops.integrations.VLLM_VERSIONS; by default all of them, each with
# its own sources and tests beside the one set of wheels. Then, on the CUDA machine, with
# .vllm-gpu carried there: bash .ci/vllm_gpu.sh [VERSION...]
#
# Why: vLLM's CUDA wheel is built for one torch and CUDA and weighs hundreds of MiB, so it cannot
# travel; its Python sources can, and vLLM's KV-offload code and these tests need none of its
# compiled kernels. What lands in .vllm-gpu/ (git-ignored, about 25 MiB and 6 more per release,
# rebuilt from scratch):
#   vllm-src-X.tar.xz      the pinned sdist's vllm/ package, without any compiled file, and two
#                          shims written below (vllm-X.dist-info/, vllm/_C_stable_libtorch.py)
#   tests/X/               vLLM's offloading tests, extracted by tests/integrations/vllm_suite/fetch.py
#   wheels/                cp312 manylinux wheels of what `import vllm...` needs beyond a CUDA torch
#                          image (torch, triton, transformers, numpy, pytest, anyio... are there)
# The sdist is downloaded and checksum-checked by fetch.py, cached in .venv/vllm-sdist as .ci/run does.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
# The CUDA machine's Python; another (PY_VERSION=3.11) only to try .ci/vllm_gpu.sh on a local Python.
PY_VERSION=${PY_VERSION:-3.12}
B=.vllm-gpu
# The vLLM releases kv_ops.integrations.vllm is tested against (read, not imported: no torch needed).
SUPPORTED=$(sed -n 's/^VLLM_VERSIONS = (\([^)]*\)).*/\1/p' kv_ops/integrations/__init__.py | tr -d '",')
[ -n "$SUPPORTED" ] || { echo "vllm_gpu_bundle: no VLLM_VERSIONS in kv_ops/integrations/__init__.py" >&2; exit 1; }
VERSIONS=("$@")
[ "$#" -gt 0 ] || read -ra VERSIONS <<<"$SUPPORTED"
for VERSION in "${VERSIONS[@]}"; do
    [[ " $SUPPORTED " == *" $VERSION "* ]] ||
        { echo "vllm_gpu_bundle: vLLM $VERSION is not one of $SUPPORTED (VLLM_VERSIONS)" >&2; exit 1; }
done

# The wheels, in this one place: NAME==VERSION, then what imports it (versions: those the GPU tests passed with).
WHEELS=(
    "pydantic==2.14.4"                   # vllm.config: its configs are pydantic dataclasses
    "pydantic-core==2.50.5"              # pydantic
    "annotated-types==0.8.0"             # pydantic
    "typing-inspection==0.4.5"           # pydantic
    "msgspec==0.23.0"                    # vllm.v1.kv_hints.protocol, from vllm.v1.kv_offload.base
    "pyzmq==27.3.0"                      # vllm.utils.network_utils, from vllm.distributed (vllm._custom_ops)
    "cbor2==6.3.0"                       # vllm.utils.hashing, from vllm.config.device
    "cachetools==8.0.2"                  # vllm.utils.cache, from vllm.multimodal (kv_connector.v1.base)
    "pybase64==1.5.1"                    # vllm.multimodal.media, same way
    "fastapi==0.136.3"                   # vllm.entrypoints.serve, from vllm.parser (vllm.v1.request)
    "starlette==1.10.0"                  # fastapi
    "openai==3.57.0"                     # vllm.entrypoints.mcp's response types, from vllm.config.reasoning
    "httpx2==2.16.2"                     # openai's HTTP client
    "httpcore2==2.16.2"                  # httpx2
    "truststore==0.10.5"                 # httpx2, httpcore2
    "sniffio==1.3.1"                     # openai, httpcore2
    "oss-harmony==0.0.11"                # openai_harmony: vllm.entrypoints.mcp.tool_server, same way
    "partial-json-parser==0.2.1.1.post7" # vllm.tool_parsers, from vllm.parser
    "xgrammar==0.2.8"                    # vllm.parser.abstract_parser, from vllm.v1.structured_output
    "apache-tvm-ffi==0.1.15.post2"       # xgrammar
    "llguidance==1.7.6"                  # vllm.v1.structured_output.backend_guidance, from vllm.config
)

rm -rf "$B"
mkdir -p "$B/wheels"
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT

for VERSION in "${VERSIONS[@]}"; do
    rm -rf "$src" && mkdir "$src"
    # vLLM's tests, and the sdist in fetch.py's cache (downloaded once, sha256 checked against its pin).
    suite=$("$PY" tests/integrations/vllm_suite/fetch.py "$VERSION" "$B/tests" --cache .venv/vllm-sdist)
    sdist=.venv/vllm-sdist/vllm-$VERSION.tar.gz

    # vllm/ alone, nothing compiled (an sdist carries none; the excludes make sure of it), packed as
    # vllm-src-X.tar.xz: unpacked it is some 50 MiB in 3,300 files, packed about 6 MiB.
    tar xzf "$sdist" -C "$src" --no-same-owner --strip-components=1 --exclude='*.so' --exclude='*.pyc' \
        --exclude='__pycache__' "vllm-$VERSION/vllm"

    # Shim 1: vLLM's platform detection (vllm/platforms) reads importlib.metadata.version("vllm") and
    # takes a version naming "cpu" for its CPU build; with no installed dist it cannot select CUDA.
    mkdir -p "$src/vllm-$VERSION.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$VERSION" >"$src/vllm-$VERSION.dist-info/METADATA"
    printf 'vllm-%s.dist-info/METADATA,,\n' "$VERSION" >"$src/vllm-$VERSION.dist-info/RECORD"
    # Shim 2: vllm/platforms/cuda.py imports the compiled vllm._C_stable_libtorch unguarded (only to
    # register custom ops); an empty module lets the CUDA platform load. No op is registered: a test
    # that calls one of vLLM's own CUDA kernels fails loudly with "no such op".
    echo '# Empty stand-in for the compiled vllm/_C_stable_libtorch*.so (.ci/vllm_gpu_bundle.sh).' \
        >"$src/vllm/_C_stable_libtorch.py"
    XZ_OPT=-T0 tar cJf "$B/vllm-src-$VERSION.tar.xz" -C "$src" vllm "vllm-$VERSION.dist-info"
    echo "vllm_gpu_bundle: vLLM $VERSION: $(find "$src/vllm" -name '*.py' | wc -l) .py files, tests in $suite"
done

# The wheels for the CUDA machine's Python on x86-64; --no-deps: exactly the list above.
platforms=()
for p in manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 \
    manylinux2014 manylinux_2_5 manylinux1; do
    platforms+=(--platform "${p}_x86_64")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    "${platforms[@]}" -d "$B/wheels" "${WHEELS[@]}"

echo "vllm_gpu_bundle: $B: $(du -sh "$B" | cut -f1), $(find "$B/wheels" -name '*.whl' | wc -l) wheels," \
    "vLLM ${VERSIONS[*]}"
