"""Both copy kernels, compiled ahead of time for an H100/H200 (sm_90) on any machine, move bytes
in 128-bit accesses when every address is 16-byte aligned.

Triton's alignment hints are easy to lose in a refactor (a hint on a value a helper returns is
dropped), and a kernel that silently falls back to byte accesses still copies correctly at a
fraction of the link. Compiling needs no GPU (``tests/sm90.py``).
"""

import pytest
import sm90

from kv_ops.cuda.launch import NUM_WARPS

KERNELS = {
    "block_copy": ("kv_ops.kernels", "_block_copy_kernel"),
    "prefix_copy": ("kv_ops.prefix_copy", "_prefix_copy_kernel"),
}


def ptx(kernel: str, constexprs: dict) -> list[str]:
    """The PTX of ``kernel`` (block_copy or prefix_copy) for sm_90, every pointer 16-byte aligned."""
    module, name = KERNELS[kernel]
    return sm90.compiled(module, name, constexprs, NUM_WARPS, aligned=True)["ptx"].splitlines()


def assert_vector_copy(lines: list[str]) -> None:
    # The copy's own accesses are the byte ones (u8/b32 data, not the int64 ids and lengths):
    # each must be a .v4.b32 access, 16 bytes per thread.
    loads = [line for line in lines if "ld.global" in line and ".b32" in line]
    stores = [line for line in lines if "st.global" in line and ".b32" in line]
    assert loads and stores, "no 32-bit data access at all"
    assert all(".v4." in line for line in loads + stores), "\n".join(loads + stores)
    assert not [line for line in lines if "global.u8" in line or "global.b8" in line]


@pytest.mark.parametrize(
    "sides",
    [
        dict(SRC_PACKED=False, DST_PACKED=False, IDS_IN_BLOCK=False),
        dict(SRC_PACKED=True, DST_PACKED=False, IDS_IN_BLOCK=False),
        dict(SRC_PACKED=False, DST_PACKED=True, IDS_IN_BLOCK=False),
        dict(SRC_PACKED=False, DST_PACKED=False, IDS_IN_BLOCK=True),
    ],
    ids=["copy", "scatter", "gather", "id-block"],
)
def test_the_block_copy_kernel_moves_16_bytes_per_access(sides):
    assert_vector_copy(ptx("block_copy", dict(COLS=2048, ROWS=16, ALIGN=16, LANES=1024, **sides)))


def test_the_prefix_copy_kernel_moves_16_bytes_per_access():
    assert_vector_copy(ptx("prefix_copy", dict(TILE=32768, ALIGN=16)))


def test_the_check_fails_on_a_kernel_without_the_alignment_hint():
    # The same block copy told only 1-byte alignment: byte accesses, which the check must refuse.
    with pytest.raises(AssertionError):
        assert_vector_copy(
            ptx(
                "block_copy",
                dict(COLS=2048, ROWS=16, ALIGN=1, LANES=1024, SRC_PACKED=False, DST_PACKED=False, IDS_IN_BLOCK=False),
            )
        )
