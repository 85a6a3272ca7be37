"""torch.library.opcheck on every ple_ops op, against a layer armed in this process."""

import pytest
import torch

import ple_ops

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture
def armed():
    buf = ple_ops.SharedHostBuffer(64 + 8 * 64)
    flag = ple_ops.CpuGpuSemaphore.in_host_memory(buf.view(0, (1,), torch.int32))
    flag.host_signal()  # raised: wait and wait_copy return at once, as often as opcheck calls them
    slot = buf.view(64, (8, 64), torch.uint8)
    slot.copy_(torch.randint(0, 256, slot.shape, dtype=torch.uint8))
    ple_ops.arm(ple_ops.ArmedLayer("opcheck.ple", flag, slot))
    yield
    ple_ops.disarm("opcheck.ple")
    buf.unlink()


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_wait(armed, device):
    out = torch.randn(8, 16, device=device)
    torch.library.opcheck(torch.ops.ple_ops.wait.default, (out, torch.randn(3, device=device), "opcheck.ple"))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_wait_copy(armed, device):
    out = torch.randn(8, 16, device=device)
    torch.library.opcheck(torch.ops.ple_ops.wait_copy.default, (out, torch.randn(3, device=device), 5, "opcheck.ple"))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_release(armed, device):
    out = torch.randn(8, 16, device=device)
    torch.library.opcheck(torch.ops.ple_ops.release.default, (out, "opcheck.ple"))
