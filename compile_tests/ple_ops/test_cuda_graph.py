"""The GPU path of ple_ops: flags in device and host memory, a whole decode step captured into a
CUDA graph and under mode="reduce-overhead" with a real offload process, and a dead process."""

import os
import time

import pytest
import torch
from ple_models import DecodeStep, make_model, make_slow_model, signal_over_ipc

import ple_ops
from ple_ops.semaphore import DONE, RESET

pytestmark = pytest.mark.gpu


def test_device_flag_shared_over_cuda_ipc_releases_a_waiting_stream():
    sem = ple_ops.CpuGpuSemaphore.in_device_memory()
    marker = torch.zeros(1, device="cuda")
    stream = torch.cuda.Stream()
    ctx = torch.multiprocessing.get_context("spawn")
    # One queue per direction: with a single queue the parent could take back its own message.
    to_child, from_child = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=signal_over_ipc, args=(to_child, from_child))
    child.start()
    to_child.put(sem.flag)
    with torch.cuda.stream(stream):
        sem.wait_done()
        marker.fill_(1.0)
    try:
        time.sleep(0.1)
        assert not stream.query()  # still waiting for the other process
        assert from_child.get(timeout=60) == "signalled"
        stream.synchronize()
        assert marker.item() == 1.0
    finally:
        # Never leave a stream blocked behind a flag nobody will raise: a stuck stream can stall
        # others that share its hardware queue, and the whole suite with them.
        sem.signal()
        torch.cuda.synchronize()
        to_child.put("done")
        child.join(30)
    assert child.exitcode == 0


def test_host_flag_stream_operations_and_host_signal():
    buf = ple_ops.SharedHostBuffer(128)
    sem = ple_ops.CpuGpuSemaphore.in_host_memory(buf.view(0, (1,), torch.int32))
    sem.host_reset()
    marker = torch.zeros(1, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        sem.wait_done()
        marker.fill_(1.0)
        sem.reset()  # the GPU writes host memory
    try:
        time.sleep(0.05)
        assert not stream.query()
    finally:
        sem.host_signal()  # raise it whatever happened above: never leave the stream blocked
    stream.synchronize()
    assert marker.item() == 1.0 and sem.host_value() == RESET
    with torch.cuda.stream(stream):
        sem.signal()
        sem.wait_done()
    stream.synchronize()
    assert sem.host_value() == DONE
    buf.unlink()


def check_steps(rt, run_step, n=4, steps=40):
    local = make_model().cuda()
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        ids = torch.randint(0, 1000, (n,), generator=gen)
        hidden = torch.randn(n, 64, generator=gen)
        rt.prepare(ids)
        out = run_step(hidden.cuda(), ids.cuda())
        rt.release(enqueue=False)
        torch.testing.assert_close(out, local(hidden.cuda(), ids.cuda()), rtol=1e-4, atol=1e-4)


def test_decode_step_captured_in_a_cuda_graph_replays_with_new_ids():
    with ple_ops.OffloadRuntime(make_model, max_tokens=16, device="cuda") as rt:
        hidden = torch.zeros(4, 64, device="cuda")
        ids = torch.zeros(4, dtype=torch.long, device="cuda")
        rt.prepare(ids.cpu())  # warm-up step, eager
        rt.model(hidden, ids)
        rt.release()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with ple_ops.observe_copy_geometry() as copies:
            with torch.cuda.graph(graph):
                out = rt.model(hidden, ids)
                rt.model.release_offloaded()
        assert copies == [(f"blocks.{i}.ple", 4, 4 * 256) for i in range(3)]

        def replay(h, i):
            hidden.copy_(h)
            ids.copy_(i)
            graph.replay()
            torch.cuda.synchronize()
            return out.clone()

        check_steps(rt, replay)
        assert [ple_ops.lookup(n).flag.host_value() for n in ple_ops.armed_names()] == [RESET] * 3


def test_decode_step_under_reduce_overhead():
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    torch._dynamo.reset()
    counters.clear()
    # Inference, as in a serving engine: with autograd on, cudagraph trees waits for a backward
    # that never comes and re-records instead of replaying.
    with ple_ops.OffloadRuntime(make_model, max_tokens=16, device="cuda") as rt, torch.no_grad():
        compiled = torch.compile(DecodeStep(rt.model), mode="reduce-overhead", fullgraph=True)

        def step(h, i):
            out = compiled(h, i).clone()
            torch.cuda.synchronize()
            return out

        check_steps(rt, step, steps=20)
        assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
        manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
        assert manager is not None and sum(len(v) for v in manager.roots.values()) >= 1


def test_killing_the_offload_process_unblocks_the_gpu_within_a_second():
    with ple_ops.OffloadRuntime(make_slow_model, max_tokens=16, device="cuda") as rt:
        ids = torch.arange(8)
        rt.prepare(ids)
        out = rt.model(torch.zeros(8, 64, device="cuda"), ids.cuda())  # the stream waits on layer 1
        time.sleep(0.3)
        assert not torch.cuda.current_stream().query()
        killed = time.perf_counter()
        os.kill(rt.process.pid, 9)
        torch.cuda.synchronize()  # returns: the watchdog raised the flags over poisoned rows
        assert time.perf_counter() - killed < 1.0
        assert torch.isnan(out).all()
        with pytest.raises(ple_ops.OffloadError, match="died"):
            rt.release()
        with pytest.raises(ple_ops.OffloadError):
            rt.prepare(ids)
