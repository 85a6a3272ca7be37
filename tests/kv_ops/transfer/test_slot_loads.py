"""kv_ops.transfer.slot_loads: the live loads behind a set of shared slots, their names and refusals."""

import pytest

from kv_ops.transfer.slot_plan import plan_slots


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


def test_the_ops_that_outlive_a_step_run_between_cuda_graphs_and_the_step_s_own_load_is_captured():
    # A load queued ahead runs past the end of the step that queues it, which a captured graph
    # cannot hold (it joins every stream it forks): Inductor must run those two ops on the host.
    import torch

    import kv_ops.transfer.slot_loads  # noqa: F401  (registers the ops)

    unsafe = torch.Tag.cudagraph_unsafe
    assert unsafe in torch.ops.kv_ops.queue_ahead.default.tags
    assert unsafe in torch.ops.kv_ops.join_ahead.default.tags
    assert unsafe not in torch.ops.kv_ops.prefetch_layer.default.tags


def test_a_load_ahead_handed_another_caches_host_copy_or_name_is_refused():
    import torch

    from kv_ops.transfer.slot_loads import SlotLoads

    g = torch.Generator().manual_seed(7)
    keys = torch.randn(1, 2, 1, 4, generator=g)
    lengths = [torch.tensor(3) for _ in range(4)]
    mine, other = SlotLoads("ahead-mine"), SlotLoads("ahead-other")
    for loads in (mine, other):
        loads.allocate(plan_slots(4, 3, last_resident=True), keys, keys.clone(), 8, lengths)
    plan = mine.plan
    k = plan.ahead[max(plan.ahead)][0]
    slot_k, slot_v = mine.slots[plan.slot[k]]
    own_k, own_v = mine.slots[plan.slot[max(plan.ahead)]]
    host_k, host_v = other.host_views[k]  # the other cache's
    args = [slot_k, slot_v, own_k, own_v, keys, lengths[k], lengths[plan.evicts[k]], host_k, host_v]
    with pytest.raises(RuntimeError, match="another cache's host copy or saved counts"):
        torch.ops.kv_ops.queue_ahead(*args, mine.saved[:1], "ahead-mine", k)
    assert mine.moved == 0 and int(mine.held[plan.slot[k]]) != k  # refused before any byte moved
    with pytest.raises(ValueError, match="no SlotLoads named 'ahead-gone'"):
        torch.ops.kv_ops.join_ahead(keys, "ahead-gone")
    args[7:9] = mine.host_views[k]
    torch.ops.kv_ops.queue_ahead(*args, mine.saved[:1], "ahead-mine", k)
    assert int(mine.held[plan.slot[k]]) == k and mine.moved > 0  # the control: the cache's own loads
    assert torch.ops.kv_ops.join_ahead(keys, "ahead-mine").numel() == 0
    for loads in (mine, other):
        loads.close()
