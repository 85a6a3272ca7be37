"""The GPU path of the PLE ops and of the runtime's step guard, run on the CPU: the ops' CUDA
kernels are called directly against a recording stand-in for the bound driver, so the sequence of
stream operations, the stream they go to, and the handles bound once can be checked without a
GPU. (The real driver path runs in compile_tests/ple_ops/test_cuda_graph.py, on a GPU.)"""

import random
import time

import pytest
import torch
from ple_models import DIM, LAYERS, VOCAB, make_model

import ple_ops
from ple_ops import ops, semaphore
from ple_ops.runtime.control import IDLE, WAITING, Word
from ple_ops.semaphore import DONE, RESET

SUCCESS = 0


class Handle:
    """A driver handle: an int with an identity (as cuda-bindings' CUdeviceptr and CUstream are)."""

    def __init__(self, value):
        self.value = int(value)

    def __int__(self):
        return self.value


class RecordingDriver:
    """What ``semaphore.BoundDriver`` offers the ops, recording every stream operation."""

    success = SUCCESS
    wait_eq = "EQ"

    def __init__(self):
        self.calls = []
        self.stream = Handle(0x5000)
        self.pointers = 0  # device-pointer handles built
        self.fail = None  # the name of a call that returns an error

    def current_stream(self):
        return self.stream

    def CUdeviceptr(self, address):
        self.pointers += 1
        return Handle(address)

    def _result(self, name):
        return (1,) if self.fail == name else (SUCCESS,)

    def write_value32(self, stream, address, value, flags):
        self.calls.append(("write", int(stream), int(address), value))
        return self._result("write")

    def wait_value32(self, stream, address, value, flags):
        assert flags == self.wait_eq
        self.calls.append(("wait", int(stream), int(address), value))
        return self._result("wait")

    def memcpy_htod(self, dst, src, nbytes, stream):
        self.calls.append(("copy", int(stream), int(dst), src, nbytes))
        return self._result("copy")


@pytest.fixture
def drv(monkeypatch):
    fake = RecordingDriver()
    monkeypatch.setattr(semaphore, "bound_driver", lambda: fake)
    monkeypatch.setattr(ops, "bound_driver", lambda: fake)

    def failed(result, what):
        raise RuntimeError(f"{what} failed: code {result[0]}")

    monkeypatch.setattr(semaphore, "check_driver", failed)
    monkeypatch.setattr(ops, "check_driver", failed)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # nothing is captured here
    return fake


@pytest.fixture
def gpu_layer():
    """A layer armed by hand whose flag and waiting word have (made-up) device addresses."""
    rng = random.Random(7)
    flag_address, waiting_address = rng.randrange(1 << 40, 1 << 44, 64), rng.randrange(1 << 40, 1 << 44, 64)
    flag = ple_ops.CpuGpuSemaphore(torch.zeros(1, dtype=torch.int32), flag_address)
    waiting = ple_ops.CpuGpuSemaphore(torch.zeros(1, dtype=torch.int32), waiting_address)
    slot = torch.randint(0, 256, (16, 128), dtype=torch.uint8)
    layer = ple_ops.ArmedLayer("gpu.ple", flag, slot, waiting=waiting)
    ple_ops.arm(layer)
    yield layer
    ple_ops.disarm("gpu.ple")


def test_each_op_enqueues_its_stream_operations_in_order_on_the_current_stream(drv, gpu_layer):
    flag, waiting = gpu_layer.flag.device_address, gpu_layer.waiting.device_address
    out = torch.empty(16, 32)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        n = int(torch.randint(1, 17, (1,), generator=gen))
        drv.stream = Handle(int(torch.randint(1, 1 << 30, (1,), generator=gen)))  # e.g. a capture's stream
        s = int(drv.stream)
        drv.calls.clear()
        ops.wait_copy_cuda(out, torch.zeros(1), n, "gpu.ple")
        assert drv.calls == [
            ("write", s, waiting, WAITING),
            ("wait", s, flag, DONE),
            ("copy", s, out.data_ptr(), gpu_layer.slot.data_ptr(), n * 128),
        ]
        drv.calls.clear()
        ops.wait_cuda(out, torch.zeros(1), "gpu.ple")
        assert drv.calls == [("write", s, waiting, WAITING), ("wait", s, flag, DONE)]
        drv.calls.clear()
        ops.release_cuda(out, "gpu.ple")
        assert drv.calls == [
            ("write", s, waiting, WAITING),
            ("wait", s, flag, DONE),
            ("write", s, waiting, IDLE),
            ("write", s, flag, RESET),
        ]
    drv.calls.clear()
    ops.wait_copy_cuda(out, torch.zeros(1), 0, "gpu.ple")  # no rows: the wait, no copy
    assert [c[0] for c in drv.calls] == ["write", "wait"]
    # The flag's, the waiting word's and out's handles were each built once, not once per call.
    assert drv.pointers == 3
    other = torch.empty(16, 32)
    ops.wait_copy_cuda(other, torch.zeros(1), 2, "gpu.ple")  # another buffer: its own handle
    assert drv.pointers == 4 and drv.calls[-1][2] == other.data_ptr()


class AnsweringGuard:
    """A step guard that records what the ops hand it (and lets every operation through)."""

    def __init__(self):
        self.asked = []

    def before_stream_wait(self, name, num_tokens, captured):
        self.asked.append(("wait", name, num_tokens, captured))

    def before_stream_release(self, name, captured):
        self.asked.append(("release", name, captured))
        return True


def test_an_eager_op_asks_whether_it_is_captured_once_and_tells_its_guard(drv, gpu_layer, monkeypatch):
    # The capture query is a driver call (0.5 us back to back, 2-4 us inside a serving loop):
    # each op asks it once, and the guard decides on that answer instead of asking again.
    queries = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: queries.append(1) or False)
    gpu_layer.guard = guard = AnsweringGuard()
    out = torch.empty(16, 32)
    n = random.Random(5).randrange(1, 17)
    ops.wait_copy_cuda(out, torch.zeros(1), n, "gpu.ple")
    assert len(queries) == 1 and guard.asked == [("wait", "gpu.ple", n, False)]
    ops.release_cuda(out, "gpu.ple")
    assert len(queries) == 2 and guard.asked[1:] == [("release", "gpu.ple", False)]
    assert [c[0] for c in drv.calls] == ["write", "wait", "copy", "write", "wait", "write", "write"]


def test_a_capture_records_kernels_and_no_stream_operation(drv, gpu_layer, monkeypatch):
    """Memory-operation and memcpy nodes make every launch of a graph slow (ple_ops.kernels), so
    under capture each op records its kernels instead, over the layer's words and slot."""
    launches = []
    monkeypatch.setattr(ops, "capturing", lambda: True)
    monkeypatch.setattr(ops.kernels, "wait_copy", lambda *args: launches.append(("wait_copy", *args)))
    monkeypatch.setattr(ops.kernels, "release", lambda *args: launches.append(("release", *args)))
    views = []

    def view(host):  # a CPU stand-in for the device view: the same bytes
        views.append(host)
        return host

    monkeypatch.setattr(ops, "device_view", view)
    monkeypatch.setattr(semaphore, "device_view", view)
    out = torch.empty(16, 32)
    flag, waiting, slot = gpu_layer.flag.flag, gpu_layer.waiting.flag, gpu_layer.slot
    for n in (5, 0):
        ops.wait_copy_cuda(out, torch.zeros(1), n, "gpu.ple")
        kind, f, w, src, dst, nbytes = launches.pop()
        assert (kind, nbytes) == ("wait_copy", n * 128)
        assert f is flag and w is waiting and src is slot
        assert dst.dtype == torch.uint8 and dst.data_ptr() == out.data_ptr() and dst.numel() == out.numel() * 4
    ops.wait_cuda(out, torch.zeros(1), "gpu.ple")
    assert launches.pop()[-1] == 0  # the wait alone copies nothing
    ops.release_cuda(out, "gpu.ple")
    assert launches.pop() == ("release", flag, waiting)
    assert drv.calls == [] and launches == []
    # Bad input is refused before anything is recorded, captured or not.
    with pytest.raises(ValueError, match="num_tokens 17"):
        ops.wait_copy_cuda(out, torch.zeros(1), 17, "gpu.ple")
    assert drv.calls == [] and launches == []
    # A copy too large for the kernel to beat the copy engine: the wait kernel, then a memcpy node.
    monkeypatch.setattr(ops.kernels, "COPY_ENGINE_FROM", 5 * 128)
    ops.wait_copy_cuda(out, torch.zeros(1), 4, "gpu.ple")
    assert launches.pop()[-1] == 4 * 128 and drv.calls == []
    ops.wait_copy_cuda(out, torch.zeros(1), 5, "gpu.ple")
    assert launches.pop()[-1] == 0
    assert drv.calls == [("copy", int(drv.stream), out.data_ptr(), slot.data_ptr(), 5 * 128)]
    # The device views were made once each, not once per call.
    assert [id(t) for t in views] == [id(slot), id(flag), id(waiting)]


@pytest.mark.parametrize(
    "op, fail, message",
    [
        ("wait_copy", "copy", r"cuMemcpyHtoDAsync\(256 bytes for 'gpu.ple'\) failed"),
        ("wait_copy", "wait", r"cuStreamWaitValue32\(== 1\) failed"),
        ("release", "write", r"cuStreamWriteValue32\(1\) failed"),
    ],
)
def test_a_failed_driver_call_raises_with_the_call_named(drv, gpu_layer, op, fail, message):
    drv.fail = fail
    with pytest.raises(RuntimeError, match=message):
        if op == "wait_copy":
            ops.wait_copy_cuda(torch.empty(16, 32), torch.zeros(1), 2, "gpu.ple")
        else:
            ops.release_cuda(torch.empty(16, 32), "gpu.ple")


def test_the_bound_driver_keeps_one_handle_per_stream():
    bound = semaphore.BoundDriver()  # cuda-bindings builds handles without a GPU
    raw = [0]
    bound.raw_stream = lambda: raw[0]
    handles = {}
    for value in random.Random(11).sample(range(1, 1 << 40), 20) * 2:
        raw[0] = value
        handle = bound.current_stream()
        assert int(handle) == value
        assert handles.setdefault(value, handle) is handle  # built once, then the same object
    for value in range(1, 2 * semaphore.BoundDriver.MAX_STREAMS):  # the table stays bounded
        raw[0] = value
        assert int(bound.current_stream()) == value
    assert len(bound.streams) <= semaphore.BoundDriver.MAX_STREAMS


# --- the runtime's guard on the GPU path ----------------------------------------------------------

NAMES = [f"blocks.{i}.ple" for i in range(LAYERS)]


@pytest.fixture
def gpu_runtime(monkeypatch):
    """A CPU runtime whose step transaction runs its GPU branches (nothing is captured here): what
    the CUDA ops ask the guard is asked by the test, and the stream's resets are done by hand."""
    rt = ple_ops.OffloadRuntime(make_model, max_tokens=8, device="cpu", step_timeout=2.0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    rt.on_gpu = True
    yield rt
    rt.on_gpu = False
    rt.close()


def stream_resets(rt, names=NAMES):
    """What a replayed graph's releases do: once a layer's rows of the last step are there, reset its flag."""
    deadline = time.monotonic() + rt.step_timeout
    control = rt.control
    for n in names:
        while not (
            ple_ops.lookup(n).flag.host_value() == DONE
            and control.delivered(NAMES.index(n)) == control.get(Word.REQUEST)
        ):
            assert time.monotonic() < deadline, "the offload process did not publish the step"
            time.sleep(1e-4)
        ple_ops.lookup(n).flag.host_reset()


def test_the_gpu_step_transaction_tells_a_replay_from_an_eager_forward(gpu_runtime):
    rt, guard = gpu_runtime, ple_ops.lookup(NAMES[0]).guard
    gen = torch.Generator().manual_seed(12)
    for _ in range(3):
        # A replay: no op executes on the host; the graph's releases reset the flags.
        rt.prepare(torch.randint(0, VOCAB, (4,), generator=gen))
        stream_resets(rt)
        rt.release(enqueue=False)

        # An eager forward whose releases are missing: enqueue=False is refused, and repaired
        # (here the runtime's own releases run the CPU kernel, which waits and resets).
        rt.prepare(torch.randint(0, VOCAB, (4,), generator=gen))
        for n in NAMES[:2]:
            guard.before_stream_wait(n, 4, False)
        with pytest.raises(ple_ops.OffloadError, match=r"did not release \['blocks\.0\.ple', 'blocks\.1\.ple'\]"):
            rt.release(enqueue=False)
        assert [ple_ops.lookup(n).flag.host_value() for n in NAMES[:2]] == [RESET, RESET]
        stream_resets(rt, NAMES[2:])  # the third layer: as its stream would

        # An eager forward with its releases: each layer is released once per step.
        rt.prepare(torch.randint(0, VOCAB, (4,), generator=gen))
        for n in NAMES:
            guard.before_stream_wait(n, 4, False)
        with pytest.raises(ple_ops.OffloadError, match="the forward has 3 tokens but the prepared step has 4"):
            guard.before_stream_wait(NAMES[1], 3, False)
        assert [guard.before_stream_release(n, False) for n in NAMES] == [True] * LAYERS
        assert [guard.before_stream_release(n, False) for n in NAMES] == [False] * LAYERS
        with pytest.raises(ple_ops.OffloadError, match="already released in this step"):
            guard.before_stream_wait(NAMES[1], 4, False)
        stream_resets(rt)
        rt.release(enqueue=False)
    with pytest.raises(ple_ops.OffloadError, match="no step prepared"):
        guard.before_stream_wait(NAMES[0], 4, False)
    with pytest.raises(ple_ops.OffloadError, match="released with no step prepared"):
        guard.before_stream_release(NAMES[0], False)
    # ... and the runtime serves on, with the local model's rows.
    ids, hidden = torch.randint(0, VOCAB, (5,), generator=gen), torch.randn(5, DIM, generator=gen)
    rt.on_gpu = False
    rt.prepare(ids)
    torch.testing.assert_close(rt.model(hidden, ids), make_model()(hidden, ids), rtol=0, atol=0)
    rt.release()
