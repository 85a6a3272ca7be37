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


@pytest.mark.parametrize("device", DEVICES)
def test_prefetch_layer_mutates_only_its_declared_slots_and_its_fake_runs(device):
    # opcheck cannot run this op: it calls the op on copies of the inputs, and the op refuses a
    # host copy that is not the live cache's own (the check that keeps a step captured for one
    # cache off another's loads). So its checks are made here by hand, on the inputs themselves:
    # the slots change, no other input does, and the fake accepts the call. The load is layer 2
    # into the slot layer 1 held, whose 5 new positions go back to its host copy first.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kv_ops.transfer.slot_loads import SlotLoads
    from kv_ops.transfer.slot_plan import plan_slots

    g = torch.Generator().manual_seed(4)
    loads = SlotLoads(f"prefetch-contract-{device}")
    keys = torch.randn(2, 3, 1, 8, generator=g).to(device)
    lengths = [torch.tensor(n, device=device) for n in (9, 14, 9, 9)]
    loads.allocate(plan_slots(4, 2), keys, keys.clone(), 16, lengths)
    for pair in loads.host.values():
        for t in pair:
            t.copy_(torch.randn(t.shape, generator=g))
    slot_k, slot_v = loads.slots[loads.plan.slot[2]]
    for t in (slot_k, slot_v):
        t.copy_(torch.randn(t.shape, generator=g))  # layer 1's keys and values, 14 positions written
    loads.saved[1] = 9  # 9 of them on the host: positions 9-13 go back
    host_k, host_v = loads.host_views[2]
    args = (slot_k, slot_v, keys, lengths[2], lengths[1], host_k, host_v, loads.saved[:1], loads.name, 2)
    kept = [a.clone() for a in args[2:8]]
    evicted = slot_k[:, :, 9:14].cpu()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        assert torch.ops.kv_ops.prefetch_layer(*fakes) is None
    torch.ops.kv_ops.prefetch_layer(*args)
    if device == "cuda":
        torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(args[2:8], kept, strict=True))  # inputs not declared mutated
    assert torch.equal(slot_k[:, :, :9].cpu(), loads.host[2][0][:, :, :9])  # the slots are: layer 2 landed
    assert torch.equal(slot_v[:, :, :9].cpu(), loads.host[2][1][:, :, :9])
    assert torch.equal(loads.host[1][0][:, :, 9:14], evicted)  # after layer 1's new positions went back
    assert int(loads.saved[2]) == 9  # layer 2 has 9 positions on the host, all in its slot now
