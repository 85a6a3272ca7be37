"""A hypothesis state machine drives SlotLoads on the CPU: decode steps of one to three positions,
crops, resets, beam reorders and copies (prefix caching), in any order. Two sets of slot loads
of one plan take the same steps, one of them also loading the next step's first layers ahead
where the plan says (as the cache's ``load_ahead`` does), checked against a plain model of what
every layer has written.

Invariants:

* every layer reads, in its slot, exactly the positions it has written so far;
* a streamed layer whose slot holds another layer has every written position on its host copy;
* the loads ahead of a step and the step's own move the bytes of the step alone (the claim lets
  no load move twice), where nothing changed the lengths in between.

Every written position is fresh random values, never zeros, so a stale or misplaced one shows.
"""

import itertools

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kv_ops.transfer.slot_loads import SlotLoads
from kv_ops.transfer.slot_plan import plan_slots

MAX_LEN = 12
_names = itertools.count()


class Decoder:
    """One set of slot loads and the lengths its layers advance, as HostOffloadedCache drives them."""

    def __init__(self, plan, keys, values):
        self.plan, self.keys, self.values = plan, keys, values
        self.lengths = [torch.zeros((), dtype=torch.int64) for _ in range(plan.layers)]
        self.loads = SlotLoads(f"slot-machine-{next(_names)}")
        self.loads.allocate(plan, keys, values, MAX_LEN, self.lengths)

    def copied(self) -> "Decoder":
        """A new set allocated alike, holding what this one holds (the cache's deep copy)."""
        new = Decoder(self.plan, self.keys, self.values)
        for mine, theirs in zip(new.lengths, self.lengths, strict=True):
            mine.copy_(theirs)
        new.loads.copy_from(self.loads)
        return new

    def load(self, k: int) -> None:
        """What the step's prefetch op does on the CPU."""
        slot_k, slot_v = self.loads.slots[self.plan.slot[k]]
        self.loads.load_now(k, slot_k, slot_v, int(self.lengths[k]), int(self.lengths[self.plan.evicts[k]]))

    def step(self, truth, fresh, ahead: bool) -> int:
        """Each layer queues its loads, reads its slot (checked against ``truth``), then writes
        ``fresh[j]`` (keys, values) after its positions; with ``ahead``, it also loads the next
        step's first layers where the plan says, as the cache's update does after its own wait.
        Returns the bytes those loads ahead moved."""
        moved = 0
        for j in range(self.plan.layers):
            for target in self.plan.issues.get(j, ()):
                self.load(target)
            for target in self.plan.ahead.get(j, ()) if ahead else ():
                before = self.loads.moved
                self.loads.queue_ahead(target)
                moved += self.loads.moved - before
            n = int(self.lengths[j])
            for got, want, new in zip(self.loads.slots[self.plan.slot[j]], truth[j], fresh[j], strict=True):
                assert torch.equal(got[:, :, :n], want[:, :, :n]), f"layer {j} reads stale positions"
                got[:, :, n : n + new.shape[2]] = new
            self.lengths[j] += fresh[j][0].shape[2]
        return moved

    def shorten(self, back: int) -> None:
        for n in self.lengths:
            n.sub_(back)
        self.loads.crop()

    def reset(self) -> None:
        for n in self.lengths:
            n.zero_()
        self.loads.reset()

    def check_host(self, truth, length: int) -> None:
        for k in self.plan.streamed:
            if int(self.loads.held[self.plan.slot[k]]) != k:
                for got, want in zip(self.loads.host[k], truth[k], strict=True):
                    assert torch.equal(got[:, :, :length], want[:, :, :length]), f"layer {k}'s host copy is stale"


class SlotMachine(RuleBasedStateMachine):
    @initialize(
        layers=st.integers(2, 7),
        extra=st.integers(0, 3),
        shape=st.sampled_from([(1, 1, 4), (2, 3, 2)]),
        last_resident=st.booleans(),
    )
    def allocate(self, layers, extra, shape, last_resident):
        batch, heads, dim = shape
        plan = plan_slots(layers, min(layers, 2 + extra), last_resident)
        keys, values = torch.randn(batch, heads, 1, dim), torch.randn(batch, heads, 1, dim + 1)
        self.ahead, self.alone = Decoder(plan, keys, values), Decoder(plan, keys, values)
        self.truth = [tuple(torch.full_like(t, float("nan")) for t in self.ahead.loads.slots[0]) for _ in range(layers)]
        self.gen = torch.Generator().manual_seed(layers * 10 + extra)
        self.moved_ahead = 0  # bytes the last step's loads ahead moved, for the step after it
        self.comparable = True  # no crop or reset since those loads

    def teardown(self):
        for decoder in (self.ahead, self.alone):
            decoder.loads.close()

    @property
    def length(self) -> int:
        return int(self.alone.lengths[0])  # a decoder's layers all hold the same positions

    @precondition(lambda self: self.length < MAX_LEN)
    @rule(new=st.integers(1, 3), ahead=st.booleans())
    def step(self, new, ahead):
        new = min(new, MAX_LEN - self.length)
        fresh = [tuple(torch.randn(t[:, :, :new].shape, generator=self.gen) for t in pair) for pair in self.truth]
        moved, moved_ahead = {}, 0
        for decoder in (self.ahead, self.alone):
            before = decoder.loads.moved
            queued = decoder.step(self.truth, fresh, ahead and decoder is self.ahead)
            moved[decoder] = decoder.loads.moved - before - queued
            moved_ahead += queued
        if self.comparable:
            assert moved[self.ahead] + self.moved_ahead == moved[self.alone], "a load moved twice, or not at all"
        for pair, new_pair in zip(self.truth, fresh, strict=True):
            for want, values in zip(pair, new_pair, strict=True):
                want[:, :, self.length - new : self.length] = values
        self.moved_ahead, self.comparable = moved_ahead, True

    @precondition(lambda self: self.length > 0)
    @rule(back=st.integers(1, 3))
    def crop(self, back):
        back = min(back, self.length)
        for decoder in (self.ahead, self.alone):
            decoder.shorten(back)
        self.comparable = self.moved_ahead == 0

    @rule()
    def reset(self):
        for decoder in (self.ahead, self.alone):
            decoder.reset()
        self.comparable = self.moved_ahead == 0

    @rule(data=st.data())
    def reorder(self, data):
        batch = self.truth[0][0].shape[0]
        rows = torch.tensor(data.draw(st.lists(st.integers(0, batch - 1), min_size=batch, max_size=batch)))
        for decoder in (self.ahead, self.alone):
            decoder.loads.reorder(rows)
        for pair in self.truth:
            for want in pair:
                want.copy_(want.index_select(0, rows))

    @rule()
    def copy(self):
        # The copy goes on in place of the one with the loads ahead, whose claims it inherits.
        old, self.ahead = self.ahead, self.ahead.copied()
        old.loads.close()

    @invariant()
    def evicted_layers_are_whole_on_the_host(self):
        if hasattr(self, "alone"):
            for decoder in (self.ahead, self.alone):
                decoder.check_host(self.truth, self.length)


TestSlotLoads = SlotMachine.TestCase
TestSlotLoads.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
