"""The offload worker's serving loop, run in a thread of this process so that its order is visible:
it computes a layer's rows before it waits for the previous step's release (item A), a failed
forward_impl poisons that step only, and rows past a step's count are poison, never stale."""

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
from ple_models import DIM, VOCAB, LookupPle, TablePle

import ple_ops
from ple_ops import reference
from ple_ops.runtime.control import Attach, ControlBlock, LayerSpec, LayersReport, Phase, Ready, StepFailed, Word
from ple_ops.runtime.shared_memory import SharedHostBuffer
from ple_ops.runtime.worker import ServedLayer, StopServing, handshake, lookup_rows, serve
from ple_ops.semaphore import DONE

MAX_TOKENS = 8


class Counting(TablePle):
    """A table layer that counts its calls and refuses ids listed in ``refuse``."""

    def __init__(self, layer):
        super().__init__(layer)
        self.calls = 0
        self.refuse: set[int] = set()

    def forward_impl(self, input_ids):
        self.calls += 1
        if self.refuse & set(input_ids.tolist()):
            raise KeyError(f"shard for ids {sorted(self.refuse)} unavailable")
        return super().forward_impl(input_ids)


class Served:
    """A control block, two poisoned slots and the serving loop in a thread."""

    def __init__(self):
        self.control = ControlBlock.create(MAX_TOKENS, 2, map_for_gpu=False)
        self.modules = [Counting(i) for i in range(2)]
        self.layers = []
        for i, module in enumerate(self.modules):
            slot = torch.empty(MAX_TOKENS, DIM * 4, dtype=torch.uint8)
            reference.poison_rows(slot)
            self.layers.append(
                ServedLayer(i, LayerSpec(f"l{i}", DIM, torch.float32), module, self.control.flags[i], slot)
            )
        self.reports: list[tuple[StepFailed, int]] = []  # with Word.FAILED as the report saw it
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            serve(self.control, self.layers, lambda m: self.reports.append((m, self.control.get(Word.FAILED))))
        except BaseException as exc:  # StopServing, or a bug to report
            self.error = exc

    def request(self, ids):
        self.control.ids[: len(ids)].copy_(ids)
        self.control.set(Word.NUM_TOKENS, len(ids))
        self.control.set(Word.REQUEST, self.control.get(Word.REQUEST) + 1)

    def until(self, condition, what):
        deadline = time.monotonic() + 10
        while not condition():
            assert self.thread.is_alive(), f"the worker stopped: {self.error!r}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.001)

    def rows(self, i, n):
        return self.layers[i].slot[:n].view(torch.float32)

    def stop(self):
        self.control.set(Word.STOP, 1)
        self.thread.join(5)
        assert isinstance(self.error, StopServing), self.error
        self.control.unlink()


@pytest.fixture
def served():
    s = Served()
    yield s
    s.stop()


def test_rows_are_computed_before_the_wait_for_the_previous_release(served):
    c = served.control
    for flag in c.flags:
        flag.host_signal()  # the previous step's rows are still being pulled
    ids = torch.randint(0, VOCAB, (5,), generator=torch.Generator().manual_seed(3))
    served.request(ids)
    served.until(
        lambda: c.get(Word.WORKER_PHASE) == Phase.AWAITING_RESET and served.modules[0].calls == 1, "layer 0 computed"
    )
    assert c.get(Word.WORKER_LAYER) == 0 and c.delivered(0) == 0
    assert c.get(Word.TAKEN) == 1  # the ids were copied first: the runtime may write the next ones
    assert (served.layers[0].slot == 0xFF).all()  # the slot is not touched before the release
    c.flags[0].host_reset()  # the consumer releases layer 0
    served.until(lambda: c.delivered(0) == 1, "layer 0 published")
    assert c.flags[0].host_value() == DONE
    torch.testing.assert_close(served.rows(0, 5), served.modules[0].table[ids], rtol=0, atol=0)
    served.until(
        lambda: c.get(Word.WORKER_LAYER) == 1 and c.get(Word.WORKER_PHASE) == Phase.AWAITING_RESET, "layer 1 waits"
    )
    assert served.modules[1].calls == 1 and c.get(Word.SERVED) == 0
    c.flags[1].host_reset()
    served.until(lambda: c.get(Word.SERVED) == 1, "step 1 served")
    torch.testing.assert_close(served.rows(1, 5), served.modules[1].table[ids], rtol=0, atol=0)


def test_a_failing_forward_impl_poisons_that_step_only(served):
    c = served.control
    gen = torch.Generator().manual_seed(4)
    good = torch.randint(0, VOCAB, (6,), generator=gen)
    served.request(good)
    served.until(lambda: c.get(Word.SERVED) == 1, "step 1")
    for flag in c.flags:
        flag.host_reset()
    served.modules[1].refuse = {int(good[2])}
    served.request(good[:4])
    served.until(lambda: c.get(Word.SERVED) == 2, "step 2")
    ((report, failed_then),) = served.reports
    assert (
        (report.step, report.layer) == (2, "l1")
        and "KeyError" in report.traceback
        and "unavailable" in report.traceback
    )
    assert failed_then < 2 and c.get(Word.FAILED) == 2  # the message went out before the step was marked
    # Layer 0 was computed before layer 1 failed: its rows stand. Layer 1 is poisoned, flag raised.
    torch.testing.assert_close(served.rows(0, 4), served.modules[0].table[good[:4]], rtol=0, atol=0)
    assert (served.layers[1].slot == 0xFF).all() and [f.host_value() for f in c.flags] == [DONE, DONE]
    assert [c.delivered(i) for i in range(2)] == [2, 2]
    # The next step is served normally.
    for flag in c.flags:
        flag.host_reset()
    served.modules[1].refuse = set()
    served.request(good[1:4])
    served.until(lambda: c.get(Word.SERVED) == 3, "step 3")
    for i in range(2):
        torch.testing.assert_close(served.rows(i, 3), served.modules[i].table[good[1:4]], rtol=0, atol=0)


def test_rows_past_a_shorter_step_are_poison_not_the_previous_steps(served):
    c = served.control
    gen = torch.Generator().manual_seed(5)
    for step, n in enumerate((7, 3, 5, 1), start=1):
        ids = torch.randint(0, VOCAB, (n,), generator=gen)
        served.request(ids)
        served.until(lambda step=step: c.get(Word.SERVED) == step, f"step {step}")
        for i, layer in enumerate(served.layers):
            torch.testing.assert_close(served.rows(i, n), served.modules[i].table[ids], rtol=0, atol=0)
            assert (layer.slot[n:] == 0xFF).all()
            c.flags[i].host_reset()


def test_wrong_rows_from_forward_impl_are_a_failed_step(served):
    served.modules[0].forward_impl = lambda ids: torch.zeros(len(ids), DIM + 1)
    served.request(torch.arange(3))
    served.until(lambda: served.control.get(Word.SERVED) == 1, "step 1")
    ((report, _),) = served.reports
    assert report.layer == "l0" and "returned (3, 65) torch.float32, expected (3, 64) torch.float32" in report.traceback
    assert all((layer.slot == 0xFF).all() for layer in served.layers)
    assert [f.host_value() for f in served.control.flags] == [DONE, DONE] and served.control.get(Word.FAILED) == 1


def test_only_a_layer_the_worker_can_gather_as_a_pure_lookup_is_gathered():
    # lookup_rows gives the table's rows as bytes for LookupPle, and None wherever gathering them
    # could differ from forward_impl or cannot be done in one numpy call.
    spec = LayerSpec("l", DIM, torch.float32)
    pure = LookupPle(0)
    rows = lookup_rows(pure, spec)
    assert rows.shape == (VOCAB, DIM * 4) and rows.dtype.name == "uint8"
    assert torch.equal(torch.from_numpy(rows[[3, 1]]).view(torch.float32), pure.table[[3, 1]])
    assert lookup_rows(TablePle(0), spec) is None  # no lookup_table
    assert lookup_rows(pure, LayerSpec("l", DIM, torch.bfloat16)) is None  # rows of another dtype
    assert lookup_rows(pure, LayerSpec("l", DIM + 1, torch.float32)) is None  # of another width
    replaced = LookupPle(0)
    replaced.forward_impl = lambda ids: replaced.table[ids] * 2
    assert lookup_rows(replaced, spec) is None  # the instance's own forward_impl wins
    strided = LookupPle(0)
    strided.lookup_table = lambda: strided.table.t().contiguous().t()
    assert lookup_rows(strided, spec) is None  # not contiguous rows


class HandshakePipe:
    """The GPU process's end of the handshake: records what the worker sends, answers its report
    with a control block and one slot per reported layer."""

    def __init__(self):
        self.sent = []
        self.buffers = []

    def send(self, message):
        self.sent.append(message)

    def recv(self):
        specs = self.sent[0].layers
        control = ControlBlock.create(MAX_TOKENS, len(specs), map_for_gpu=False)
        self.buffers = [control.buffer] + [SharedHostBuffer(MAX_TOKENS * s.row_bytes, register=False) for s in specs]
        return Attach(control.handle, tuple(b.handle for b in self.buffers[1:]))


class LookupAndComputed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gathered, self.computed = LookupPle(0), TablePle(1)


def test_the_handshake_reports_the_table_rows_of_a_gathered_layer_and_none_for_computed_rows(monkeypatch):
    # The runtime's prepare() refuses an id outside a reported table: only a layer the worker
    # gathers from its table (where such an id fails the step) may report one.
    monkeypatch.setattr(ple_ops.layer, "mark_offload_worker", lambda: None)  # this process stays local
    pipe = HandshakePipe()
    try:
        _, layers = handshake(LookupAndComputed, pipe)
        report = pipe.sent[0]
        assert isinstance(report, LayersReport) and isinstance(pipe.sent[-1], Ready)
        assert [(s.name, s.dim, s.rows) for s in report.layers] == [("gathered", DIM, VOCAB), ("computed", DIM, None)]
        assert layers[0].lookup is not None and layers[1].lookup is None
    finally:
        for buffer in pipe.buffers:
            buffer.unlink()


ROOT = Path(__file__).resolve().parents[2]
# The GPU process kills itself once it made the control block and the slots, before the worker
# attached: only the worker is left to know that the files exist.
KILLED_IN_START_UP = """
import multiprocessing, os, signal, sys
import ple_ops
from ple_ops.runtime import process
from ple_models import make_model


def attach_then_die(*args):
    (worker,) = multiprocessing.active_children()
    print(worker.pid, flush=True)
    os.kill(os.getpid(), int(sys.argv[1]))


if __name__ == "__main__":
    process.Attach = attach_then_die
    ple_ops.OffloadRuntime(make_model, max_tokens=int(sys.argv[2]), device="cpu", start_timeout=120)
"""


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here")
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_a_gpu_process_killed_in_start_up_leaves_no_file_the_worker_removes_them(tmp_path, how):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(KILLED_IN_START_UP))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    max_tokens = int(torch.randint(1, 256, (1,), generator=torch.Generator().manual_seed(int(how))))
    parent = subprocess.Popen(
        [sys.executable, str(script), str(int(how)), str(max_tokens)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        worker_pid = int(parent.stdout.readline())
        _, stderr = parent.communicate(timeout=120)  # the worker's stderr is the parent's: read to its end
    finally:
        if parent.poll() is None:
            parent.kill()
    assert parent.returncode == -how, stderr[-3000:]
    status = Path(f"/proc/{worker_pid}/status")
    assert not status.exists() or "zombie" in status.read_text(), "the worker outlived its parent"
    left = [name for name in os.listdir("/dev/shm") if name.startswith(f"offload-ops.{parent.pid}.")]
    assert left == [], stderr[-3000:]
    assert stderr.splitlines()[-1] == f"offload worker: the GPU process (pid {parent.pid}) died; exiting", stderr
