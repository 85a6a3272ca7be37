"""kv_ops.HostBlockAllocator: a hypothesis state machine against a plain set of free blocks, and
each refusal on its own.

Invariants the state machine checks after every step:

* no block is handed out twice: every id ``allocate`` returns was free in the model, and no two
  live allocations share one;
* ``num_free`` is the model's count, and ``free_runs()`` are exactly the maximal runs of the
  model's free blocks: frees coalesce, with each other and with the free runs beside them, so
  after freeing everything there is one run of every block;
* ``allocate(n)`` returns the ids the rule names, computed here from the model by a plain loop:
  the shortest free run that holds ``n`` (the lowest on a tie), else the longest runs whole and
  the rest by best fit;
* a refused call (``OutOfHostBlocksError``, or a ``ValueError`` naming the argument) changes
  nothing.
"""

import numpy as np
import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kv_ops
from kv_ops import HostBlockAllocator, OutOfHostBlocksError

FORMS = ("list", "int64 array", "int32 array", "tensor")


def runs_of(free: set[int]) -> list[tuple[int, int]]:
    """The maximal runs of consecutive blocks in ``free``, as (first, length), lowest first."""
    runs: list[tuple[int, int]] = []
    for block in sorted(free):
        if runs and sum(runs[-1]) == block:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return runs


def expected_ids(free: set[int], n: int) -> list[int]:
    """What ``allocate(n)`` must return when the free blocks are ``free`` (at least ``n`` of them)."""
    remaining, pieces, rest = runs_of(free), [], n
    while not any(length >= rest for _, length in remaining):
        longest = max(remaining, key=lambda r: (r[1], -r[0]))
        remaining.remove(longest)
        pieces.append(longest)
        rest -= longest[1]
    start, _ = min((r for r in remaining if r[1] >= rest), key=lambda r: (r[1], r[0]))
    pieces.append((start, rest))
    return sorted(b for first, length in pieces for b in range(first, first + length))


def as_form(ids, form: str):
    if form == "list":
        return [int(i) for i in ids]
    if form == "tensor":
        return torch.tensor(ids, dtype=torch.int64)
    return np.asarray(ids, dtype=np.int64 if form == "int64 array" else np.int32)


class AllocatorMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 48))
    def start(self, num_blocks):
        self.num_blocks = num_blocks
        self.allocator = HostBlockAllocator(num_blocks)
        self.free = set(range(num_blocks))  # the model
        self.held: list[list[int]] = []  # live allocations (what is left of each after partial frees)

    def state(self):
        return self.allocator.num_free, self.allocator.free_runs(), self.allocator.largest_run

    @invariant()
    def matches_the_model(self):
        if not hasattr(self, "allocator"):
            return
        runs = runs_of(self.free)
        assert self.allocator.num_free == len(self.free)
        assert self.allocator.free_runs() == runs
        assert self.allocator.largest_run == max((length for _, length in runs), default=0)
        held = [b for ids in self.held for b in ids]
        assert len(held) == len(set(held)) and not set(held) & self.free
        assert len(held) + len(self.free) == self.num_blocks

    @rule(data=st.data())
    def allocate(self, data):
        # Mostly what fits, so that allocations pile up and fragment the free space; sometimes more.
        fits = st.integers(1, max(1, len(self.free)))
        n = data.draw(st.one_of(fits, fits, st.integers(1, self.num_blocks + 2)), label="n")
        if n > len(self.free):
            before = self.state()
            with pytest.raises(OutOfHostBlocksError, match=rf"{n} blocks asked for, but only {len(self.free)} of"):
                self.allocator.allocate(n)
            assert self.state() == before
            event("refused: too few free")
            return
        want = expected_ids(self.free, n)
        ids = self.allocator.allocate(n)
        assert isinstance(ids, np.ndarray) and ids.dtype == np.int64 and ids.shape == (n,)
        assert ids.tolist() == want
        assert set(want) <= self.free  # handed out only what was free
        pieces = len(runs_of(set(want)))
        event("one run" if pieces == 1 else "several runs")
        self.free -= set(want)
        self.held.append(want)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), form=st.sampled_from(FORMS))
    def free_some(self, data, form):
        """Give back part or all of one allocation, in any order: a preempted sequence's blocks
        come back together, a finished one's after others were freed."""
        which = data.draw(st.integers(0, len(self.held) - 1), label="allocation")
        ids = self.held[which]
        back = data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=len(ids), unique=True), label="ids")
        runs_before = len(runs_of(self.free))
        self.allocator.free(as_form(back, form))
        self.free |= set(back)
        self.held[which] = [b for b in ids if b not in back]
        if not self.held[which]:
            del self.held[which]
        if len(runs_of(self.free)) < runs_before + len(runs_of(set(back))):
            event("a free joined runs")

    @precondition(lambda self: self.held)
    @rule()
    def free_everything(self):
        for ids in self.held:
            self.allocator.free(ids)
        self.free |= {b for ids in self.held for b in ids}
        self.held = []
        assert self.allocator.free_runs() == [(0, self.num_blocks)]  # coalesced back into one run

    @rule(data=st.data(), defect=st.sampled_from(["range", "negative", "free already", "twice", "float"]))
    def invalid_free(self, data, defect):
        held = [b for ids in self.held for b in ids]
        good = data.draw(st.lists(st.sampled_from(held), max_size=3, unique=True), label="valid ids") if held else []
        if defect == "range":
            ids, message = good + [self.num_blocks], rf"ids\[{len(good)}\] = {self.num_blocks} is outside"
        elif defect == "negative":
            ids, message = [-1] + good, r"ids\[0\] = -1 is outside"
        elif defect == "free already" and self.free:
            block = data.draw(st.sampled_from(sorted(self.free)), label="free block")
            ids, message = good + [block], rf"ids holds block {block}, which is free already"
        elif defect == "twice" and held:
            block = data.draw(st.sampled_from(held), label="repeated block")
            ids, message = [block, *[b for b in good if b != block], block], rf"ids names block {block} more than once"
        else:
            ids, message = [b + 0.5 for b in good] or [0.5], r"ids must be integer block ids, got a list of float64"
        before = self.state()
        with pytest.raises(ValueError, match=r"^HostBlockAllocator\.free: " + message):
            self.allocator.free(ids)
        assert self.state() == before


TestAllocator = AllocatorMachine.TestCase
TestAllocator.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


# --- the rule on fixed layouts ------------------------------------------------------------------


def fragmented(lengths_and_gaps: list[tuple[int, int]]) -> tuple[HostBlockAllocator, list[int]]:
    """An allocator whose free runs have the given lengths, each followed by a held gap."""
    total = sum(length + gap for length, gap in lengths_and_gaps)
    allocator = HostBlockAllocator(total)
    everything = allocator.allocate(total).tolist()
    first, starts = 0, []
    for length, gap in lengths_and_gaps:
        allocator.free(everything[first : first + length])
        starts.append(first)
        first += length + gap
    return allocator, starts


def test_best_fit_takes_the_shortest_run_that_holds_the_request():
    allocator, (a, b, c) = fragmented([(8, 1), (3, 1), (5, 1)])
    assert allocator.allocate(4).tolist() == list(range(c, c + 4))  # 5 holds 4 and is shorter than 8
    assert allocator.allocate(3).tolist() == list(range(b, b + 3))  # exactly 3
    assert allocator.free_runs() == [(a, 8), (c + 4, 1)]


def test_without_a_run_that_holds_it_the_longest_runs_go_whole_and_the_rest_by_best_fit():
    allocator, (a, b, c) = fragmented([(10, 1), (8, 1), (3, 1)])
    # 12: the 10 whole, then 2 from the 3 (the shortest run holding the rest), keeping the 8.
    ids = allocator.allocate(12).tolist()
    assert ids == list(range(a, a + 10)) + [c, c + 1]
    assert allocator.free_runs() == [(b, 8), (c + 2, 1)]


def test_frees_in_any_order_join_their_neighbours():
    allocator = HostBlockAllocator(10)
    first, middle, last = allocator.allocate(3), allocator.allocate(4), allocator.allocate(3)
    allocator.free(last[::-1])
    assert allocator.free_runs() == [(7, 3)]
    allocator.free(first)
    assert allocator.free_runs() == [(0, 3), (7, 3)]
    allocator.free(torch.from_numpy(middle[[2, 0, 3, 1]]))  # joins both sides: one run again
    assert allocator.free_runs() == [(0, 10)] and allocator.num_free == 10 and allocator.largest_run == 10


def test_freeing_nothing_changes_nothing():
    allocator = HostBlockAllocator(4)
    allocator.allocate(2)
    allocator.free([])
    assert allocator.free_runs() == [(2, 2)] and allocator.num_free == 2


# --- refusals -------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "8", None])
def test_a_bad_size_is_a_value_error_naming_num_blocks(bad):
    with pytest.raises(ValueError, match=rf"^HostBlockAllocator: num_blocks must be a positive integer, got {bad!r}$"):
        HostBlockAllocator(bad)


@pytest.mark.parametrize("bad", [0, -1, False, 1.5, "2"])
def test_a_bad_request_is_a_value_error_naming_n(bad):
    allocator = HostBlockAllocator(4)
    with pytest.raises(ValueError, match=rf"^HostBlockAllocator\.allocate: n must be a positive integer, got {bad!r}$"):
        allocator.allocate(bad)
    assert allocator.num_free == 4


@pytest.mark.parametrize("n", [5, 9])
def test_too_few_free_blocks_is_a_memory_error_a_scheduler_can_catch(n):
    allocator = HostBlockAllocator(8)
    allocator.allocate(4)
    with pytest.raises(
        OutOfHostBlocksError, match=rf"^HostBlockAllocator\.allocate: {n} blocks asked for, but only 4 of 8 are free$"
    ) as raised:
        allocator.allocate(n)
    assert isinstance(raised.value, MemoryError) and not isinstance(raised.value, ValueError)
    assert kv_ops.OutOfHostBlocksError is OutOfHostBlocksError
    assert allocator.free_runs() == [(4, 4)]
    assert allocator.allocate(4).tolist() == [4, 5, 6, 7]  # what is free is still handed out


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([1, 8], r"ids\[1\] = 8 is outside \[0, 8\)"),
        (np.array([-2], dtype=np.int64), r"ids\[0\] = -2 is outside \[0, 8\)"),
        ([2, 1, 2], r"ids names block 2 more than once"),
        ([1, 6], r"ids holds block 6, which is free already"),  # never handed out
        ([0.0, 1.0], r"ids must be integer block ids, got a list of float64"),
        (np.array([1.0]), r"ids must be a 1-D int32 or int64 array, got a numpy float64 array"),
        (np.array([[1, 2]]), r"ids must be a 1-D int32 or int64 array, got a numpy int64 array of shape \(1, 2\)"),
        (torch.tensor([True]), r"ids must be a 1-D int32 or int64 tensor, got torch.bool"),
        (torch.tensor([1], device="meta"), r"ids must be on the CPU, got a tensor on meta"),
        ("12", r"ids must be integer block ids"),
    ],
    ids=["range", "negative", "twice", "free", "float list", "float array", "2-D", "bool", "meta", "string"],
)
def test_a_bad_free_is_a_value_error_naming_ids_and_frees_nothing(ids, message):
    allocator = HostBlockAllocator(8)
    allocator.allocate(4)
    with pytest.raises(ValueError, match=r"^HostBlockAllocator\.free: " + message):
        allocator.free(ids)
    assert allocator.free_runs() == [(4, 4)] and allocator.num_free == 4


def test_a_second_free_of_the_same_blocks_is_refused():
    allocator = HostBlockAllocator(8)
    ids = allocator.allocate(3)
    allocator.free(ids)
    with pytest.raises(ValueError, match=r"^HostBlockAllocator\.free: ids holds block 0, which is free already"):
        allocator.free(ids)
    assert allocator.free_runs() == [(0, 8)]
