"""OffloadRuntime with a real spawned offload process, on the CPU path (the GPU path is in
compile_tests/ple_ops): results equal the local model, the transaction rule holds, misuse is an
error at once, a bad step is that step's error, and a dead, late or closed runtime is an error
within step_timeout, never a hang."""

import ast
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from ple_models import (
    DIM,
    LAYERS,
    VOCAB,
    WIDE,
    make_bf16_lookup_model,
    make_bf16_model,
    make_failing_model,
    make_lookup_model,
    make_model,
    make_nothing,
    make_sleepy_model,
    make_slow_model,
    make_unbuildable_model,
    make_wide_model,
)

import ple_ops
from ple_ops.runtime.control import WAITING, Word
from ple_ops.semaphore import DONE, RESET

ROOT = Path(__file__).resolve().parents[2]
NAMES = [f"blocks.{i}.ple" for i in range(LAYERS)]
# An error "within step_timeout" comes after the timeout, the watchdog's next look (POLL), the
# waiter's next check and whatever scheduling a loaded host adds: the tests allow twice the
# runtime's step_timeout, so that the bound is the contract's own figure, never one of theirs.
WITHIN_TIMEOUT = 2.0


@pytest.fixture
def runtime():
    # One runtime per test: layer names are armed once per process.
    rt = ple_ops.OffloadRuntime(make_model, max_tokens=32, device="cpu", step_timeout=2.0)
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def local():
    return make_model()


def random_step(gen, n):
    return torch.randint(0, VOCAB, (n,), generator=gen), torch.randn(n, DIM, generator=gen)


def served_step(rt, local, ids, hidden):
    rt.prepare(ids)
    out = rt.model(hidden, ids)
    rt.release()
    torch.testing.assert_close(out, local(hidden, ids), rtol=0, atol=0)


def flags(rt):
    return [ple_ops.lookup(name).flag.host_value() for name in NAMES]


def test_gpu_side_layers_allocate_no_tables(runtime):
    for block in runtime.model.blocks:
        assert not any(True for _ in block.ple.parameters())
        assert block.ple.ple_out.shape == (32, 64)
        assert ple_ops.lookup(block.ple.ple_name).out is block.ple.ple_out
    assert ple_ops.armed_names() == NAMES
    assert [name for name, _ in ple_ops.layer.ple_layers(runtime.model)] == NAMES


def test_steps_give_the_local_model_result(runtime, local):
    gen = torch.Generator().manual_seed(0)
    for n in (1, 7, 32, 3):
        served_step(runtime, local, *random_step(gen, n))
    # The worker counts a step as served just after raising its last flag.
    deadline = time.monotonic() + 1.0
    while runtime.served_steps() < 4 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert runtime.served_steps() == 4


@pytest.mark.parametrize("factory", [make_lookup_model, make_bf16_lookup_model], ids=["float32", "bfloat16"])
def test_a_pure_lookup_model_is_gathered_by_the_offload_process_bitwise_and_prepare_refuses_an_id_outside_it(factory):
    # Layers whose lookup_table() returns their table are served by a numpy gather straight into
    # the slot (no forward_impl in the offload process): the same rows, bit for bit. The worker
    # reports their tables' sizes, so prepare() refuses an id outside them before sending the step.
    local = factory()
    gen = torch.Generator().manual_seed(31)
    with ple_ops.OffloadRuntime(factory, max_tokens=32, device="cpu", step_timeout=2.0) as rt:
        for n in (7, 32, 1, 12):
            ids = torch.randint(0, VOCAB, (n,), generator=gen)
            hidden = torch.randn(n, DIM, generator=gen).to(local.blocks[0].proj.weight.dtype)
            served_step(rt, local, ids, hidden)
        wait_served(rt)
        served = rt.served_steps()
        past = VOCAB + int(torch.randint(0, 50, (), generator=gen))
        below = -1 - int(torch.randint(0, 50, (), generator=gen))
        for bad in (past, below, 2**40):
            ids = torch.randint(0, VOCAB, (9,), generator=gen)
            ids[int(torch.randint(0, 9, (), generator=gen))] = bad
            # int64 ids are checked as given, narrower ones after their host copy: both refused.
            for sent in [ids] + ([ids.to(torch.int32)] if abs(bad) < 2**31 else []):
                match = rf"prepare: input_ids holds id {bad}, outside the vocabulary of {VOCAB} rows .*'blocks\.0\.ple'"
                with pytest.raises(ValueError, match=match):
                    rt.prepare(sent)
        with pytest.raises(ple_ops.OffloadError, match="no step prepared"):
            rt.model(hidden[:9], ids)  # nothing was prepared
        assert rt.served_steps() == served  # and nothing was sent
        for n in (5, 32):
            ids = torch.randint(0, VOCAB, (n,), generator=gen)
            served_step(rt, local, ids, torch.randn(n, DIM, generator=gen).to(hidden.dtype))


def test_prepare_before_release_is_refused(runtime):
    ids = torch.arange(4)
    runtime.prepare(ids)
    with pytest.raises(ple_ops.OffloadError, match="before the previous step's release"):
        runtime.prepare(ids)
    runtime.model(torch.zeros(4, 64), ids)
    runtime.release()


# --- B: no wait without an end ----------------------------------------------------------------


def test_a_forward_without_prepare_raises_at_once_and_the_runtime_serves_on(runtime, local):
    gen = torch.Generator().manual_seed(1)
    ids, hidden = random_step(gen, 5)
    for _ in range(2):  # before any step, then after a released one
        start = time.perf_counter()
        with pytest.raises(
            ple_ops.OffloadError, match=r"layer 'blocks\.0\.ple' waited .* no step prepared: prepare\(\) was missing"
        ) as e:
            runtime.model(hidden, ids)
        # At once: before the step_timeout that a wait for the missing step would run out.
        assert time.perf_counter() - start < runtime.step_timeout and not e.value.fatal
        served_step(runtime, local, ids, hidden)
    with pytest.raises(ple_ops.OffloadError, match=r"released with no step prepared"):
        runtime.model.blocks[2].ple.release_offloaded()
    runtime.release()  # no step: nothing to do
    served_step(runtime, local, *random_step(gen, 9))


def test_a_stream_waiting_with_no_step_is_freed_with_poison_and_fails_the_runtime(local):
    # The GPU op writes the waiting word on its stream right before its flag wait. Here this
    # test writes it, after a served and released step, as a second replay would.
    with ple_ops.OffloadRuntime(make_model, max_tokens=8, device="cpu", step_timeout=2.0) as rt:
        gen = torch.Generator().manual_seed(2)
        served_step(rt, local, *random_step(gen, 6))
        control = rt.control
        assert control.delivered(1) == control.get(Word.REQUEST) and flags(rt)[1] == RESET
        start = time.perf_counter()
        control.waiting[1].flag.fill_(WAITING)
        while flags(rt)[1] != DONE:
            assert time.perf_counter() - start < rt.step_timeout, "the watchdog did not free the stream"
            time.sleep(0.001)
        assert all((ple_ops.lookup(n).slot == 0xFF).all() for n in NAMES)  # poison, then the flags
        with pytest.raises(
            ple_ops.OffloadError, match=r"waits for layer 'blocks\.1\.ple'.*prepare\(\) was missing"
        ) as e:
            rt.prepare(torch.arange(3))
        assert e.value.fatal
        assert not rt.process.is_alive()


def test_a_stream_waiting_for_a_slow_step_is_not_mistaken_for_a_stuck_one(local):
    with ple_ops.OffloadRuntime(make_slow_model, max_tokens=8, device="cpu", step_timeout=5.0) as rt:
        ids, hidden = random_step(torch.Generator().manual_seed(3), 7)
        rt.prepare(ids)  # layer 1 takes 3 s
        for waiting in rt.control.waiting:
            waiting.flag.fill_(WAITING)  # streams park on every layer's flag
        time.sleep(0.5)
        rt.check()  # a waiting stream whose step is owed rows is fine
        for waiting in rt.control.waiting:
            waiting.flag.fill_(0)  # (the GPU release clears them; the CPU path never sets them)
        torch.testing.assert_close(rt.model(hidden, ids), local(hidden, ids), rtol=0, atol=0)
        rt.release()


def test_a_step_not_served_within_step_timeout_fails_the_runtime():
    with ple_ops.OffloadRuntime(make_slow_model, max_tokens=8, device="cpu", step_timeout=1.0) as rt:
        ids = torch.arange(8)
        start = time.monotonic()  # before prepare, whose time the watchdog counts the timeout from
        rt.prepare(ids)
        with pytest.raises(
            ple_ops.OffloadError, match=r"did not serve step 1 within step_timeout 1.0 s: layer 'blocks\.1\.ple'"
        ):
            rt.model(torch.zeros(8, 64), ids)
        took = time.monotonic() - start
        assert rt.step_timeout < took < WITHIN_TIMEOUT * rt.step_timeout, took
        with pytest.raises(ple_ops.OffloadError, match="within step_timeout"):
            rt.release()


def test_a_death_between_steps_fails_the_next_prepare_once_the_watchdog_looked(local):
    """prepare asks no system call whether the offload process lives: the watchdog does, every
    POLL seconds. A death between two steps is therefore the next prepare's error within a few
    POLLs (never a prepared step that nobody serves), and nothing joined the process for it."""
    from ple_ops.runtime.watchdog import POLL

    with ple_ops.OffloadRuntime(make_model, max_tokens=8, device="cpu", step_timeout=2.0) as rt:
        gen = torch.Generator().manual_seed(23)
        served_step(rt, local, *random_step(gen, 5))
        os.kill(rt.process.pid, 9)
        ids, _ = random_step(gen, 5)
        killed = time.monotonic()
        time.sleep(POLL)
        try:
            rt.prepare(ids)
        except ple_ops.OffloadError as e:
            assert e.fatal and "died" in str(e)
        else:
            # Prepared before the watchdog looked: that step is the error, within its timeout.
            with pytest.raises(ple_ops.OffloadError, match="died"):
                rt.model(torch.zeros(5, DIM), ids)
            with pytest.raises(ple_ops.OffloadError, match="died"):
                rt.release()
        # Noticed by the watchdog's looks, not by the step's timeout (that error would not say "died").
        assert time.monotonic() - killed < rt.step_timeout
        with pytest.raises(ple_ops.OffloadError, match="died"):
            rt.prepare(ids)


def test_killing_the_offload_process_mid_step_raises_before_its_step_timeout():
    rt = ple_ops.OffloadRuntime(make_slow_model, max_tokens=16, device="cpu", step_timeout=2.0)
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
        # Noticed by the watchdog's looks, every POLL seconds, not by the step's timeout.
        assert time.perf_counter() - killed_at[0] < rt.step_timeout
        # The rows of the failed step are poisoned, and the runtime refuses further steps.
        assert torch.isnan(ple_ops.lookup("blocks.1.ple").slot[:8].view(torch.float32)).all()
        with pytest.raises(ple_ops.OffloadError):
            rt.release()
        with pytest.raises(ple_ops.OffloadError):
            rt.prepare(ids)
    finally:
        rt.close()


def wait_served(rt):
    """Until the offload process has served the prepared step (read from its word: no liveness check)."""
    deadline = time.monotonic() + rt.step_timeout
    while rt.control.get(Word.SERVED) < rt.control.get(Word.REQUEST):
        assert time.monotonic() < deadline, "the step was not served"
        time.sleep(1e-4)


def test_liveness_is_asked_by_the_watchdog_never_by_a_steps_calls(runtime, local, monkeypatch):
    # is_alive() costs two system calls (1.4 us of prepare's 9 on the H200's host): prepare, the
    # ops (two per layer and step) and release never make them; the watchdog, on its own thread,
    # asks every POLL seconds (the test above it shows a death noticed that way).
    main, calls, alive = threading.current_thread(), [], runtime.process.is_alive
    counting = []

    def counted():
        if threading.current_thread() is main and counting:
            calls.append(1)
        elif threading.current_thread() is not main:
            calls.append(0)  # the watchdog's
        return alive()

    monkeypatch.setattr(runtime.process, "is_alive", counted)
    gen = torch.Generator().manual_seed(21)
    for _ in range(6):
        ids, hidden = random_step(gen, int(torch.randint(1, 33, (1,), generator=gen)))
        counting.append(1)
        runtime.prepare(ids)
        counting.clear()
        wait_served(runtime)  # rows already published: no wait of the forward spins (and checks)
        counting.append(1)
        out = runtime.model(hidden, ids)
        runtime.release()
        counting.clear()
        torch.testing.assert_close(out, local(hidden, ids), rtol=0, atol=0)
    time.sleep(0.05)  # ten watchdog looks
    assert 1 not in calls, f"{calls.count(1)} is_alive calls from the step's own calls"
    assert 0 in calls, "the watchdog never asked"


@pytest.mark.parametrize("noticed_by", ["join", "watchdog"])
def test_a_death_after_the_rows_were_published_fails_the_next_forward(local, noticed_by):
    with ple_ops.OffloadRuntime(make_model, max_tokens=8, device="cpu", step_timeout=2.0) as rt:
        ids, hidden = random_step(torch.Generator().manual_seed(22), 6)
        rt.prepare(ids)
        wait_served(rt)
        if noticed_by == "join":
            # No watchdog: the forward's own (system-call-free) check must see the collected exit.
            rt.watchdog.stop(5.0)
            os.kill(rt.process.pid, 9)
            rt.process.join(10)
        else:
            os.kill(rt.process.pid, 9)
            deadline = time.monotonic() + 1.0
            while rt.failure is None:
                assert time.monotonic() < deadline, "the watchdog did not notice the death within a second"
                time.sleep(1e-3)
        with pytest.raises(ple_ops.OffloadError, match="died") as e:
            rt.model(hidden, ids)
        assert e.value.fatal
        with pytest.raises(ple_ops.OffloadError, match="died"):
            rt.release()


# --- C (the CPU side): every release answers its own step ----------------------------------------


@pytest.mark.parametrize("enqueue", [True, False])
def test_a_release_without_forward_leaves_no_raised_flag_for_the_next_step(local, enqueue):
    # Layers that take a millisecond: the release comes before the rows, as with a real model.
    with ple_ops.OffloadRuntime(make_sleepy_model, max_tokens=8, device="cpu", step_timeout=2.0) as rt:
        gen = torch.Generator().manual_seed(4)
        for _ in range(3):
            skipped, _ = random_step(gen, 4)
            rt.prepare(skipped)
            if enqueue:
                rt.release()  # no forward: the release waits for this step's rows, then resets
            else:
                with pytest.raises(ple_ops.OffloadError, match="did not release"):
                    rt.release(enqueue=False)  # ... and so does the repair of a wrong enqueue=False
            assert flags(rt) == [RESET] * LAYERS
            time.sleep(0.01)
            assert flags(rt) == [RESET] * LAYERS  # and no late raise either
            served_step(rt, local, *random_step(gen, 4))


def test_release_enqueue_false_after_an_eager_forward_is_that_steps_error(runtime, local):
    gen = torch.Generator().manual_seed(5)
    ids, hidden = random_step(gen, 3)
    runtime.prepare(ids)
    runtime.model(hidden, ids)
    with pytest.raises(
        ple_ops.OffloadError, match=r"enqueue=False.*did not release \['blocks\.0\.ple'.*released them now"
    ) as e:
        runtime.release(enqueue=False)
    assert not e.value.fatal and flags(runtime) == [RESET] * LAYERS
    served_step(runtime, local, *random_step(gen, 3))


# --- D: a bad step is that step's error -------------------------------------------------------


@pytest.mark.parametrize(
    "ids, error, message",
    [
        (torch.tensor([1.7, 2.2]), TypeError, r"integer dtype, got torch.float32 \(ids are never rounded\)"),
        (torch.tensor([True, False]), TypeError, "integer dtype, got torch.bool"),
        (torch.arange(33), ValueError, r"1..32 ids, got shape \(33,\)"),
        (torch.arange(6).view(2, 3), ValueError, r"1-D with 1..32 ids, got shape \(2, 3\)"),
        (torch.zeros(0, dtype=torch.long), ValueError, r"got shape \(0,\)"),
        ([1, 2, 3], TypeError, "must be a tensor"),
        (torch.tensor([5, 17, 3], device="meta"), ValueError, "on the meta device, which holds no values"),
    ],
    ids=["float", "bool", "too-many", "2-d", "empty", "list", "meta"],
)
def test_bad_ids_are_refused_and_nothing_is_prepared(runtime, local, ids, error, message):
    with pytest.raises(error, match=message):
        runtime.prepare(ids)
    served_step(runtime, local, *random_step(torch.Generator().manual_seed(6), 2))


def test_a_forward_with_ids_that_are_not_a_1d_tensor_is_a_value_error_and_the_runtime_serves_on(runtime, local):
    gen = torch.Generator().manual_seed(15)
    ids, hidden = random_step(gen, 5)
    runtime.prepare(ids)
    for bad, shown in ((ids[0], r"a torch.int64 tensor of shape \(\) on cpu"), (ids.tolist(), r"list with 5 entries")):
        with pytest.raises(ValueError, match=rf"TablePle: input_ids must be a 1-D tensor of token ids, got {shown}"):
            runtime.model(hidden, bad)
    runtime.release()
    served_step(runtime, local, *random_step(gen, 4))


def test_integer_ids_of_any_width_are_served(runtime, local):
    gen = torch.Generator().manual_seed(7)
    for dtype in (torch.int32, torch.int16, torch.uint8):
        ids, hidden = random_step(gen, 5)
        ids = ids % 250
        runtime.prepare(ids.to(dtype))
        torch.testing.assert_close(runtime.model(hidden, ids), local(hidden, ids), rtol=0, atol=0)
        runtime.release()


def test_a_forward_with_another_token_count_than_prepared_raises(runtime, local):
    gen = torch.Generator().manual_seed(8)
    ids, hidden = random_step(gen, 4)
    runtime.prepare(ids)
    with pytest.raises(ple_ops.OffloadError, match=r"the forward has 3 tokens but the prepared step has 4") as e:
        runtime.model(hidden[:3], ids[:3])
    assert not e.value.fatal
    torch.testing.assert_close(runtime.model(hidden, ids), local(hidden, ids), rtol=0, atol=0)
    runtime.release()


@pytest.mark.parametrize("forward", [True, False], ids=["raised-by-the-forward", "raised-by-release"])
def test_an_out_of_vocabulary_id_fails_that_step_only(runtime, local, forward):
    gen = torch.Generator().manual_seed(9)
    ids, hidden = random_step(gen, 6)
    ids[4] = VOCAB + 17
    runtime.prepare(ids)
    match = r"(?s)step 1 failed in layer 'blocks\.0\.ple'.*keeps serving.*index 1017 is out of bounds"
    if forward:
        with pytest.raises(ple_ops.OffloadError, match=match) as e:
            runtime.model(hidden, ids)
        runtime.release()  # the step's error was raised once, by its forward
    else:
        with pytest.raises(ple_ops.OffloadError, match=match) as e:
            runtime.release()
    assert not e.value.fatal
    assert all((ple_ops.lookup(n).slot[:6] == 0xFF).all() for n in NAMES)
    runtime.check()
    for n in (6, 2, 11):
        served_step(runtime, local, *random_step(gen, n))


def test_an_exception_in_the_offload_process_surfaces_with_its_traceback(local):
    rt = ple_ops.OffloadRuntime(make_failing_model, max_tokens=16, device="cpu", step_timeout=2.0)
    try:
        ids = torch.arange(8)
        rt.prepare(ids)
        start = time.perf_counter()
        with pytest.raises(ple_ops.OffloadError, match="table shard unavailable"):
            rt.model(torch.zeros(8, 64), ids)
        assert time.perf_counter() - start < rt.step_timeout  # the failure's report, not the step's timeout
        # The step is still open after the forward raised; the refusal says how to go on.
        with pytest.raises(ple_ops.OffloadError, match=r"step 1 is still open .* Call release\(\) to end it first"):
            rt.prepare(torch.arange(3))
        rt.release()
        served_step(rt, local, *random_step(torch.Generator().manual_seed(10), 5))  # <= 5 tokens: served
    finally:
        rt.close()


# --- E: orderly shutdown --------------------------------------------------------------------


def test_no_shared_file_outlives_start_up_and_close_unblocks_a_prepared_step():
    rt = ple_ops.OffloadRuntime(make_model, max_tokens=8, device="cpu")
    paths = rt.shared_paths()
    # Both processes hold their mappings; the names are gone, so a crash leaks nothing in /dev/shm.
    assert len(paths) == 1 + LAYERS and not any(os.path.exists(p) for p in paths)
    rt.prepare(torch.arange(4))
    rt.close()
    assert not rt.process.is_alive()
    assert ple_ops.armed_names() == []


def test_close_is_idempotent_and_every_call_after_it_raises():
    with ple_ops.OffloadRuntime(make_model, max_tokens=8, device="cpu") as rt:
        ids = torch.arange(3)
        rt.prepare(ids)
        rt.model(torch.zeros(3, 64), ids)
        start = time.perf_counter()
        rt.close()  # stops and joins the offload process and the watchdog
        first = time.perf_counter() - start
    start = time.perf_counter()
    rt.close()
    rt.close()
    again = time.perf_counter() - start
    assert again < first, f"two more closes took {again:.4f} s, the first {first:.4f} s: they did its work again"
    calls = {
        "prepare": lambda: rt.prepare(ids),
        "release": rt.release,
        "release(enqueue=False)": lambda: rt.release(enqueue=False),
        "check": rt.check,
        "served_steps": rt.served_steps,
        "forward": lambda: rt.model(torch.zeros(3, 64), ids),
    }
    for what, call in calls.items():
        with pytest.raises(ple_ops.OffloadError, match="the OffloadRuntime is closed") as e:
            call()
        assert e.value.fatal, what


# --- F: construction ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def start_up():
    """Seconds this machine takes to start and close a runtime, timed in this run."""
    start = time.perf_counter()
    ple_ops.OffloadRuntime(make_model, max_tokens=8, device="cpu").close()
    return time.perf_counter() - start


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(max_tokens=0), ValueError, "OffloadRuntime: max_tokens must be a positive integer, got 0"),
        (dict(max_tokens=2.5), ValueError, "max_tokens must be a positive integer, got 2.5"),
        (dict(max_tokens=2.0), ValueError, r"max_tokens must be a positive integer, got 2\.0"),
        (dict(max_tokens=True), ValueError, "max_tokens must be a positive integer, got True"),
        (dict(step_timeout=0), ValueError, "step_timeout must be a finite number of seconds > 0, got 0"),
        (dict(step_timeout=-1.0), ValueError, "step_timeout must be"),
        (dict(step_timeout=float("nan")), ValueError, "step_timeout must be"),
        (dict(start_timeout=float("inf")), ValueError, "start_timeout must be"),
        (dict(step_timeout=True), ValueError, "OffloadRuntime: step_timeout must be a finite number .*got True"),
        (dict(start_timeout=True), ValueError, "OffloadRuntime: start_timeout must be a finite number .*got True"),
        (dict(step_timeout="30"), ValueError, "OffloadRuntime: step_timeout must be a finite number .*got '30'"),
        (dict(worker_threads=0), ValueError, "worker_threads must be a positive integer, got 0"),
        (dict(worker_threads=2.0), ValueError, r"worker_threads must be a positive integer, got 2\.0"),
        (
            dict(model_factory=make_model()),
            TypeError,
            "model_factory must be a callable that builds the model.*got TinyModel",
        ),
        (dict(model_factory="make_model"), TypeError, "model_factory must be a callable.*got str"),
        (dict(model_factory=lambda: make_model()), TypeError, "model_factory must be picklable"),
    ],
    ids=[
        "tokens-0",
        "tokens-float",
        "tokens-float-integral",
        "tokens-bool",
        "timeout-0",
        "timeout-neg",
        "timeout-nan",
        "start-inf",
        "timeout-bool",
        "start-bool",
        "timeout-str",
        "threads-0",
        "threads-float-integral",
        "module",
        "str",
        "lambda",
    ],
)
def test_constructor_arguments_are_checked_before_anything_starts(kwargs, error, message, start_up):
    before = set(multiprocessing.active_children())
    start = time.perf_counter()
    with pytest.raises(error, match=message):
        ple_ops.OffloadRuntime(**{"model_factory": make_model, "max_tokens": 8, "device": "cpu", **kwargs})
    # Faster than a start-up: no process was started (and stopped again) before the refusal.
    assert time.perf_counter() - start < start_up
    assert set(multiprocessing.active_children()) == before and ple_ops.armed_names() == []


SHM = "/dev/shm"


@pytest.mark.skipif(not os.path.isdir(SHM), reason="no /dev/shm here")
@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        pytest.param(
            dict(device="cuda"),
            ValueError,
            r"OffloadRuntime: device is 'cuda', but this machine has no CUDA device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is there"),
            id="cuda-without-cuda",
        ),
        pytest.param(dict(device="meta"), ValueError, r"device must be 'cuda' or 'cpu', got 'meta'", id="meta"),
        pytest.param(dict(device="gpu0"), ValueError, r"OffloadRuntime: device 'gpu0' is not a device", id="unknown"),
        pytest.param(
            dict(model_factory=make_unbuildable_model),
            ple_ops.OffloadError,
            r"(?s)failed while starting:.*ple_shard_0\.bin",
            id="worker-cannot-build",
        ),
        pytest.param(
            dict(model_factory=make_nothing),
            ple_ops.OffloadError,
            r"(?s)failed while starting:.*model_factory must return the model \(an nn.Module\), got NoneType",
            id="factory-returns-none",
        ),
        pytest.param(dict(start_timeout=0.01), ple_ops.OffloadError, r"did not answer within 0.01 s", id="timeout"),
    ],
)
def test_a_failed_start_leaves_nothing_behind(kwargs, error, message):
    before = set(os.listdir(SHM))
    children = set(multiprocessing.active_children())
    with pytest.raises(error, match=message):
        ple_ops.OffloadRuntime(**{"model_factory": make_model, "max_tokens": 8, "device": "cpu", **kwargs})
    assert set(os.listdir(SHM)) == before
    assert set(multiprocessing.active_children()) == children and ple_ops.armed_names() == []


@pytest.mark.skipif(not os.path.isdir(SHM), reason="no /dev/shm here")
def test_a_start_that_fails_after_its_shared_files_were_made_removes_them(runtime, local):
    # A second runtime over the same layer names fails while arming them: after its control
    # block and first slot were created in /dev/shm.
    before = set(os.listdir(SHM))
    with pytest.raises(ValueError, match=r"layer 'blocks\.0\.ple' is already armed .*: close\(\) that runtime first"):
        ple_ops.OffloadRuntime(make_model, max_tokens=8, device="cpu")
    assert set(os.listdir(SHM)) == before and ple_ops.armed_names() == NAMES
    served_step(runtime, local, *random_step(torch.Generator().manual_seed(12), 6))  # the first one serves on


@pytest.mark.skipif(not os.path.isdir(SHM), reason="no /dev/shm here")
def test_a_max_tokens_whose_slot_does_not_fit_in_shm_is_a_value_error_naming_it_and_leaves_nothing():
    # A slot one row past the whole of /dev/shm: tmpfs refuses the reservation at once. Sized
    # only, the slot's poisoning would touch its pages and die of SIGBUS past the free space.
    stat = os.statvfs(SHM)
    if stat.f_blocks == 0:
        pytest.skip("/dev/shm has no size limit here")
    row_bytes = WIDE * 4
    gen = torch.Generator().manual_seed(13)
    max_tokens = stat.f_blocks * stat.f_frsize // row_bytes + int(torch.randint(1, 100, (1,), generator=gen))
    before = set(os.listdir(SHM))
    children = set(multiprocessing.active_children())
    message = (
        rf"OffloadRuntime: max_tokens {max_tokens} is too large for the slot of layer 'ple' \({max_tokens} rows "
        rf"of {row_bytes} bytes\): SharedHostBuffer: nbytes {max_tokens * row_bytes} does not fit in {SHM}"
    )
    with pytest.raises(ValueError, match=message):
        ple_ops.OffloadRuntime(make_wide_model, max_tokens=max_tokens, device="cpu")
    assert set(os.listdir(SHM)) == before
    assert set(multiprocessing.active_children()) == children and ple_ops.armed_names() == []


@pytest.mark.skipif(not os.path.isdir(SHM), reason="no /dev/shm here")
def test_a_worker_dead_before_the_attach_is_sent_is_the_documented_error_and_leaves_nothing(monkeypatch):
    # The worker dies after its report, while this process makes the shared files: the Attach
    # then meets a closed pipe, which must read as a failed start, not as a BrokenPipeError.
    from ple_ops.runtime import process as process_mod

    real_attach = process_mod.Attach

    def attach_after_the_worker_died(*args):
        for child in multiprocessing.active_children():
            if child not in children:
                child.kill()
                child.join(60)
        return real_attach(*args)

    monkeypatch.setattr(process_mod, "Attach", attach_after_the_worker_died)
    before = set(os.listdir(SHM))
    children = set(multiprocessing.active_children())
    gen = torch.Generator().manual_seed(14)
    with pytest.raises(ple_ops.OffloadError, match=r"the offload process exited \(exit code -9\) during start-up") as e:
        ple_ops.OffloadRuntime(make_model, max_tokens=int(torch.randint(1, 64, (1,), generator=gen)), device="cpu")
    assert e.value.fatal
    assert set(os.listdir(SHM)) == before
    assert set(multiprocessing.active_children()) == children and ple_ops.armed_names() == []


def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            """
            import ple_ops
            from ple_models import make_model

            runtime = ple_ops.OffloadRuntime(make_model, max_tokens=4, device="cpu", start_timeout=120)
            print("started")
            runtime.close()
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode != 0 and "started" not in result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ple_ops.runtime.process.OffloadError: the offload process exited"), result.stderr[-3000:]
    assert 'if __name__ == "__main__":' in last and "bootstrapping" in last


def test_when_its_parent_is_killed_the_worker_says_so_in_one_line_and_exits(tmp_path):
    # The worker's stderr is its parent's (spawn passes it on): read to the end, which comes once
    # both processes (and multiprocessing's resource tracker, which exits with them) are gone.
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(
            """
            import time

            import ple_ops
            from ple_models import make_model

            if __name__ == "__main__":
                runtime = ple_ops.OffloadRuntime(make_model, max_tokens=4, device="cpu", start_timeout=120)
                print(runtime.process.pid, flush=True)
                time.sleep(300)
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    parent = subprocess.Popen(
        [sys.executable, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        worker_pid = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        _, stderr = parent.communicate(timeout=60)
    finally:
        if parent.poll() is None:
            parent.kill()
    assert stderr.splitlines() == [f"offload worker: the GPU process (pid {parent.pid}) died; exiting"], stderr[-3000:]
    status = Path(f"/proc/{worker_pid}/status")
    assert not status.exists() or "zombie" in status.read_text(), "the worker outlived its parent"


def test_a_runtime_dropped_without_close_stops_its_process_and_frees_its_names_for_the_next():
    gen = torch.Generator().manual_seed(15)
    local = make_model()
    runtime = ple_ops.OffloadRuntime(make_model, max_tokens=8, device="cpu")
    process = runtime.process
    del runtime  # as a notebook that runs its cell again, after `del`
    process.join(30)
    assert not process.is_alive() and ple_ops.armed_names() == []
    with ple_ops.OffloadRuntime(make_model, max_tokens=8, device="cpu") as runtime:
        served_step(runtime, local, *random_step(gen, 5))


def test_a_cast_of_the_served_model_is_refused_and_the_rows_stay_right():
    # A bf16 row copied into a buffer cast to fp16 (the same bytes per row) read wrong, silently.
    gen = torch.Generator().manual_seed(16)
    local = make_bf16_model()
    with ple_ops.OffloadRuntime(make_bf16_model, max_tokens=8, device="cpu") as runtime:
        for cast in (torch.nn.Module.half, torch.nn.Module.float, lambda m: m.to(torch.float16)):
            with pytest.raises(ValueError, match=r"TablePle: its rows are torch.bfloat16 on cpu, .* cannot be cast to"):
                cast(runtime.model)
        runtime.model.to("cpu", torch.bfloat16)  # neither a cast nor a move: passes
        ids, hidden = random_step(gen, 6)
        runtime.prepare(ids)
        for block, want in zip(runtime.model.blocks, local.blocks):
            got = block.ple(hidden.to(torch.bfloat16), ids)
            assert got.dtype == torch.bfloat16
            assert torch.equal(got.view(torch.int16), want.ple(hidden.to(torch.bfloat16), ids).view(torch.int16))
        runtime.release()


def test_more_worker_threads_than_cpus_is_a_value_error_before_anything_starts():
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    children = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=rf"worker_threads {cpus + 1} is more than the {cpus} CPUs"):
        ple_ops.OffloadRuntime(make_model, max_tokens=8, device="cpu", worker_threads=cpus + 1)
    assert set(multiprocessing.active_children()) == children and ple_ops.armed_names() == []


@pytest.mark.skipif(not os.path.isdir(SHM), reason="no /dev/shm here")
def test_a_worker_inside_a_long_forward_exits_soon_after_its_parent_is_killed(tmp_path):
    # The worker's main thread is inside forward_impl when the GPU process dies: it must not live
    # on until that returns, holding its files. The forward marks its return in a file: the worker
    # must be gone with the mark never made.
    script = tmp_path / "parent.py"
    returned = tmp_path / "forward_returned"
    script.write_text(
        textwrap.dedent(
            f"""
            import pathlib
            import time

            import torch

            import ple_ops

            FORWARD_S = {FORWARD_S}


            class SlowPle(ple_ops.PleOffloadLayer):
                def __init__(self):
                    super().__init__()
                    self.table = torch.nn.Embedding(16, 8)

                def forward_impl(self, input_ids):
                    if input_ids.shape[0] > 1:  # not the handshake's probe
                        time.sleep(FORWARD_S)
                        pathlib.Path({str(returned)!r}).touch()
                    return self.table(input_ids)


            class Model(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.ple = SlowPle()


            if __name__ == "__main__":
                runtime = ple_ops.OffloadRuntime(Model, max_tokens=4, device="cpu", start_timeout=120)
                runtime.prepare(torch.tensor([1, 2, 3]))
                print(runtime.process.pid, flush=True)
                time.sleep(300)
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    before = set(os.listdir(SHM))
    parent = subprocess.Popen(
        [sys.executable, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        worker_pid = int(parent.stdout.readline())
        time.sleep(1)  # the worker is in its forward now
        os.kill(parent.pid, signal.SIGKILL)
        _, stderr = parent.communicate(timeout=60)
    finally:
        if parent.poll() is None:
            parent.kill()
    status = Path(f"/proc/{worker_pid}/status")
    deadline = time.monotonic() + FORWARD_S + 30  # a hang fails the test instead of hanging it
    while status.exists() and "zombie" not in status.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not status.exists() or "zombie" in status.read_text(), "the worker outlived its parent"
    assert not returned.exists(), "the worker lived on until its forward returned"
    assert stderr.splitlines()[-1] == f"offload worker: the GPU process (pid {parent.pid}) died; exiting"
    assert set(os.listdir(SHM)) <= before


FORWARD_S = 60  # how long the forward above runs: far longer than the worker may outlive its parent


def test_the_worker_never_imports_the_runtime():
    # The runtime names the worker's entry point (its spawn target); the worker needs nothing of
    # the GPU side: it shares only control.py (the block and the messages), shared_memory.py and
    # the op floor (layer.py, the semaphore) with it.
    tree = ast.parse((ROOT / "ple_ops" / "runtime" / "worker.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    gpu_side = {"offload", "process", "transaction", "watchdog", "runtime", "OffloadRuntime"}
    assert not imported & gpu_side and not any("runtime" in name for name in imported), sorted(imported)
