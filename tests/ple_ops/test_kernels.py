"""The kernels a captured PLE step replays (ple_ops.kernels), word by word and byte by byte.

Without a GPU they run under TRITON_INTERPRET=1 on CPU tensors; with one, on the GPU, over words
and a slot in page-locked host memory seen through their device addresses, as the runtime's are.
"""

import time

import pytest
import torch

from kv_ops import device_view, pinned_empty
from ple_ops import kernels
from ple_ops.runtime.control import IDLE, WAITING
from ple_ops.semaphore import DONE, RESET, release_fence

ON_GPU = torch.cuda.is_available()
POISON = 0x5A5A5A5A


class Words:
    """A flag and a waiting word (and a neighbour nobody may touch) in host memory, as the GPU sees them."""

    def __init__(self, flag: int, waiting: int):
        self.host = pinned_empty(4, dtype=torch.int32) if ON_GPU else torch.empty(4, dtype=torch.int32)
        self.host.copy_(torch.tensor([flag, waiting, POISON, POISON], dtype=torch.int32))
        self.device = device_view(self.host) if ON_GPU else self.host
        self.flag, self.waiting = self.device[0:1], self.device[1:2]

    def values(self) -> list[int]:
        if ON_GPU:
            torch.cuda.synchronize()
        return self.host.tolist()


def host_bytes(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bytes in (page-locked) host memory, and the tensor a kernel reads them through."""
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    if not ON_GPU:
        return data, data
    host = pinned_empty(n, dtype=torch.uint8)
    host.copy_(data)
    return host, device_view(host)


def poisoned_out(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).to("cuda" if ON_GPU else "cpu")


# 0: the wait alone; odd sizes (masked tails, byte-wide accesses); past one tile per program
# (several passes of the copy loop).
SIZES = [0, 1, 4096, 12_345, kernels.NUM_PROGRAMS * kernels.TILE_BYTES + 4097]


@pytest.mark.parametrize("nbytes", SIZES)
def test_wait_copy_marks_the_stream_waiting_and_copies_exactly_the_first_nbytes(nbytes):
    gen = torch.Generator().manual_seed(nbytes)
    size = nbytes + 4099  # bytes past nbytes must stay as they were
    _, src = host_bytes(size, gen)
    out = poisoned_out(size, gen)
    before = out.clone()
    words = Words(DONE, IDLE)
    kernels.wait_copy(words.flag, words.waiting, src, out, nbytes)
    # The flag stays raised (the release resets it); the word says a stream waited on it.
    assert words.values() == [DONE, WAITING, POISON, POISON]
    assert torch.equal(out[:nbytes].cpu(), src[:nbytes].cpu())
    assert torch.equal(out[nbytes:], before[nbytes:])


def test_a_wait_without_a_waiting_word_touches_no_word():
    gen = torch.Generator().manual_seed(1)
    _, src = host_bytes(256, gen)
    out = poisoned_out(256, gen)
    words = Words(DONE, POISON)
    kernels.wait_copy(words.flag, None, src, out, 200)
    assert words.values() == [DONE, POISON, POISON, POISON]
    assert torch.equal(out[:200].cpu(), src[:200].cpu())


def test_release_clears_the_waiting_word_then_resets_the_flag():
    words = Words(DONE, WAITING)
    kernels.release(words.flag, words.waiting)
    assert words.values() == [RESET, IDLE, POISON, POISON]


def test_release_without_a_waiting_word_only_resets_the_flag():
    words = Words(DONE, POISON)
    kernels.release(words.flag, None)
    assert words.values() == [RESET, POISON, POISON, POISON]


@pytest.mark.gpu
def test_rows_of_whole_16_byte_words_are_copied_16_bytes_at_a_time():
    # Byte by byte, each load of the slot would be a PCIe read of its own (a copy loop whose
    # alignment Triton could not see cost 18-21 us per 32 KiB layer instead of 3.7).
    gen = torch.Generator().manual_seed(9)
    _, src = host_bytes(32768, gen)
    out = poisoned_out(32768, gen)
    words = Words(DONE, IDLE)
    kernel = kernels.wait_copy(words.flag, words.waiting, src, out, 32768)
    torch.cuda.synchronize()
    ptx = kernel.asm["ptx"]
    assert all(".v4." in line for line in ptx.splitlines() if "global" in line and ("ld." in line or "st." in line)), (
        ptx[:2000]
    )
    assert torch.equal(out.cpu(), src.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("release", [False, True], ids=["wait_copy", "release"])
def test_the_kernel_waits_for_the_flag_and_the_host_sees_it_waiting(release):
    """What the watchdog relies on: while the program spins, the host reads WAITING; and nothing
    after the wait in stream order (the copy, the reset) happens before the host raises the flag."""
    gen = torch.Generator().manual_seed(5)
    host_src, src = host_bytes(8192, gen)
    out = poisoned_out(8192, gen)
    before = out.clone()
    words = Words(RESET, IDLE)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        if release:
            kernels.release(words.flag, words.waiting)
        else:
            kernels.wait_copy(words.flag, words.waiting, src, out, 8192)
        done = torch.cuda.Event()
        done.record()
    try:
        deadline = time.monotonic() + 5.0
        while words.host[1].item() != WAITING and time.monotonic() < deadline:
            time.sleep(1e-4)
        assert words.host[1].item() == WAITING, "the host never saw the stream's waiting word"
        time.sleep(0.05)
        assert not done.query(), "the kernel finished before the flag was raised"
        assert words.host[0].item() == RESET
        host_src.copy_(torch.randint(0, 256, (8192,), dtype=torch.uint8, generator=gen))  # rows written late
    finally:
        # Raised whatever happened above: a failed check must not leave the GPU spinning (every
        # later synchronize would hang).
        release_fence()  # the rows before the flag, as a producer publishes them
        words.host[0] = DONE
    deadline = time.monotonic() + 5.0
    while not done.query():  # polled, not synchronized: a kernel that never sees the flag fails here
        assert time.monotonic() < deadline, "the kernel did not see the raised flag within 5 s"
        time.sleep(1e-4)
    if release:
        assert words.values() == [RESET, IDLE, POISON, POISON]
        assert torch.equal(out, before)
    else:
        assert words.values() == [DONE, WAITING, POISON, POISON]
        assert torch.equal(out.cpu(), host_src), "the copy read rows from before the flag was raised"
