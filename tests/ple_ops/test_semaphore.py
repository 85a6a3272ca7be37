"""Shared host buffers and the host form of the flag, across real processes (spawn, no CUDA)."""

import multiprocessing
import os
import stat

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
