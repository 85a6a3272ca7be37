"""kv_ops.transfer.slot_loads.plan_slots: who holds which slot, checked by replaying steps of it."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_ops.transfer.slot_loads import plan_slots


def replay(plan, steps=3):
    """Run ``steps`` steps of the plan over slot contents; fail on any load that takes a slot
    whose layer has not been read yet, or any layer that reads a slot not holding it."""
    holder = {}  # slot -> layer it holds
    for k in range(plan.layers):  # the first step starts with every layer's slot its own or empty
        holder.setdefault(plan.slot[k], None)
    for _ in range(steps):
        read = set()
        for j in range(plan.layers):
            for target in plan.issues.get(j, ()):
                assert target >= j  # queued before the target's wait, at its own update at the latest
                evicted = plan.evicts[target]
                assert holder[plan.slot[target]] in (evicted, None)  # None: the first step's empty slot
                # The evicted layer was read earlier in this step, or in the step before.
                assert evicted in read or evicted > j
                holder[plan.slot[target]] = target
            if j in plan.streamed:
                assert holder[plan.slot[j]] == j
            else:
                assert holder[plan.slot[j]] in (j, None)
                holder[plan.slot[j]] = j
            read.add(j)


@given(layers=st.integers(1, 48), extra=st.integers(0, 50))
def test_every_plan_loads_each_streamed_layer_into_a_free_slot_before_it_reads(layers, extra):
    slots = min(2, layers) + extra
    plan = plan_slots(layers, slots)
    assert plan.slots == min(slots, layers)
    assert 0 not in plan.streamed
    assert set(plan.evicts) == set(plan.streamed)
    assert sorted(t for ts in plan.issues.values() for t in ts) == list(plan.streamed)
    replay(plan)


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


def test_a_dropped_set_of_slot_loads_gives_up_its_name_without_a_close():
    # A transformers cache is dropped, never closed: its name (and memory) must go with it.
    import gc

    from kv_ops.transfer import in_step
    from kv_ops.transfer.slot_loads import SlotLoads, lookup

    loads = SlotLoads("dropped-cache")
    assert lookup("dropped-cache") is loads
    del loads
    gc.collect()
    with pytest.raises(ValueError, match=r"no SlotLoads named 'dropped-cache'"):
        lookup("dropped-cache")
    in_step.check_name("SlotLoads", "dropped-cache")  # free for a new one


def test_a_wait_on_a_layer_that_is_not_streamed_or_a_name_without_waits_is_refused():
    # The one per-layer wait (kv_ops.wait_layer) resolves names of every in-step object: a slot
    # load's resident layer, or a StepTransfers (no per-layer wait), is a clear error, not a no-op.
    import torch

    import kv_ops
    from kv_ops.transfer.slot_loads import SlotLoads

    loads = SlotLoads("wait-refusals")
    keys = torch.randn(1, 2, 1, 4)
    lengths = [torch.zeros((), dtype=torch.int64) for _ in range(4)]
    loads.allocate(plan_slots(4, 2), keys, keys.clone(), 8, lengths)
    slot_k, slot_v = loads.slots[0]
    h = torch.randn(3)
    with pytest.raises(
        ValueError, match=r"layer 0 is not a streamed layer of 'wait-refusals' \(streamed: \[1, 2, 3\]\)"
    ):
        kv_ops.wait_layer(h, "wait-refusals", 0, [slot_k, slot_v])
    streamed_k, streamed_v = loads.slots[loads.plan.slot[2]]
    assert kv_ops.wait_layer(h, "wait-refusals", 2, [streamed_k, streamed_v]) is h  # a streamed one waits
    caches = {f"layer{i}": torch.randn(4, 2, 8) for i in range(2)}
    with kv_ops.OffloadEngine(caches, 4, capacity_bytes=1 << 16) as engine, kv_ops.StepTransfers(engine, "no-waits"):
        with pytest.raises(ValueError, match=r"'no-waits' is a StepTransfers, which has no per-layer wait"):
            kv_ops.wait_layer(h, "no-waits", 0, list(caches.values()))
    loads.close()
