"""The GPU path of ple_ops: flags in device and host memory, a whole decode step captured into a
CUDA graph and under mode="reduce-overhead" with a real offload process, a dead process, and
misuse that must end in an error and a free stream, never a hang or stale rows: replays with no
prepare, capture with a prepared step, a failed step, a release with no forward, double release."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ple_models import VOCAB, DecodeStep, make_model, make_sleepy_model, make_slow_model, signal_over_ipc

import ple_ops
from ple_ops.semaphore import DONE, RESET, bound_driver

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
        if child.is_alive():  # never leave a child behind a failed test
            child.kill()
            child.join(10)
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


def replayer(graph, hidden, ids, out):
    """A step function over a captured graph: copy the inputs in, replay, return the output."""

    def replay(h, i):
        hidden.copy_(h)
        ids.copy_(i)
        graph.replay()
        torch.cuda.synchronize()
        return out.clone()

    return replay


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


@pytest.mark.parametrize("copies_by", ["kernel", "copy engine"])
def test_decode_step_captured_in_a_cuda_graph_replays_with_new_ids(copies_by, monkeypatch):
    if copies_by == "copy engine":  # what a copy of COPY_ENGINE_FROM bytes or more records
        monkeypatch.setattr(ple_ops.kernels, "COPY_ENGINE_FROM", 1)
    with ple_ops.OffloadRuntime(make_model, max_tokens=16, device="cuda") as rt:
        hidden = torch.zeros(4, 64, device="cuda")
        ids = torch.zeros(4, dtype=torch.long, device="cuda")
        rt.prepare(ids.cpu())  # warm-up step, eager
        rt.model(hidden, ids)
        rt.release()
        torch.cuda.synchronize()
        # What the capture records for each layer's rows: kernel bytes (wait_copy's argument)
        # and copy-engine memcpys (the driver call, which a capture turns into a memcpy node).
        kernel_bytes, memcpys = [], []
        wait_copy, driver = ple_ops.kernels.wait_copy, bound_driver()
        memcpy = driver.memcpy_htod

        def spied_wait_copy(flag, waiting, src, dst, nbytes):
            kernel_bytes.append(nbytes)
            return wait_copy(flag, waiting, src, dst, nbytes)

        def spied_memcpy(dst, src, nbytes, stream):
            memcpys.append(nbytes)
            return memcpy(dst, src, nbytes, stream)

        monkeypatch.setattr(ple_ops.kernels, "wait_copy", spied_wait_copy)
        monkeypatch.setattr(driver, "memcpy_htod", spied_memcpy)
        graph = torch.cuda.CUDAGraph()
        with ple_ops.observe_copy_geometry() as copies:
            with torch.cuda.graph(graph):
                out = rt.model(hidden, ids)
                rt.model.release_offloaded()
        assert copies == [(f"blocks.{i}.ple", 4, 4 * 256) for i in range(3)]
        by_kernel = copies_by == "kernel"
        assert kernel_bytes == [4 * 256 if by_kernel else 0] * 3
        assert memcpys == ([] if by_kernel else [4 * 256] * 3)

        check_steps(rt, replayer(graph, hidden, ids, out))
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

        # A plain capture with a step prepared is still refused when it runs on the trees' own
        # stream (torch.cuda.Stream() pools streams, so the two can be one CUDA stream by chance).
        ids = torch.randint(0, VOCAB, (4,))
        hidden, device_ids = torch.randn(4, 64, device="cuda"), ids.cuda()
        rt.prepare(ids)
        with pytest.raises(ple_ops.OffloadError, match="Capture with no step prepared"):
            with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=manager.stream):
                rt.model(hidden, device_ids)
        rt.model(hidden, device_ids)  # the prepared step, served eagerly
        rt.release()


def test_killing_the_offload_process_unblocks_the_gpu_before_the_step_timeout():
    with ple_ops.OffloadRuntime(make_slow_model, max_tokens=16, device="cuda", step_timeout=2.0) as rt:
        ids = torch.arange(8)
        rt.prepare(ids)
        out = rt.model(torch.zeros(8, 64, device="cuda"), ids.cuda())  # the stream waits on layer 1
        time.sleep(0.3)
        assert not torch.cuda.current_stream().query()
        killed = time.perf_counter()
        os.kill(rt.process.pid, 9)
        torch.cuda.synchronize()  # returns: the watchdog raised the flags over poisoned rows
        # Freed by the watchdog's looks at the dead process, every POLL seconds, not by the step's
        # timeout (whose error would not say "died" below).
        assert time.perf_counter() - killed < rt.step_timeout
        assert torch.isnan(out).all()
        with pytest.raises(ple_ops.OffloadError, match="died"):
            rt.release()
        with pytest.raises(ple_ops.OffloadError):
            rt.prepare(ids)


# --- misuse and faults: an error within step_timeout, a free stream, never stale rows ------------


def captured_step(rt, n, release_in_graph=True):
    """Warm up eagerly with a prepared step, then capture the model (and its releases) with none."""
    hidden = torch.zeros(n, 64, device="cuda")
    ids = torch.zeros(n, dtype=torch.long, device="cuda")
    rt.prepare(ids.cpu())
    rt.model(hidden, ids)
    rt.release()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rt.model(hidden, ids)
        if release_in_graph:
            rt.release()  # inside a capture: records the resets, touches no step
    return graph, hidden, ids, out


def replay_step(rt, graph, hidden, ids, step_ids, step_hidden):
    rt.prepare(step_ids)
    hidden.copy_(step_hidden)
    ids[: len(step_ids)].copy_(step_ids)
    graph.replay()
    rt.release(enqueue=False)
    torch.cuda.synchronize()


@pytest.mark.parametrize("before", ["never-prepared", "after-a-served-replay"])
def test_a_replay_without_prepare_ends_in_poison_and_an_error_within_step_timeout(before):
    local = make_model().cuda()
    with ple_ops.OffloadRuntime(make_model, max_tokens=16, device="cuda", step_timeout=2.0) as rt:
        graph, hidden, ids, out = captured_step(rt, 4)
        if before == "after-a-served-replay":
            step_ids, step_hidden = torch.randint(0, VOCAB, (4,)), torch.randn(4, 64, device="cuda")
            replay_step(rt, graph, hidden, ids, step_ids, step_hidden)
            torch.testing.assert_close(out, local(step_hidden, step_ids.cuda()), rtol=1e-4, atol=1e-4)
        start = time.perf_counter()
        graph.replay()  # no prepare: layer 0's wait has no step to end it
        torch.cuda.synchronize()  # returns: the watchdog freed the stream
        assert time.perf_counter() - start < rt.step_timeout
        assert torch.isnan(out).all()  # poisoned rows, never the step before's
        with pytest.raises(ple_ops.OffloadError, match=r"(?s)layer 'blocks\.0\.ple'.*prepare\(\) was missing") as e:
            rt.prepare(ids.cpu())
        assert e.value.fatal
        for _ in range(2):  # a dead runtime still frees every replay's waits
            start = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            assert time.perf_counter() - start < rt.step_timeout and torch.isnan(out).all()


def test_capture_with_a_prepared_step_and_prepare_during_capture_are_refused():
    local = make_model().cuda()
    with ple_ops.OffloadRuntime(make_model, max_tokens=16, device="cuda", step_timeout=2.0) as rt:
        step_ids, step_hidden = torch.randint(0, VOCAB, (4,)), torch.randn(4, 64, device="cuda")
        device_ids = step_ids.cuda()  # before the capture: a pageable copy is illegal inside one
        # The warm-up every capture needs (cuBLAS makes its workspace on its first call).
        rt.prepare(step_ids)
        rt.model(step_hidden, device_ids)
        rt.release()
        rt.prepare(step_ids)
        with pytest.raises(ple_ops.OffloadError, match="Capture with no step prepared") as e:
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                rt.model(step_hidden, device_ids)
        assert not e.value.fatal
        # The prepared step is still served (eagerly), and the runtime goes on.
        torch.testing.assert_close(
            rt.model(step_hidden, step_ids.cuda()), local(step_hidden, step_ids.cuda()), rtol=1e-4, atol=1e-4
        )
        rt.release()
        hidden = torch.zeros(4, 64, device="cuda")
        ids = torch.zeros(4, dtype=torch.long, device="cuda")
        host_ids = torch.zeros(4, dtype=torch.long)  # a device-to-host copy would break the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            with pytest.raises(ple_ops.OffloadError, match=r"prepare\(\): refused during CUDA-graph capture"):
                rt.prepare(host_ids)
            out = rt.model(hidden, ids)
            rt.release()

        check_steps(rt, replayer(graph, hidden, ids, out), steps=10)


def test_capture_refusal_holds_in_a_process_that_never_imported_inductor():
    # The refusal asks whether inductor's CUDA-graph trees are recording; a first import of
    # Inductor during the capture makes CUDA calls that invalidate it (the test above passed
    # only after a compile test had imported Inductor). A fresh process runs it cold.
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), str(here.parents[1] / "tests")]))
    code = (
        "import sys, test_cuda_graph as t\n"
        "t.test_capture_with_a_prepared_step_and_prepare_during_capture_are_refused()\n"
        "assert 'torch._inductor.cudagraph_trees' not in sys.modules, 'Inductor was imported: not a cold run'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_an_eager_forward_without_prepare_raises_at_once_and_enqueues_nothing():
    local = make_model().cuda()
    with ple_ops.OffloadRuntime(make_model, max_tokens=16, device="cuda", step_timeout=2.0) as rt:
        hidden, ids = torch.randn(5, 64, device="cuda"), torch.randint(0, VOCAB, (5,))
        start = time.perf_counter()
        with pytest.raises(ple_ops.OffloadError, match=r"prepare\(\) was missing") as e:
            rt.model(hidden, ids.cuda())
        torch.cuda.synchronize()
        # At once: before the step_timeout that a wait for the missing step would run out.
        assert time.perf_counter() - start < rt.step_timeout and not e.value.fatal
        rt.prepare(ids)
        torch.testing.assert_close(rt.model(hidden, ids.cuda()), local(hidden, ids.cuda()), rtol=1e-4, atol=1e-4)
        rt.release()


def test_a_failed_step_on_the_gpu_poisons_its_rows_and_later_steps_are_served():
    with ple_ops.OffloadRuntime(make_model, max_tokens=16, device="cuda", step_timeout=2.0) as rt:
        bad = torch.randint(0, VOCAB, (6,))
        bad[2] = VOCAB + 5
        rt.prepare(bad)
        out = rt.model(torch.randn(6, 64, device="cuda"), bad.cuda())
        errors = []
        try:
            rt.release()  # raises if the offload process has failed the step by now...
        except ple_ops.OffloadError as e:
            errors.append(e)
        torch.cuda.synchronize()
        assert torch.isnan(out).all()
        if not errors:
            with pytest.raises(ple_ops.OffloadError) as e:
                rt.check()  # ... else the next call does
            errors.append(e.value)
        assert "out of bounds" in str(errors[0]) and not errors[0].fatal
        rt.check()  # raised once

        def eager(h, i):
            out = rt.model(h, i)
            rt.model.release_offloaded()
            return out

        check_steps(rt, eager, steps=5)


def test_a_release_without_forward_leaves_no_raised_flag_for_the_next_step():
    # Layers take a millisecond: the release's reset is enqueued long before the rows exist.
    local = make_model().cuda()
    with ple_ops.OffloadRuntime(make_sleepy_model, max_tokens=16, device="cuda", step_timeout=2.0) as rt:
        gen = torch.Generator().manual_seed(11)
        for _ in range(5):
            rt.prepare(torch.randint(0, VOCAB, (4,), generator=gen))
            rt.release()  # no forward
            ids, hidden = torch.randint(0, VOCAB, (4,), generator=gen), torch.randn(4, 64, generator=gen).cuda()
            rt.prepare(ids)
            out = rt.model(hidden, ids.cuda())
            rt.release()
            torch.testing.assert_close(out, local(hidden, ids.cuda()), rtol=1e-4, atol=1e-4)


def test_a_graph_captured_for_more_tokens_than_prepared_reads_poison_past_the_step():
    local = make_model().cuda()
    with ple_ops.OffloadRuntime(make_model, max_tokens=16, device="cuda", step_timeout=2.0) as rt:
        graph, hidden, ids, out = captured_step(rt, 6)
        gen = torch.Generator().manual_seed(12)
        replay_step(
            rt, graph, hidden, ids, torch.randint(0, VOCAB, (6,), generator=gen), torch.randn(6, 64, device="cuda")
        )
        short = torch.randint(0, VOCAB, (4,), generator=gen)
        replay_step(rt, graph, hidden, ids, short, torch.randn(6, 64, device="cuda"))
        for i, block in enumerate(rt.model.blocks):
            rows = block.ple.ple_out
            torch.testing.assert_close(rows[:4], local.blocks[i].ple.forward_impl(short.cuda()), rtol=0, atol=0)
            assert torch.isnan(rows[4:6]).all()  # the graph copies 6 rows: the last two are poison


def test_release_after_a_graph_that_released_is_caught_not_hung():
    with ple_ops.OffloadRuntime(make_model, max_tokens=16, device="cuda", step_timeout=2.0) as rt:
        graph, hidden, ids, out = captured_step(rt, 4)
        rt.prepare(torch.randint(0, VOCAB, (4,)))
        graph.replay()
        start = time.perf_counter()
        rt.release()  # wrong: the graph released the step already (release(enqueue=False) is meant)
        torch.cuda.synchronize()
        assert time.perf_counter() - start < rt.step_timeout
        with pytest.raises(ple_ops.OffloadError, match="release\\(\\) after a graph that already released") as e:
            rt.check()
        assert e.value.fatal


def test_a_graph_of_the_releases_alone_replayed_without_prepare_is_freed_not_hung():
    # The releases' own flag waits must be visible to the watchdog even where no forward in the
    # graph marked the stream as waiting: here the graph holds nothing but the releases.
    with ple_ops.OffloadRuntime(make_model, max_tokens=16, device="cuda", step_timeout=2.0) as rt:
        step_ids = torch.randint(0, VOCAB, (4,))
        rt.prepare(step_ids)  # a served step first, so that the flags' last raise was consumed
        rt.model(torch.randn(4, 64, device="cuda"), step_ids.cuda())
        rt.release()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            rt.release()  # records each layer's wait, waiting mark and reset
        start = time.perf_counter()
        graph.replay()  # no prepare(): no step will raise the flags
        torch.cuda.synchronize()  # returns: the watchdog freed the stream
        assert time.perf_counter() - start < rt.step_timeout
        with pytest.raises(ple_ops.OffloadError, match=r"prepare\(\) was missing") as e:
            rt.check()
        assert e.value.fatal


def test_a_caller_running_ahead_without_syncs_gets_every_steps_rows():
    # Replays are enqueued as fast as the host goes; the offload process (a millisecond per
    # layer) is far behind. prepare() holds the caller back until the previous ids are taken.
    local = make_model().cuda()
    with ple_ops.OffloadRuntime(make_sleepy_model, max_tokens=16, device="cuda", step_timeout=5.0) as rt:
        graph, hidden, ids, out = captured_step(rt, 4)
        gen = torch.Generator().manual_seed(13)
        steps = [
            (torch.randint(0, VOCAB, (4,), generator=gen), torch.randn(4, 64, generator=gen).cuda()) for _ in range(30)
        ]
        results = []
        for step_ids, step_hidden in steps:
            rt.prepare(step_ids)
            hidden.copy_(step_hidden)  # device to device: no sync
            graph.replay()
            results.append(out.clone())  # in stream order, before the next replay overwrites out
            rt.release(enqueue=False)
        torch.cuda.synchronize()
        for (step_ids, step_hidden), got in zip(steps, results):
            torch.testing.assert_close(got, local(step_hidden, step_ids.cuda()), rtol=1e-4, atol=1e-4)
