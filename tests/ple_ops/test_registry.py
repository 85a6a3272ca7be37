"""ple_ops.arm: every field of an ArmedLayer is checked before the name is armed, so that a lookup
never meets a layer the ops cannot serve (or a name it cannot sort)."""

import pytest
import torch

import ple_ops
from ple_ops import registry


def host_flag():
    return ple_ops.CpuGpuSemaphore.in_host_memory(torch.zeros(1, dtype=torch.int32), map_for_gpu=False)


def random_slot(seed, rows=4, row_bytes=8):
    return torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def served():
    """One layer armed by hand, ``served``, whose raised flag and random slot the refused ones must not disturb."""
    layer = ple_ops.ArmedLayer("served", host_flag(), random_slot(11))
    ple_ops.arm(layer)
    layer.flag.host_signal()
    yield layer
    ple_ops.disarm("served")


class NotAGuard:
    def host_wait(self, name, num_tokens):  # the other three methods of a StepGuard are missing
        pass


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(name=None), r"ple_ops.arm: layer.name must be a non-empty string, got None"),
        (dict(name=""), r"ple_ops.arm: layer.name must be a non-empty string, got ''"),
        (dict(name=5), r"ple_ops.arm: layer.name must be a non-empty string, got 5"),
        (dict(flag=None), r"ple_ops.arm: layer.flag of 'refused' must be a CpuGpuSemaphore, got None"),
        (
            dict(slot=torch.empty(4, 8, dtype=torch.uint8, device="meta")),
            r"ple_ops.arm: layer.slot of 'refused' must be a uint8 \[max_tokens, row_bytes\] tensor in host memory, "
            r"got a torch.uint8 tensor of shape \(4, 8\) on meta",
        ),
        (dict(slot=None), r"ple_ops.arm: layer.slot of 'refused' must be a uint8 .* got None"),
        (dict(slot=torch.zeros(32, dtype=torch.uint8)), r"layer.slot of 'refused' must be a uint8 .* shape \(32,\)"),
        (dict(check=None), r"ple_ops.arm: layer.check of 'refused' must be a callable .* got None"),
        (dict(out="buffer"), r"ple_ops.arm: layer.out of 'refused' must be a tensor or None, got 'buffer'"),
        (dict(waiting=1), r"ple_ops.arm: layer.waiting of 'refused' must be a CpuGpuSemaphore or None, got 1"),
        (dict(guard=NotAGuard()), r"ple_ops.arm: layer.guard of 'refused' must be a StepGuard or None, got <"),
    ],
    ids=[
        "name-none",
        "name-empty",
        "name-int",
        "flag",
        "slot-meta",
        "slot-none",
        "slot-1d",
        "check",
        "out",
        "waiting",
        "guard",
    ],
)
def test_arm_refuses_each_field_that_is_not_what_the_layer_needs_and_arms_nothing(served, fields, message):
    values = dict(name="refused", flag=host_flag(), slot=random_slot(12)) | fields
    layer = ple_ops.ArmedLayer(values.pop("name"), values.pop("flag"), values.pop("slot"), **values)
    with pytest.raises(ValueError, match=message):
        ple_ops.arm(layer)
    # Nothing armed, and the registry still sorts its names and answers unknown ones plainly.
    assert ple_ops.armed_names() == ["served"]
    with pytest.raises(
        ValueError, match=r"ple_ops.lookup: no armed layer named 'refused' in this process \(live: 'served'\)"
    ):
        ple_ops.lookup("refused")
    out = torch.randn(4, 2, generator=torch.Generator().manual_seed(13))
    assert torch.equal(ple_ops.wait_copy(out, torch.zeros(1), 4, "served").view(torch.uint8), served.slot)


def test_arm_refuses_what_is_not_an_armed_layer():
    with pytest.raises(ValueError, match=r"ple_ops.arm: layer must be an ArmedLayer, got 'layer'"):
        ple_ops.arm("layer")
    assert ple_ops.armed_names() == []


def test_arm_refuses_a_slot_replaced_after_the_layer_bound_its_address():
    # The ops copy from the address and rows bound when the layer was made, not from layer.slot.
    layer = ple_ops.ArmedLayer("replaced", host_flag(), random_slot(14))
    layer.slot = random_slot(15, rows=8)
    with pytest.raises(ValueError, match=r"ple_ops.arm: layer.slot of 'replaced' was replaced after the layer"):
        ple_ops.arm(layer)
    made_without = ple_ops.ArmedLayer("late", host_flag(), None)  # made, so that arm can name the field
    made_without.slot = random_slot(16)
    with pytest.raises(ValueError, match=r"layer.slot of 'late' was replaced"):
        ple_ops.arm(made_without)
    assert ple_ops.armed_names() == []


def test_a_guard_with_every_step_guard_method_is_armed():
    class Guard:
        def host_wait(self, name, num_tokens): ...
        def host_release(self, name): ...
        def before_stream_wait(self, name, num_tokens, captured): ...
        def before_stream_release(self, name, captured): ...

    layer = ple_ops.ArmedLayer("guarded", host_flag(), random_slot(17), guard=Guard())
    ple_ops.arm(layer)
    try:
        assert registry.lookup("guarded") is layer
    finally:
        ple_ops.disarm("guarded")
