"""Which layers share GPU slots, and where each load is queued: the pure plan :class:`~kv_ops.transfer.slot_loads.SlotLoads` follows."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotPlan:
    """Who holds which slot, over ``layers`` layers numbered 0 to layers - 1 in step order.

    ``slot[k]`` is layer k's slot: resident layers have slots of their own, streamed layers
    take turns in the last one or two. ``evicts[k]`` is the streamed layer whose slot layer k's
    load takes: the one before it in the same slot, or the last of the previous step there.
    ``issues[j]`` lists the streamed layers whose loads layer j queues at its update: the first
    layer after the one evicted, whose reads the step has queued by then. ``ahead[j]`` lists the
    layers of ``issues[0]`` (the next step's first loads) whose evicted layer this step has read
    by layer j's update: those loads can be queued there, for the next step.
    """

    layers: int
    streamed: tuple[int, ...]
    slot: tuple[int, ...]
    evicts: dict[int, int]
    issues: dict[int, tuple[int, ...]]
    ahead: dict[int, tuple[int, ...]]

    @property
    def slots(self) -> int:
        return max(self.slot) + 1


def plan_slots(layers: int, slots: int, last_resident: bool = False) -> SlotPlan:
    """The plan for ``layers`` layers in ``slots`` GPU slots (at least ``min(2, layers)``).

    With a slot per layer all are resident. Otherwise the streamed layers take turns in two
    slots, so that a load may start as soon as the layer two before it has been read. Two
    streamed layers per slot pair at least, or one shared slot: with two slots in all, or where
    two shared slots would hold three layers (one of them alone, no better than resident), one
    more layer stays resident and the streamed ones share one slot, each load queued once the
    layer before it in the slot has been read. The streamed layers are spread evenly over the
    step, and the first layer is always resident (nothing computes before it to hide its load).
    ``last_resident`` keeps the last layer resident instead, the plan for loading ahead: every
    shared slot's last reader then comes before the last layer, so each of the next step's first
    loads can be queued within this step (``ahead``), beside the step's end and the host's work
    between steps, where the first layer's own computation was all a first load could hide behind.
    """
    if layers < 1 or slots < min(2, layers):
        raise ValueError(f"plan_slots: needs layers >= 1 and slots >= min(2, layers), got {layers} and {slots}")
    shared = 2 if slots < layers else 0
    count = layers - slots + shared
    if shared and (slots == 2 or count == 3):
        shared, count = 1, count - 1
    # Layer k is streamed where floor(k * count / layers) steps up: evenly spaced, never layer 0.
    streamed = [k for k in range(layers) if (k + 1) * count // layers > k * count // layers]
    if last_resident:  # the same spacing mirrored: never the last layer
        streamed = sorted(layers - 1 - k for k in streamed)
    slot, kept = [], 0
    order = {k: i for i, k in enumerate(streamed)}
    first_shared = layers - len(streamed)
    for k in range(layers):
        if k in order:
            slot.append(first_shared + order[k] % shared)
        else:
            slot.append(kept)
            kept += 1
    evicts, issues = {}, {k: [] for k in range(layers)}
    for i, k in enumerate(streamed):
        if i >= shared:
            evicts[k] = streamed[i - shared]
            issues[streamed[i - shared] + 1].append(k)
        else:  # the slot's last layer of the previous step
            evicts[k] = streamed[max(j for j in range(len(streamed)) if j % shared == i)]
            issues[0].append(k)
    ahead: dict[int, list[int]] = {}
    for k in issues.get(0, ()):
        if evicts[k] + 1 < layers:
            ahead.setdefault(evicts[k] + 1, []).append(k)
    return SlotPlan(
        layers,
        tuple(streamed),
        tuple(slot),
        evicts,
        {j: tuple(v) for j, v in issues.items() if v},
        {j: tuple(v) for j, v in ahead.items()},
    )


def slot_bytes(keys: torch.Tensor, values: torch.Tensor, max_len: int) -> int:
    """GPU bytes of one slot of ``max_len`` positions for a layer whose new keys and values look like these."""
    batch, heads = keys.shape[:2]
    return batch * heads * max_len * (keys.shape[-1] * keys.element_size() + values.shape[-1] * values.element_size())


__all__ = ["SlotPlan", "plan_slots", "slot_bytes"]
