"""OffloadRuntime with a real spawned offload process, on the CPU path (the GPU path is in
compile_tests/ple_ops): results equal the local model, the transaction rule holds, and a dead
or failing process becomes an error within a second, never a hang."""

import os
import threading
import time

import pytest
import torch
from ple_models import LAYERS, make_failing_model, make_model, make_slow_model

import ple_ops


@pytest.fixture
def runtime():
    # One runtime per test: layer names are armed once per process.
    rt = ple_ops.OffloadRuntime(make_model, max_tokens=32, device="cpu")
    yield rt
    rt.close()


def test_gpu_side_layers_allocate_no_tables(runtime):
    for block in runtime.model.blocks:
        assert not any(True for _ in block.ple.parameters())
        assert block.ple.ple_out.shape == (32, 64)
        assert ple_ops.lookup(block.ple.ple_name).out is block.ple.ple_out
    assert ple_ops.armed_names() == [f"blocks.{i}.ple" for i in range(LAYERS)]


def test_steps_give_the_local_model_result(runtime):
    local = make_model()
    gen = torch.Generator().manual_seed(0)
    for n in (1, 7, 32, 3):
        ids = torch.randint(0, 1000, (n,), generator=gen)
        hidden = torch.randn(n, 64, generator=gen)
        runtime.prepare(ids)
        out = runtime.model(hidden, ids)
        runtime.release()
        torch.testing.assert_close(out, local(hidden, ids), rtol=0, atol=0)
    # The worker counts a step as served just after raising its last flag.
    deadline = time.monotonic() + 1.0
    while runtime.served_steps() < 4 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert runtime.served_steps() == 4


def test_prepare_before_release_is_refused(runtime):
    ids = torch.arange(4)
    runtime.prepare(ids)
    with pytest.raises(ple_ops.OffloadError, match="before the previous step's release"):
        runtime.prepare(ids)
    runtime.model(torch.zeros(4, 64), ids)
    runtime.release()


def test_too_many_tokens_is_a_clear_error(runtime):
    with pytest.raises(ValueError, match=r"1..32 ids, got shape \(33,\)"):
        runtime.prepare(torch.arange(33))


def test_killing_the_offload_process_mid_step_raises_within_a_second():
    rt = ple_ops.OffloadRuntime(make_slow_model, max_tokens=16, device="cpu")
    try:
        ids = torch.arange(8)
        rt.prepare(ids)
        killed_at = []

        def kill():
            time.sleep(0.3)
            killed_at.append(time.perf_counter())
            os.kill(rt.process.pid, 9)

        threading.Thread(target=kill).start()
        with pytest.raises(ple_ops.OffloadError, match="died"):
            rt.model(torch.zeros(8, 64), ids)  # blocks in layer 1's wait until the kill
        assert time.perf_counter() - killed_at[0] < 1.0
        # The rows of the failed step are poisoned, and the runtime refuses further steps.
        assert torch.isnan(ple_ops.lookup("blocks.1.ple").slot[:8].view(torch.float32)).all()
        with pytest.raises(ple_ops.OffloadError):
            rt.release()
        with pytest.raises(ple_ops.OffloadError):
            rt.prepare(ids)
    finally:
        rt.close()


def test_an_exception_in_the_offload_process_surfaces_with_its_traceback():
    rt = ple_ops.OffloadRuntime(make_failing_model, max_tokens=16, device="cpu")
    try:
        ids = torch.arange(8)
        rt.prepare(ids)
        start = time.perf_counter()
        with pytest.raises(ple_ops.OffloadError, match="table shard unavailable"):
            rt.model(torch.zeros(8, 64), ids)
        assert time.perf_counter() - start < 1.0
    finally:
        rt.close()


def test_no_shared_file_outlives_start_up_and_close_unblocks_a_prepared_step():
    rt = ple_ops.OffloadRuntime(make_model, max_tokens=8, device="cpu")
    paths = [rt._control.handle.path, rt._flags_buf.handle.path] + [b.handle.path for b in rt._slot_bufs]
    # Both processes hold their mappings; the names are gone, so a crash leaks nothing in /dev/shm.
    assert not any(os.path.exists(p) for p in paths)
    rt.prepare(torch.arange(4))
    rt.close()
    assert not rt.process.is_alive()
    assert ple_ops.armed_names() == []
