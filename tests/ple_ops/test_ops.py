"""The PLE ops on the CPU path: the registry, bounds, the copy itself, release, observation."""

import inspect
import re
import threading

import pytest
import torch

import ple_ops
from ple_ops.semaphore import DONE, RESET


@pytest.fixture
def armed():
    """One armed layer ``test.ple`` with a 16 x 32 float32 slot, flag reset, slot random."""
    buf = ple_ops.SharedHostBuffer(64 + 16 * 128)
    flag = ple_ops.CpuGpuSemaphore.in_host_memory(buf.view(0, (1,), torch.int32), map_for_gpu=False)
    flag.host_reset()
    slot = buf.view(64, (16, 128), torch.uint8)
    slot.copy_(torch.randint(0, 256, slot.shape, dtype=torch.uint8))
    layer = ple_ops.ArmedLayer("test.ple", flag, slot)
    ple_ops.arm(layer)
    yield layer
    ple_ops.disarm("test.ple")
    buf.unlink()


def poisoned(rows=16, dim=32):
    return torch.full((rows, dim), float("nan"))


def test_wait_copy_waits_for_the_flag_then_copies_exactly_num_tokens_rows(armed):
    out = poisoned()
    producer = threading.Timer(0.05, armed.flag.host_signal)
    producer.start()
    rows = ple_ops.wait_copy(out, torch.zeros(1), 5, "test.ple")
    assert torch.equal(rows.view(torch.uint8), armed.slot[:5])
    assert out[5:].isnan().all()  # rows past num_tokens untouched
    assert armed.flag.host_value() == DONE  # the pull does not reset
    ple_ops.release(out, "test.ple")
    assert armed.flag.host_value() == RESET


@pytest.mark.parametrize(
    "op, call",
    [
        ("ple_ops.wait_copy", lambda out: ple_ops.wait_copy(out, torch.zeros(1), 1, "nope")),
        ("ple_ops.wait", lambda out: ple_ops.wait(out, torch.zeros(1), "nope")),
        ("ple_ops.release", lambda out: ple_ops.release(out, "nope")),
        ("ple_ops.lookup", lambda out: ple_ops.lookup("nope")),
    ],
    ids=["wait_copy", "wait", "release", "lookup"],
)
def test_unknown_name_is_a_value_error_listing_the_armed_names(armed, op, call):
    armed.flag.host_signal()
    out = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))
    before = out.clone()
    with pytest.raises(ValueError, match=rf"{op}: no armed layer named 'nope' in this process \(live: 'test.ple'\)"):
        call(out)
    assert torch.equal(out, before) and armed.flag.host_value() == DONE


def test_a_hand_armed_wait_whose_flag_is_never_raised_ends_in_an_error_after_its_timeout(armed):
    # No runtime watches a layer armed by hand: its own timeout is all that ends the wait.
    assert armed.timeout == ple_ops.registry.STEP_TIMEOUT_S  # the default, the runtime's step_timeout's
    assert inspect.signature(ple_ops.OffloadRuntime).parameters["step_timeout"].default == armed.timeout
    armed.timeout = 0.2
    out = torch.randn(16, 32, generator=torch.Generator().manual_seed(4))
    before, ended = out.clone(), []

    def pull():
        try:
            ple_ops.wait_copy(out, torch.zeros(1), 3, "test.ple")
        except BaseException as error:  # handed to the test's thread
            ended.append(error)

    puller = threading.Thread(target=pull, daemon=True)
    puller.start()
    puller.join(armed.timeout + 120)  # a wait that never ends fails here instead of hanging the suite
    assert not puller.is_alive(), "the wait did not end"
    assert len(ended) == 1 and isinstance(ended[0], ple_ops.ProducerFailed), ended
    assert "'test.ple': its flag was not raised within its timeout of 0.2 s" in str(ended[0])
    assert torch.equal(out, before)  # nothing copied


def test_arm_refuses_a_strided_slot_whose_rows_are_not_one_run_of_bytes():
    gen = torch.Generator().manual_seed(5)
    base = torch.randint(0, 256, (16, 8), dtype=torch.uint8, generator=gen)
    flag = ple_ops.CpuGpuSemaphore.in_host_memory(torch.zeros(1, dtype=torch.int32), map_for_gpu=False)
    with pytest.raises(
        ValueError, match=r"ple_ops.arm: layer.slot of 'strided' must be contiguous, got shape \(8, 8\)"
    ):
        ple_ops.arm(ple_ops.ArmedLayer("strided", flag, base[::2]))
    assert "strided" not in ple_ops.armed_names()


@pytest.mark.parametrize("timeout", [True, 0, -1.0, float("nan"), float("inf"), "1"])
def test_arm_refuses_a_timeout_that_is_not_seconds(timeout):
    flag = ple_ops.CpuGpuSemaphore.in_host_memory(torch.zeros(1, dtype=torch.int32), map_for_gpu=False)
    slot = torch.randint(0, 256, (4, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    with pytest.raises(ValueError, match=r"ple_ops.arm: layer.timeout of 'timed' must be a finite number of seconds"):
        ple_ops.arm(ple_ops.ArmedLayer("timed", flag, slot, timeout=timeout))
    assert "timed" not in ple_ops.armed_names()


@pytest.mark.parametrize("num_tokens", [True, 2.5, "3", None, -1, -17])
def test_a_token_count_that_is_not_an_integer_is_a_value_error_before_any_copy(armed, num_tokens):
    armed.flag.host_signal()
    out = torch.randn(16, 32, generator=torch.Generator().manual_seed(7))
    before = out.clone()
    with pytest.raises(ValueError, match=rf"ple_ops.wait_copy: num_tokens must be an integer >= 0, got {num_tokens!r}"):
        ple_ops.wait_copy(out, torch.zeros(1), num_tokens, "test.ple")
    assert torch.equal(out, before)


@pytest.mark.parametrize(
    "out, num_tokens, message",
    [
        (poisoned(16, 32), 17, r"num_tokens 17 for layer 'test.ple' exceeds the buffer's 16 rows or the slot's 16"),
        (poisoned(8, 32), 9, r"num_tokens 9 .* exceeds the buffer's 8 rows"),
        (
            poisoned(16, 16),
            1,
            r"out rows hold 64 bytes \(16 x torch.float32\) but layer 'test.ple' produces rows of 128",
        ),
        (poisoned(16, 32)[:, :16], 1, r"must be a contiguous 2-D"),
    ],
    ids=["more-than-slot", "more-than-buffer", "row-size", "not-contiguous"],
)
def test_bad_pull_is_rejected_before_waiting_or_copying(armed, out, num_tokens, message):
    armed.flag.host_signal()
    before = out.clone()
    with pytest.raises(ValueError, match=message):
        ple_ops.wait_copy(out, torch.zeros(1), num_tokens, "test.ple")
    assert torch.equal(out.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize(
    "op, call",
    [
        ("ple_ops.wait_copy", lambda out: ple_ops.wait_copy(out, torch.zeros(1), 5, "test.ple")),
        ("ple_ops.wait", lambda out: ple_ops.wait(out, torch.zeros(1), "test.ple")),
        ("ple_ops.release", lambda out: ple_ops.release(out, "test.ple")),
    ],
    ids=["wait_copy", "wait", "release"],
)
@pytest.mark.parametrize(
    "out, shown",
    [
        (torch.empty(16, 32, device="meta"), r"a torch.float32 tensor of shape \(16, 32\) on meta"),
        (None, "None"),
        ([1.5, 2.5], "list with 2 entries"),
    ],
    ids=["meta", "none", "list"],
)
def test_an_out_that_is_no_cpu_or_cuda_tensor_is_a_value_error_and_the_flag_is_left_alone(armed, op, call, out, shown):
    # A meta out would dispatch to the op's fake: no wait, no copy, no reset, and no error.
    armed.flag.host_signal()
    slot = armed.slot.clone()
    with pytest.raises(
        ValueError, match=rf"^{op}: out must be the layer's buffer on the CPU or a CUDA device, got {shown}"
    ):
        call(out)
    assert armed.flag.host_value() == DONE and torch.equal(armed.slot, slot)


def test_wait_returns_once_signalled_and_raises_when_the_producer_fails(armed):
    armed.flag.host_signal()
    ple_ops.wait(poisoned(), torch.zeros(1), "test.ple")
    armed.flag.host_reset()

    def failed():
        raise ple_ops.ProducerFailed("the offload process died")

    armed.check = failed
    with pytest.raises(ple_ops.ProducerFailed, match="died"):
        ple_ops.wait(poisoned(), torch.zeros(1), "test.ple")


def test_observe_copy_geometry_records_executed_pulls(armed):
    armed.flag.host_signal()
    out = poisoned()
    with ple_ops.observe_copy_geometry() as copies:
        ple_ops.wait_copy(out, torch.zeros(1), 3, "test.ple")
        ple_ops.wait_copy(out, torch.zeros(1), 0, "test.ple")
    assert copies == [("test.ple", 3, 384), ("test.ple", 0, 0)]
    with ple_ops.observe_copy_geometry():
        with pytest.raises(RuntimeError, match="cannot be nested"):
            with ple_ops.observe_copy_geometry():
                pass


def test_arming_a_name_twice_is_an_error(armed):
    with pytest.raises(ValueError, match="already armed"):
        ple_ops.arm(armed)


class RecordingGuard:
    """A step guard that records what the ops ask, and refuses when told to."""

    def __init__(self, layer):
        self.layer, self.calls, self.refuse = layer, [], None

    def host_wait(self, name, num_tokens):
        self.calls.append(("host_wait", name, num_tokens))
        if self.refuse:
            raise ple_ops.OffloadError(self.refuse)
        self.layer.flag.host_wait(DONE, timeout=5)

    def host_release(self, name):
        self.calls.append(("host_release", name))
        self.layer.flag.host_reset()

    def before_stream_wait(self, name, num_tokens, captured):  # GPU path only
        raise AssertionError("not on the CPU path")

    def before_stream_release(self, name, captured):
        raise AssertionError("not on the CPU path")


def test_a_guarded_layer_waits_and_releases_through_its_guard(armed):
    guard = armed.guard = RecordingGuard(armed)
    armed.flag.host_signal()
    out = poisoned()
    rows = ple_ops.wait_copy(out, torch.zeros(1), 6, "test.ple")
    assert torch.equal(rows.view(torch.uint8), armed.slot[:6])
    ple_ops.wait(out, torch.zeros(1), "test.ple")
    ple_ops.release(out, "test.ple")
    assert guard.calls == [("host_wait", "test.ple", 6), ("host_wait", "test.ple", None), ("host_release", "test.ple")]
    assert armed.flag.host_value() == RESET


def test_a_guard_that_refuses_stops_the_pull_before_any_copy(armed):
    armed.guard = RecordingGuard(armed)
    armed.guard.refuse = "no step prepared"
    out = poisoned()
    with pytest.raises(ple_ops.OffloadError, match="no step prepared"):
        ple_ops.wait_copy(out, torch.zeros(1), 4, "test.ple")
    assert out.isnan().all()


def test_a_name_disarmed_with_a_reason_raises_it_until_armed_again(armed):
    ple_ops.disarm("test.ple", lambda: ple_ops.OffloadError("the OffloadRuntime is closed", fatal=True))
    assert ple_ops.armed_names() == []
    for _ in range(2):
        with pytest.raises(ple_ops.OffloadError, match="closed") as e:
            ple_ops.wait_copy(poisoned(), torch.zeros(1), 1, "test.ple")
        assert e.value.fatal
    ple_ops.arm(armed)  # re-armed: served again, the reason forgotten
    armed.flag.host_signal()
    ple_ops.wait_copy(poisoned(), torch.zeros(1), 1, "test.ple")
    ple_ops.disarm("test.ple")
    with pytest.raises(ValueError, match="ple_ops.lookup: no armed layer named 'test.ple'"):
        ple_ops.lookup("test.ple")
    ple_ops.arm(armed)  # for the fixture's teardown


def test_the_op_schemas_declare_the_mutation_of_out_and_are_pt2_compliant():
    # Written by hand (torch.library.Library): the schemas must stay those that custom_op inferred.
    want = {
        "wait": "ple_ops::wait(Tensor(a0!) out, Tensor dep, str name) -> ()",
        "wait_copy": "ple_ops::wait_copy(Tensor(a0!) out, Tensor dep, SymInt num_tokens, str name) -> ()",
        "release": "ple_ops::release(Tensor(a0!) out, str name) -> ()",
    }
    for name, schema in want.items():
        op = getattr(torch.ops.ple_ops, name).default
        assert str(op._schema) == schema
        assert op._schema.arguments[0].alias_info.is_write
        assert torch.Tag.pt2_compliant_tag in op.tags


@pytest.mark.parametrize("dtype, dim", [(torch.float32, 32), (torch.bfloat16, 64), (torch.uint8, 128)])
def test_wait_copy_pulls_the_slot_bytes_into_an_offset_view_and_bumps_its_version(armed, dtype, dim):
    # out is a view into a larger buffer (storage offset): the copy must land at its own rows.
    gen = torch.Generator().manual_seed(int(dim))
    armed.slot.copy_(torch.randint(0, 256, armed.slot.shape, dtype=torch.uint8, generator=gen))
    armed.flag.host_signal()
    big = torch.randint(0, 256, (20, 128), dtype=torch.uint8, generator=gen).view(dtype)
    before = big.clone()
    out = big[3:19]
    for n in (int(torch.randint(1, 17, (1,), generator=gen)), 16, 0):
        version = out._version
        want = before[3:19].clone()
        ple_ops.reference.pull_rows(want, armed.slot, n)  # the oracle
        ple_ops.wait_copy(out, torch.zeros(1), n, "test.ple")
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
        assert out._version > version or n == 0
        # Nothing outside the view is touched.
        assert torch.equal(big[:3].view(torch.uint8), before[:3].view(torch.uint8))
        assert torch.equal(big[19:].view(torch.uint8), before[19:].view(torch.uint8))
        before[3:19] = out


# Each op's wrapper, called with a dep and a name (release takes no dep).
CALLS = {
    "ple_ops.wait_copy": lambda out, dep, name: ple_ops.wait_copy(out, dep, 5, name),
    "ple_ops.wait": lambda out, dep, name: ple_ops.wait(out, dep, name),
    "ple_ops.release": lambda out, dep, name: ple_ops.release(out, name),
}
BAD_ARGUMENTS = [(op, "name", name) for op in CALLS for name in (None, 5, "", b"test.ple")] + [
    (op, "dep", dep) for op in ("ple_ops.wait_copy", "ple_ops.wait") for dep in (None, 1.5)
]


@pytest.mark.parametrize("op, argument, value", BAD_ARGUMENTS, ids=[f"{o[8:]}-{a}-{v!r}" for o, a, v in BAD_ARGUMENTS])
def test_a_name_or_dep_of_another_type_is_a_value_error_naming_it_before_any_wait(armed, op, argument, value):
    # torch's schema check refused a name of None or 5 with a RuntimeError naming neither the op nor
    # the rule, and the ops took None for dep: the wait then came after nothing.
    armed.flag.host_signal()
    out = torch.randn(16, 32, generator=torch.Generator().manual_seed(len(BAD_ARGUMENTS)))
    before = out.clone()
    args = dict(dep=torch.zeros(1), name="test.ple") | {argument: value}
    rule = "must be a non-empty string" if argument == "name" else "must be the tensor the wait comes after"
    with pytest.raises(ValueError, match=rf"^{op}: {argument} {rule}, got {re.escape(repr(value))}"):
        CALLS[op](out, **args)
    assert torch.equal(out, before) and armed.flag.host_value() == DONE
