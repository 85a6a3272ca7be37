"""Shared host buffers and the host form of the flag, across real processes (spawn, no CUDA)."""

import multiprocessing
import os
import re
import stat
import threading

import numpy
import pytest
import torch

import ple_ops
from ple_ops.semaphore import DONE, RESET, spin_wait


def _child_writes_rows_then_signals(handle, rows, dim, seed):
    buf = ple_ops.SharedHostBuffer.attach(handle)
    flag = ple_ops.CpuGpuSemaphore.in_host_memory(buf.view(0, (1,), torch.int32), map_for_gpu=False)
    data = buf.view(64, (rows, dim), torch.float32)
    flag.host_wait(RESET, timeout=10)
    data.copy_(torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed)))
    flag.host_signal()


def test_a_cuda_free_process_publishes_rows_through_shared_memory_and_the_flag():
    buf = ple_ops.SharedHostBuffer(64 + 16 * 32 * 4)
    buf.bytes.fill_(0xFF)
    flag = ple_ops.CpuGpuSemaphore.in_host_memory(buf.view(0, (1,), torch.int32), map_for_gpu=False)
    flag.host_reset()
    child = multiprocessing.get_context("spawn").Process(
        target=_child_writes_rows_then_signals, args=(buf.handle, 16, 32, 5)
    )
    child.start()
    try:
        flag.host_wait(DONE, timeout=60)
        child.join(10)
    finally:
        if child.is_alive():  # never leave a child behind a failed wait
            child.kill()
            child.join(10)
    want = torch.randn(16, 32, generator=torch.Generator().manual_seed(5))
    assert torch.equal(buf.view(64, (16, 32), torch.float32), want)
    assert child.exitcode == 0
    buf.unlink()


def test_shared_buffer_file_is_private_exclusive_and_removed_on_unlink():
    buf = ple_ops.SharedHostBuffer(4096)
    mode = os.stat(buf.handle.path).st_mode
    assert stat.S_IMODE(mode) == 0o600
    buf.unlink()
    assert not os.path.exists(buf.handle.path)
    with pytest.raises(FileNotFoundError):
        ple_ops.SharedHostBuffer.attach(buf.handle)


def test_view_outside_the_buffer_is_rejected():
    buf = ple_ops.SharedHostBuffer(128)
    with pytest.raises(ValueError, match="do not fit 128"):
        buf.view(64, (20,), torch.float32)
    buf.unlink()


def test_spin_wait_times_out_and_runs_the_producer_check():
    calls = []
    with pytest.raises(TimeoutError, match="did not become 1 within 0.300"):
        spin_wait(lambda: 0, 1, "test", check=lambda: calls.append(1), timeout=0.3)
    assert len(calls) >= 3  # about every 10 ms; a loaded machine may stretch the sleeps

    def dead():
        raise ple_ops.ProducerFailed("producer gone")

    # The check's raise ends the wait (how often it runs is shown above); the timeout only turns a
    # wait it did not end into a TimeoutError instead of a hang.
    with pytest.raises(ple_ops.ProducerFailed, match="producer gone"):
        spin_wait(lambda: 0, 1, "test", check=dead, timeout=60)


def test_a_device_flag_on_the_cpu_is_a_value_error_naming_the_device():
    with pytest.raises(ValueError, match=r"CpuGpuSemaphore\.in_device_memory: device must be a CUDA device, got 'cpu'"):
        ple_ops.CpuGpuSemaphore.in_device_memory("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is there")
def test_a_device_flag_without_cuda_is_a_value_error_before_anything_is_allocated():
    with pytest.raises(ValueError, match=r"CpuGpuSemaphore\.in_device_memory: device .*but this machine has"):
        ple_ops.CpuGpuSemaphore.in_device_memory()


def host_flag(seed):
    """A host flag holding a random value that no test waits for."""
    flag = ple_ops.CpuGpuSemaphore.in_host_memory(torch.zeros(1, dtype=torch.int32), map_for_gpu=False)
    flag.flag.fill_(int(torch.randint(2, 1 << 30, (1,), generator=torch.Generator().manual_seed(seed))))
    return flag


@pytest.mark.parametrize(
    "flag, address, message",
    [
        (None, None, r"CpuGpuSemaphore: flag must be a one-element int32 tensor, got None"),
        (torch.zeros(1, dtype=torch.int64), None, r"CpuGpuSemaphore: flag must be one int32 .* got torch.int64 \(1,\)"),
        (torch.zeros(1, dtype=torch.int32, device="meta"), None, r"flag must be one int32 on the CPU .* on meta"),
        (torch.zeros(1, dtype=torch.int32), "0x1000", r"CpuGpuSemaphore: device_address must be a positive integer"),
        (
            torch.zeros(1, dtype=torch.int32),
            True,
            r"CpuGpuSemaphore: device_address must be a positive integer, got True",
        ),
    ],
    ids=["none", "int64", "meta", "str-address", "bool-address"],
)
def test_a_semaphore_over_no_int32_flag_is_a_value_error(flag, address, message):
    with pytest.raises(ValueError, match=message):
        ple_ops.CpuGpuSemaphore(flag, address)


@pytest.mark.parametrize(
    "flag, map_for_gpu, message",
    [
        (None, None, r"in_host_memory: flag must be a one-element int32 view of host memory, got None"),
        (
            torch.zeros(1, dtype=torch.int32, device="meta"),
            False,
            r"in_host_memory: flag must be .* host memory, got a torch.int32 tensor of shape \(1,\) on meta",
        ),
        (
            torch.zeros(1, dtype=torch.int32),
            "yes",
            r"in_host_memory: map_for_gpu must be True, False or None, got 'yes'",
        ),
    ],
    ids=["none", "meta", "str-map"],
)
def test_a_host_flag_over_no_host_tensor_is_a_value_error(flag, map_for_gpu, message):
    with pytest.raises(ValueError, match=rf"CpuGpuSemaphore\.{message}"):
        ple_ops.CpuGpuSemaphore.in_host_memory(flag, map_for_gpu)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is there")
def test_mapping_a_host_flag_for_a_gpu_this_machine_lacks_is_a_value_error():
    with pytest.raises(ValueError, match=r"in_host_memory: map_for_gpu is True, but this machine has no CUDA device"):
        ple_ops.CpuGpuSemaphore.in_host_memory(torch.zeros(1, dtype=torch.int32), map_for_gpu=True)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(timeout=-1), r"timeout must be a finite number of seconds > 0, got -1"),
        (dict(timeout=0), r"timeout must be a finite number of seconds > 0, got 0"),
        (dict(timeout=True), r"timeout must be a finite number of seconds > 0, got True"),
        (dict(timeout="x"), r"timeout must be a finite number of seconds > 0, got 'x'"),
        (dict(timeout=float("nan")), r"timeout must be a finite number of seconds > 0, got nan"),
        (dict(check="x", timeout=2.0), r"check must be a callable or None, got 'x'"),
        (dict(value=None, timeout=2.0), r"value must be an integer a 32-bit flag holds, got None"),
        (dict(value=True, timeout=2.0), r"value must be an integer a 32-bit flag holds, got True"),
        (dict(value=1.0, timeout=2.0), r"value must be an integer a 32-bit flag holds, got 1.0"),
        (dict(value=2**31, timeout=2.0), r"value must be an integer a 32-bit flag holds, got 2147483648"),
    ],
    ids=["neg", "zero", "bool", "str", "nan", "check", "value-none", "value-bool", "value-float", "value-wide"],
)
def test_host_wait_refuses_what_it_cannot_wait_for_at_once(kwargs, message):
    # Each used to wait out its timeout (or time out at once, or for True seconds, or for ever with
    # a NaN), or to raise a TypeError. On a thread of its own: a wait that never ends fails here.
    flag = host_flag(len(message))
    kwargs = dict(value=DONE) | kwargs
    ended = []

    def wait():
        try:
            flag.host_wait(kwargs.pop("value"), **kwargs)
        except BaseException as error:  # handed to the test's thread
            ended.append(error)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(30)
    assert not waiter.is_alive(), "the wait did not end"
    assert len(ended) == 1 and isinstance(ended[0], ValueError), ended
    # A ValueError, not the TimeoutError of a wait that ran out: refused before waiting.
    assert re.match(rf"CpuGpuSemaphore\.host_wait: {message}", str(ended[0])), ended[0]


def test_host_wait_takes_an_integer_timeout_and_a_numpy_value():
    flag = host_flag(21)
    flag.host_wait(numpy.int32(flag.host_value()), timeout=1)
    with pytest.raises(TimeoutError, match="did not become 1 within 0.050"):
        flag.host_wait(DONE, timeout=0.05)


@pytest.mark.parametrize("op", ["signal", "reset", "wait_done", "write"])
def test_a_stream_operation_on_a_flag_with_no_device_address_is_a_value_error_saying_what_it_needs(op):
    flag = host_flag(22)
    value = flag.host_value()
    call = getattr(flag, op)
    with pytest.raises(
        ValueError, match=rf"^CpuGpuSemaphore\.{op}: stream operations need CUDA and the flag's device "
    ):
        call(7) if op == "write" else call()
    assert flag.host_value() == value
    with pytest.raises(ValueError, match=r"^CpuGpuSemaphore\.device_address: stream operations need CUDA"):
        assert flag.device_address is None  # raises first
