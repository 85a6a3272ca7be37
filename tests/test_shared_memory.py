"""Which kernels of kv_ops and ple_ops use shared memory, compiled for an H100/H200 (sm_90) on any
machine. compute-sanitizer's racecheck looks for hazards on shared memory only, so it has nothing
to check in a kernel that uses none: the prefix copy and its claim (all that the transformers
integration launches of ours), the layer-wise wait and ple_ops' kernels. The block copy shares its
count of invalid ids across warps through shared memory; racecheck over ``tests/kv_ops`` (the
default list of ``.ci/gpu``) is what checks it.

A kernel that starts to use shared memory (a reduction, a layout change) fails here, and then a
racecheck run over its tests is what proves it. Every ``@triton.jit`` function named
``*_kernel`` in either package must have a case below, so a new kernel cannot pass unchecked.
"""

import pytest
import sm90

from kv_ops.cuda.launch import NUM_WARPS, TILE_BYTES

SHARED = {"_block_copy_kernel"}  # the kernels that use shared memory

# Per kernel, at one launch's values: its module, its warps and its constexprs.
CASES = {
    "_block_copy_kernel": (
        "kv_ops.kernels",
        NUM_WARPS,
        dict(COLS=2048, ROWS=16, ALIGN=16, LANES=1024, SRC_PACKED=True, DST_PACKED=False, IDS_IN_BLOCK=True),
    ),
    "_prefix_copy_kernel": ("kv_ops.prefix_copy", NUM_WARPS, dict(TILE=TILE_BYTES, ALIGN=16)),
    "_claim_kernel": ("kv_ops.prefix_copy", 1, {}),
    "_wait_landed_kernel": ("kv_ops.layer_wait", 1, {}),
    "_wait_kernel": ("ple_ops.kernels", 1, dict(MARK=True, WAITING_VALUE=2, DONE_VALUE=1)),
    "_copy_kernel": ("ple_ops.kernels", NUM_WARPS, dict(TILE=TILE_BYTES)),
    "_release_kernel": (
        "ple_ops.kernels",
        1,
        dict(MARK=True, WAITING_VALUE=2, IDLE_VALUE=0, DONE_VALUE=1, RESET_VALUE=0),
    ),
}


def compiled(name: str) -> dict:
    module, warps, constexprs = CASES[name]
    kernel = sm90.compiled(module, name, constexprs, warps)
    assert f".entry {name}" in kernel["ptx"]  # the kernel itself, not an empty module
    return kernel


def test_every_kernel_of_ours_has_a_case_here():
    assert set(sm90.kernels()) == set(CASES)


@pytest.mark.parametrize("name", sorted(set(CASES) - SHARED))
def test_the_kernel_uses_no_shared_memory(name):
    kernel = compiled(name)
    assert kernel["shared"] == 0
    assert not [line for line in kernel["ptx"].splitlines() if ".shared" in line]


@pytest.mark.parametrize("name", sorted(SHARED))
def test_the_kernels_said_to_use_shared_memory_do(name):
    # Also the control: the check above sees shared memory where a kernel uses it.
    kernel = compiled(name)
    assert kernel["shared"] > 0 and [line for line in kernel["ptx"].splitlines() if ".shared" in line]
