"""torch.library.opcheck on every kv_ops op: schema (declared mutations), fake impl, dispatch.

opcheck alone would pass on an op that torch.compile deletes, so test_compile.py checks that
the bytes move under compile; this file checks the registration itself.
"""

import pytest
import torch
from byte_checks import make_regions, random_bytes

import kv_ops  # noqa: F401  (registers torch.ops.kv_ops)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def regions(device, num_blocks, seed):
    return make_regions([256, 48], num_blocks, device, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_copy_blocks(device):
    src_ids = torch.tensor([0, 3, 5], device=device)
    dst_ids = torch.tensor([6, 1, 2], device=device)
    torch.library.opcheck(
        torch.ops.kv_ops.copy_blocks.default, (regions(device, 8, 0), regions(device, 7, 1), src_ids, dst_ids)
    )


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_gather_blocks(device):
    ids = torch.tensor([4, 0, 7], device=device)
    out = random_bytes((3, 304), device)
    torch.library.opcheck(torch.ops.kv_ops.gather_blocks.default, (regions(device, 8, 2), ids, out))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_scatter_blocks(device):
    ids = torch.tensor([2, 6, 1], device=device)
    packed = random_bytes((3, 304), device)
    torch.library.opcheck(torch.ops.kv_ops.scatter_blocks.default, (packed, ids, regions(device, 8, 3)))
