"""The control block: both processes compute one layout, and every word one side writes the other reads."""

import multiprocessing
import os
import pickle

import pytest
import torch

from ple_ops.runtime.control import (
    IDLE,
    LINE,
    WAITING,
    Attach,
    ControlBlock,
    LayerSpec,
    LayersReport,
    StepFailed,
    Word,
    WorkerFailed,
)
from ple_ops.semaphore import DONE, RESET, CpuGpuSemaphore


@pytest.fixture
def block():
    control = ControlBlock.create(max_tokens=37, num_layers=5, map_for_gpu=False)
    yield control
    control.unlink()


def test_a_new_block_is_zero_flags_reset_streams_idle(block):
    assert all(block.get(w) == 0 for w in Word)
    assert [f.host_value() for f in block.flags] == [RESET] * 5
    assert [w.host_value() for w in block.waiting] == [IDLE] * 5
    assert [block.delivered(i) for i in range(5)] == [0] * 5


def test_words_written_on_one_side_are_read_on_the_other(block):
    other = ControlBlock.attach(pickle.loads(pickle.dumps(block.handle)))  # what the worker gets
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(-(2**40), 2**40, (37,), generator=gen)
    block.ids.copy_(ids)
    values = {w: int(v) for w, v in zip(Word, torch.randint(1, 2**40, (len(Word),), generator=gen))}
    for w, v in values.items():
        block.set(w, v)
    for i in range(5):
        if i % 2:
            other.flags[i].host_signal()
        other.set_delivered(i, 100 + i)
        block.waiting[i].flag.fill_(WAITING if i in (1, 4) else IDLE)
    assert torch.equal(other.ids, ids)
    assert {w: other.get(w) for w in Word} == values
    assert [f.host_value() for f in block.flags] == [DONE if i % 2 else RESET for i in range(5)]
    assert [block.delivered(i) for i in range(5)] == [100 + i for i in range(5)]
    assert [w.host_value() for w in other.waiting] == [IDLE, WAITING, IDLE, IDLE, WAITING]


def test_layout_keeps_writers_apart_and_layers_on_their_own_lines(block):
    base = block.buffer.bytes.data_ptr()
    runtime_words = {Word.REQUEST, Word.NUM_TOKENS, Word.STOP}  # the worker's: TAKEN, SERVED, ...
    assert {8 * w // LINE for w in runtime_words} == {0}
    assert {8 * w // LINE for w in set(Word) - runtime_words} == {1}
    assert block.ids.data_ptr() - base == 2 * LINE
    lines = [(f.flag.data_ptr() - base) // LINE for f in block.flags]
    assert lines == sorted(set(lines)) and lines[0] * LINE >= 2 * LINE + 8 * 37
    for f, w in zip(block.flags, block.waiting):
        assert f.flag.data_ptr() % LINE == 0 and w.flag.data_ptr() == f.flag.data_ptr() + 4


def test_attach_refuses_a_buffer_of_another_geometry(block):
    handle = block.handle
    wrong = type(handle)(handle.buffer, handle.max_tokens + 100, handle.num_layers)
    with pytest.raises(ValueError, match="layout needs"):
        ControlBlock.attach(wrong)


def _child_serves_one_word(handle):
    other = ControlBlock.attach(handle)
    other.flags[0].host_wait(DONE, timeout=30)
    other.set(Word.SERVED, other.get(Word.REQUEST) * 2)
    other.set_delivered(0, 9)


def test_a_cuda_free_process_attaches_by_handle():
    block = ControlBlock.create(max_tokens=4, num_layers=1, map_for_gpu=False)
    child = multiprocessing.get_context("spawn").Process(target=_child_serves_one_word, args=(block.handle,))
    child.start()
    try:
        block.set(Word.REQUEST, 21)
        block.flags[0].host_signal()
        child.join(60)
    finally:
        if child.is_alive():  # never leave a child behind a failed test
            child.kill()
            child.join(10)
    assert child.exitcode == 0
    assert block.get(Word.SERVED) == 42 and block.delivered(0) == 9
    block.unlink()


def test_messages_pickle_with_their_fields(block):
    spec = LayerSpec("blocks.0.ple", 64, torch.bfloat16)
    assert spec.row_bytes == 128 and spec.rows is None  # computed rows: no table size to check ids against
    gathered = LayerSpec("blocks.1.ple", 32, torch.float32, rows=1000)
    for message in (
        LayersReport((spec, gathered)),
        Attach(block.handle, (block.buffer.handle,)),
        WorkerFailed("Traceback ..."),
        StepFailed(3, "blocks.0.ple", "IndexError"),
    ):
        assert pickle.loads(pickle.dumps(message)) == message


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here")
def test_a_block_that_fails_to_build_leaves_no_file(monkeypatch):
    # The caller never gets the block, so only create() can remove its file's name.
    def refuse(*args, **kwargs):
        raise RuntimeError("no flag here")

    monkeypatch.setattr(CpuGpuSemaphore, "in_host_memory", refuse)
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(RuntimeError, match="no flag here"):
        ControlBlock.create(max_tokens=8, num_layers=2, map_for_gpu=False)
    assert set(os.listdir("/dev/shm")) == before
