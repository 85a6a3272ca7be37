"""kv_ops.transfer.slot_plan.plan_slots: who holds which slot, checked by replaying steps of it."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_ops.transfer.slot_plan import plan_slots


def replay(plan, steps=3, ahead=False):
    """Run ``steps`` steps of the plan over slot contents; fail on any load that takes a slot
    whose layer has not been read yet, or any layer that reads a slot not holding it. ``ahead``
    also queues the next step's first loads where ``plan.ahead`` says; the step's own load of
    such a layer then finds its slot holding it (the claim)."""
    holder = {}  # slot -> layer it holds
    for k in range(plan.layers):  # the first step starts with every layer's slot its own or empty
        holder.setdefault(plan.slot[k], None)
    for _ in range(steps):
        read = set()
        for j in range(plan.layers):
            for target in plan.issues.get(j, ()):
                assert target >= j  # queued before the target's wait, at its own update at the latest
                evicted = plan.evicts[target]
                # None: the first step's empty slot; the target: loaded ahead by the step before.
                assert holder[plan.slot[target]] in ((evicted, None, target) if ahead else (evicted, None))
                # The evicted layer was read earlier in this step, or in the step before.
                assert evicted in read or evicted > j
                holder[plan.slot[target]] = target
            if j in plan.streamed:
                assert holder[plan.slot[j]] == j
            else:
                assert holder[plan.slot[j]] in (j, None)
                holder[plan.slot[j]] = j
            read.add(j)
            for target in plan.ahead.get(j, ()) if ahead else ():
                assert target in plan.issues[0]  # one of the next step's first loads
                assert plan.evicts[target] in read  # whose slot this step has read by now
                assert plan.slot[j] != plan.slot[target]  # and not the slot the queueing layer reads
                holder[plan.slot[target]] = target


@given(layers=st.integers(1, 48), extra=st.integers(0, 50), last_resident=st.booleans())
def test_every_plan_loads_each_streamed_layer_into_a_free_slot_before_it_reads(layers, extra, last_resident):
    slots = min(2, layers) + extra
    plan = plan_slots(layers, slots, last_resident)
    assert plan.slots == min(slots, layers)
    assert (layers - 1 if last_resident else 0) not in plan.streamed
    assert set(plan.evicts) == set(plan.streamed)
    assert sorted(t for ts in plan.issues.values() for t in ts) == list(plan.streamed)
    replay(plan)
    replay(plan, ahead=True)
    if last_resident:  # every one of the next step's first loads can be queued within the step
        assert sorted(t for ts in plan.ahead.values() for t in ts) == sorted(plan.issues.get(0, ()))


def test_loading_ahead_keeps_the_last_layer_resident_and_queues_the_first_loads_as_their_slots_free():
    # Eight layers, three slots: layers 0-6 take turns in slots 1 and 2. The next step's layer 1
    # goes into layer 5's slot, read by layer 6's update; layer 0 into layer 6's, read by layer 7's.
    plan = plan_slots(8, 3, last_resident=True)
    assert plan.streamed == (0, 1, 2, 3, 4, 5, 6)
    assert plan.slot == (1, 2, 1, 2, 1, 2, 1, 0)
    assert plan.issues[0] == (0, 1)
    assert plan.ahead == {6: (1,), 7: (0,)}
    # The first layer resident: the next step's layer 2 can go at layer 7 (layer 6 read); layer 1
    # into the last layer's slot cannot be queued within the step.
    assert plan_slots(8, 3).ahead == {7: (2,)}


@pytest.mark.parametrize(
    ("layers", "slots", "streamed"),
    [
        (5, 3, (1, 2, 3, 4)),
        (3, 3, ()),
        (4, 3, (1, 3)),
        (8, 8, ()),
        (8, 6, (1, 3, 5, 7)),
        (8, 12, ()),
        (3, 2, (1, 2)),
        (6, 2, (1, 2, 3, 4, 5)),
        # Where two shared slots would hold three layers, two layers share one, spread as two.
        (5, 4, (2, 4)),
        (10, 9, (4, 9)),
    ],
)
def test_the_streamed_layers_are_spread_over_the_step(layers, slots, streamed):
    assert plan_slots(layers, slots).streamed == streamed


@pytest.mark.parametrize(("layers", "slots"), [(0, 3), (5, 1), (2, 1)])
def test_too_few_slots_or_layers_are_refused(layers, slots):
    with pytest.raises(ValueError, match="plan_slots: needs layers >= 1 and slots >= min"):
        plan_slots(layers, slots)
