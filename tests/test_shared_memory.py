"""Which kernels of kv_ops and ple_ops use shared memory, compiled for an H100/H200 (sm_90) on any
machine. compute-sanitizer's racecheck looks for hazards on shared memory only, so it has nothing
to check in a kernel that uses none: the prefix copy and its claim (all that the transformers
integration launches of ours), the layer-wise wait and ple_ops' kernels. The block copy shares its
count of invalid ids across warps through shared memory; racecheck over ``tests/kv_ops`` (the
default list of ``.ci/gpu``) is what checks it.

A kernel that starts to use shared memory (a reduction, a layout change) fails here, and then a
racecheck run over its tests is what proves it. Every ``@triton.jit`` function named
``*_kernel`` in either package must have a case below, so a new kernel cannot pass unchecked. As
in ``tests/kv_ops/test_vector_access.py``, Triton's own LLVM and ptxas compile in a child process
without ``TRITON_INTERPRET``.
"""

import importlib
import json
import os
import pkgutil
import subprocess
import sys

import pytest

from kv_ops.cuda.launch import NUM_WARPS, TILE_BYTES

SHARED = {"_block_copy_kernel"}  # the kernels that use shared memory

# Per kernel, as its launch compiles it: its module, its warps, its constexprs, and the pointers
# that are not bytes (every other argument is a runtime int64).
CASES = {
    "_block_copy_kernel": (
        "kv_ops.kernels",
        NUM_WARPS,
        dict(COLS=2048, ROWS=16, ALIGN=16, LANES=1024, SRC_PACKED=True, DST_PACKED=False, IDS_IN_BLOCK=True),
        {"table_ptr": "*i64", "src_ids_ptr": "*i64", "dst_ids_ptr": "*i64", "error_ptr": "*i64"},
    ),
    "_prefix_copy_kernel": (
        "kv_ops.prefix_copy",
        NUM_WARPS,
        dict(TILE=TILE_BYTES, ALIGN=16),
        {name: "*i64" for name in ("length_ptr", "out_length_ptr", "out_saved_ptr", "saved_ptr", "go_ptr")},
    ),
    "_claim_kernel": ("kv_ops.prefix_copy", 1, {}, {"holder_ptr": "*i64", "go_ptr": "*i64"}),
    "_wait_landed_kernel": ("kv_ops.layer_wait", 1, {}, {"flags_ptr": "*i32", "error_ptr": "*i64"}),
    "_wait_kernel": (
        "ple_ops.kernels",
        1,
        dict(MARK=True, WAITING_VALUE=2, DONE_VALUE=1),
        {"flag_ptr": "*i32", "waiting_ptr": "*i32"},
    ),
    "_copy_kernel": ("ple_ops.kernels", NUM_WARPS, dict(TILE=TILE_BYTES), {}),
    "_release_kernel": (
        "ple_ops.kernels",
        1,
        dict(MARK=True, WAITING_VALUE=2, IDLE_VALUE=0, DONE_VALUE=1, RESET_VALUE=0),
        {"flag_ptr": "*i32", "waiting_ptr": "*i32"},
    ),
}


def child(arg: str):
    """What this file prints when run with ``arg``: a kernel's compilation, or every kernel's name
    (under ``TRITON_INTERPRET`` a ``@triton.jit`` function is not a JITFunction)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # -P: not this file's folder first on sys.path, where tests/kv_ops would stand in for kv_ops.
    out = subprocess.run([sys.executable, "-P", __file__, arg], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def compile_for_sm90(name: str) -> dict:
    """Kernel ``name``'s sm_90 PTX and shared-memory bytes."""
    import triton
    from triton.backends.compiler import GPUTarget

    module, warps, constexprs, pointers = CASES[name]
    kernel = getattr(importlib.import_module(module), name)
    signature = {
        arg: "constexpr" if arg in constexprs else pointers.get(arg, "*u8" if arg.endswith("_ptr") else "i64")
        for arg in kernel.arg_names
    }
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    out = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    return {"ptx": out.asm["ptx"], "shared": out.metadata.shared}


def jit_kernels() -> set[str]:
    """The ``@triton.jit`` functions named ``*_kernel`` in every module of kv_ops and ple_ops."""
    from triton.runtime.jit import JITFunction

    found = set()
    for package in ("kv_ops", "ple_ops"):
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, package + "."):
            if info.name.endswith(".__main__"):  # a command, run on import
                continue
            try:
                module = importlib.import_module(info.name)
            except ImportError:  # an integration whose client (vLLM, transformers) is absent
                continue
            found |= {n for n, v in vars(module).items() if isinstance(v, JITFunction) and n.endswith("_kernel")}
    return found


def test_every_kernel_of_ours_has_a_case_here():
    assert set(child("--list")) == set(CASES)


@pytest.mark.parametrize("name", sorted(set(CASES) - SHARED))
def test_the_kernel_uses_no_shared_memory(name):
    kernel = child(name)
    assert kernel["shared"] == 0
    assert not [line for line in kernel["ptx"].splitlines() if ".shared" in line]


@pytest.mark.parametrize("name", sorted(SHARED))
def test_the_kernels_said_to_use_shared_memory_do(name):
    # Also the control: the check above sees shared memory where a kernel uses it.
    kernel = child(name)
    assert kernel["shared"] > 0 and [line for line in kernel["ptx"].splitlines() if ".shared" in line]


if __name__ == "__main__":
    print(json.dumps(sorted(jit_kernels()) if sys.argv[1] == "--list" else compile_for_sm90(sys.argv[1])))
