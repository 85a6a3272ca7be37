"""SlotLoads and its ops (``kv_ops.prefetch_layer``, ``queue_ahead``, ``join_ahead``): layers that share GPU slots, each loaded from page-locked host memory by the step itself while an earlier layer computes.

The step issues the loads: at the update of one layer it queues the load of a later layer on a
load stream, and that later layer waits for exactly its own load before it reads its slot
(``torch.ops.kv_ops.wait_layer``, :mod:`kv_ops.transfer.in_step`, which owns the names). So
the same code runs eagerly, under ``torch.compile(fullgraph=True)`` and inside a captured CUDA
graph, where the queueing becomes a fork of the load stream and the wait its join (event edges).

Which layers share slots is a pure plan (:mod:`kv_ops.transfer.slot_plan`): some layers keep a slot of
their own for good (*resident*), the others (*streamed*) take turns in two slots, each load evicting
the layer two before it, whose reads are already queued. A load moves only the positions in
use: one launch of :class:`kv_ops.prefix_copy.PrefixCopy` writes the evicted layer's new
positions back to its host copy, then loads the target's written positions, both lengths read on
the GPU. A layer's new positions are written to its slot only, as a GPU-resident cache writes
them; they reach the host when the slot is next taken.

The loads a step queues at its first layer can also be queued by the step before, once it has
read their slots (:meth:`SlotLoads.queue_ahead`, the cache's ``load_ahead``): they then run
beside that step's last layers and the host's work between steps. A captured step must join
every stream it forks before it ends, so these loads are issued from the host, by ops that
Inductor runs between CUDA graphs (``torch.Tag.cudagraph_unsafe``), and the next step's first
layer makes the current stream wait for them (:meth:`SlotLoads.join_ahead`). Each load first
claims its slot on the GPU (:class:`~kv_ops.prefix_copy.PrefixCopy`'s claim), so the step's
own load of a layer whose slot already holds it moves nothing: the same step, eager or replayed
from a graph, is right whether or not a load ran ahead of it.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence

import torch

from .. import reference
from ..cuda import driver
from ..cuda.capture import captured_into, capturing
from ..cuda.host_memory import check_host_bytes, device_view, pinned_empty
from ..cuda.registration import register_op
from ..cuda.torch_internals import mark_static_address
from ..prefix_copy import PrefixCopy
from . import in_step
from .slot_engines import SlotEngines, engine_positions, kv_pair
from .slot_plan import SlotPlan, slot_bytes


class SlotLoads:
    """The live state behind one set of slot loads: slots, host copies, counts, stream and events.

    Registered under ``name`` at once; :meth:`allocate` makes the slots and host copies by a
    :class:`SlotPlan` once the layers' shape is known.
    """

    def __init__(self, name: str):
        in_step.check_name("SlotLoads", name)
        self.name = name
        self.plan: SlotPlan | None = None
        self.lengths: list[torch.Tensor] = []
        self.slots: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.host: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # streamed layer -> (K, V) copies
        self.host_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # as the loads' device reads them
        # int64 [3, layers] on the device, one allocation (a compiled step's input, saved_base,
        # names it whole): per layer its positions on the host (saved) and its load's go word;
        # per slot the layer whose keys it holds as the loads ran (held, what a claim reads).
        self.counts: torch.Tensor | None = None
        self.saved: torch.Tensor | None = None
        self.held: torch.Tensor | None = None
        self.copies: dict[int, PrefixCopy] = {}
        # Every bound launch, captured: (copy, graph), kept together since a graph keeps none of
        # the buffers it reads alive and a copy may own some (its default start word).
        self.bound: list[tuple[PrefixCopy, torch.cuda.CUDAGraph]] = []
        self.execs: dict[int, int] = {}  # the executable graphs' handles of self.copies' launches
        # An eager step's own loads (:mod:`kv_ops.transfer.slot_engines`): the launches bound to
        # the start word, captured, and the copy engines' part. ``known``: the positions every
        # streamed layer's host copy holds, which the owner counts at each eager step (0: none).
        self.eager_execs: dict[int, int] = {}
        self.engines: SlotEngines | None = None
        self.known = 0
        self.position_bytes = 0  # of one position of a slot, keys and values
        self.moved = 0  # bytes the CPU loads and write-backs have moved (what tests count)
        # Per slot, the layer whose load was queued into it last (-1: none yet), as the host
        # queued them: whose keys a read between the loads finds there.
        self.holder: list[int] = []
        self.stream: torch.cuda.Stream | None = None
        self.free: dict[int, torch.cuda.Event] = {}  # recorded where a load's slot may be overwritten
        self.loaded: dict[int, torch.cuda.Event] = {}  # recorded after a load
        self.capturing_now = False  # whether the eager step under way is being captured (owner sets it)
        # Loads ahead: whether the owner asked for them (it plans with the last layer resident),
        # whether they stopped (a step was captured by hand: its replays would not wait for them),
        # the layers queued since the last join, their events, and the lengths they read.
        self.ahead = False
        self.ahead_stopped = False
        self.pending: list[int] = []
        self.ahead_done: dict[int, torch.cuda.Event] = {}
        self.ahead_lengths: torch.Tensor | None = None
        self.ahead_execs: dict[int, int] = {}  # launches bound to ahead_lengths
        in_step.register(name, self, weak=True)  # it lives as long as its cache

    def allocate(
        self, plan: SlotPlan, keys: torch.Tensor, values: torch.Tensor, max_len: int, lengths: list[torch.Tensor]
    ) -> None:
        """Make the slots (zeros: every position of a slot is read, masked or not, so it must be
        finite) and the streamed layers' host copies, and bind each load. ``lengths[k]`` is
        layer k's count of written positions, an int64 scalar on the device that its owner
        advances in place (transformers' ``cumulative_length``)."""
        self.plan, device = plan, keys.device
        batch, heads = keys.shape[:2]
        k_shape, v_shape = (batch, heads, max_len, keys.shape[-1]), (batch, heads, max_len, values.shape[-1])
        if device.type == "cuda":
            need = len(plan.streamed) * slot_bytes(keys, values, max_len)
            check_host_bytes("HostOffloadedCache", "the host copy of the streamed layers", need)
        shapes = (k_shape, keys.dtype, v_shape, values.dtype)
        self.position_bytes = slot_bytes(keys, values, 1)
        for _ in range(plan.slots):
            pair = kv_pair(functools.partial(torch.zeros, device=device), *shapes)
            for t in pair:
                mark_static_address(t)
            self.slots.append(pair)
        # Zeros too: an eager load copies ``known`` positions whole, which an owner's count can
        # put past the positions written back (a crop it could not count); they must be finite.
        host = (lambda shape, dtype: pinned_empty(shape, dtype=dtype).zero_()) if device.type == "cuda" else torch.zeros
        for k in plan.streamed:
            self.host[k] = kv_pair(host, *shapes)
        self.counts = torch.zeros(3, plan.layers, dtype=torch.int64, device=device)
        self.saved, self.held = self.counts[0], self.counts[2]
        mark_static_address(self.saved)  # the object a compiled step takes as input: read in place
        self.lengths = lengths
        if device.type == "cuda":
            self._bind_loads(lengths, device)
        else:
            self.host_views = self.host
        # After binding, whose first launches claimed the slots: every slot empty but a resident's.
        self.holder = [-1] * plan.slots
        for k in range(plan.layers):
            if k not in plan.evicts:  # resident: the slot is its own
                self.holder[plan.slot[k]] = k
        self.held[: plan.slots] = torch.tensor(self.holder)

    def _bind_loads(self, lengths: list[torch.Tensor], device: torch.device) -> None:
        """The load stream, and per streamed layer its copy, the copy's captured graph and its events."""
        plan = self.plan
        # Low priority: a load must never delay the layer that computes beside it.
        self.stream = torch.cuda.Stream(device, priority=torch.cuda.Stream.priority_range()[0])
        self.engines = SlotEngines(self.stream)
        views = {k: tuple(device_view(t, device) for t in pair) for k, pair in self.host.items()}
        for pair in views.values():
            for t in pair:
                mark_static_address(t)  # a captured step's input, read in place (never copied in)
        # Per layer, its length and its evicted layer's, as a compiled step hands them to a load
        # queued ahead: copied here on the current stream, since the step's own buffers may be
        # gone or rewritten before the load stream reads them.
        self.ahead_lengths = torch.zeros(plan.layers, 2, dtype=torch.int64, device=device)
        for k in plan.streamed:
            e, s = plan.evicts[k], plan.slot[k]
            claim = (self.held[s], self.counts[1, k], k)
            copy = PrefixCopy(
                self.slots[s], views[k], lengths[k], views[e], lengths[e], self.saved[e], self.saved[k], claim
            )
            self.copies[k], self.execs[k] = copy, self._bound_graph(copy)
            eager = PrefixCopy(
                self.slots[s], views[k], lengths[k], views[e], lengths[e], self.saved[e], self.saved[k], claim,
                start=self.engines.start,
            )  # fmt: skip
            self.eager_execs[k] = self._bound_graph(eager)
            self.engines.bind(k, self.slots[s], views[k])
            if self.ahead and k in plan.issues.get(0, ()):  # and bound to the lengths of a compiled step
                held = self.ahead_lengths[k]
                ahead = PrefixCopy(
                    self.slots[s], views[k], held[0], views[e], held[1], self.saved[e], self.saved[k], claim
                )
                self.ahead_execs[k] = self._bound_graph(ahead)
            self.free[k], self.loaded[k], self.ahead_done[k] = (torch.cuda.Event() for _ in range(3))
            # driver.record_event needs events that exist: a torch event is made at its first
            # record, on the current device, which must be the streams' it is recorded on.
            with torch.cuda.stream(self.stream):
                for event in (self.free[k], self.loaded[k], self.ahead_done[k]):
                    event.record()
        self.stream.synchronize()
        self.host_views = views  # the copies and graphs hold their addresses; the op names them
        # A dropped cache frees its slots and host copies: no load queued ahead may still run. Not
        # at the interpreter's exit, where nothing is freed for reuse (and a sticky CUDA error would
        # print a traceback on the way out).
        weakref.finalize(self, self.stream.synchronize).atexit = False

    def _bound_graph(self, copy: PrefixCopy) -> int:
        """``copy``'s launch captured once (kept in ``bound``), and its executable graph's handle:
        an eager load replays it, one driver call where Triton's launcher costs several times more
        host time. Every count is still zero here, so the first launch (which compiles) moves nothing."""
        load = self.stream.cuda_stream
        with torch.cuda.stream(self.stream):  # the cache's device is current in here, whatever was outside
            copy(load)
            graph = torch.cuda.CUDAGraph()
            with captured_into(graph):
                copy(load)
        self.bound.append((copy, graph))
        return graph.raw_cuda_graph_exec()

    def know(self, positions: int) -> None:
        """Before an eager step: every streamed layer's host copy holds its first ``positions``.
        Its loads move them by the copy engine where that is worth it (:func:`engine_positions`)."""
        self.known = engine_positions(positions, self.position_bytes)

    def reset(self) -> None:
        """Forget every layer's host positions (the owner zeroes the lengths)."""
        if self.saved is not None:
            self.join_ahead()
            self.saved.zero_()  # the slots keep what they hold (held), with nothing on the host

    def crop(self) -> None:
        """After the owner shortened the lengths (a crop): no saved count past its length, so
        that positions written again from there go back to the host when the slot is taken. A
        load ahead of the step saves a layer's positions that a crop before the step gives up."""
        if self.saved is not None:
            self.join_ahead()  # a load ahead sets its layer's saved count when it ends
            torch.minimum(self.saved, torch.stack(self.lengths), out=self.saved)

    def reorder(self, rows: torch.Tensor) -> None:
        """Put row ``rows[i]`` of every layer's keys and values at row i, in place (beam search):
        each slot once, for whichever layer holds it, then each streamed layer's positions on
        the host. The slots are reordered on the current stream, after the step's reads, which
        waited for every load; the host copies on the host, once the GPU is done with them."""
        self.join_ahead()
        rows = rows.to(self.saved.device)
        for pair in self.slots:
            for t in pair:
                t.copy_(t.index_select(0, rows))
        written = self.written()
        rows = rows.cpu()
        for k, pair in self.host.items():
            for t in pair:
                t[:, :, : written[k]] = t[:, :, : written[k]].index_select(0, rows)

    def copy_from(self, other: SlotLoads) -> None:
        """Take ``other``'s keys and values, ``self`` allocated by the same plan and shapes: the
        slots and counts on the current stream, then each streamed layer's written positions on
        the host (the owner copies the lengths)."""
        other.join_ahead()
        for mine, theirs in zip(self.slots, other.slots, strict=True):
            for a, b in zip(mine, theirs, strict=True):
                a.copy_(b)
        self.counts.copy_(other.counts)
        self.holder = list(other.holder)
        written = other.written()
        for k, pair in self.host.items():
            for a, b in zip(pair, other.host[k], strict=True):
                a[:, :, : written[k]] = b[:, :, : written[k]]

    def written(self) -> list[int]:
        """Each layer's count of written positions, read from the device: the positions of a
        host copy that can hold data (an evicted layer's newest ones were written back past its
        saved count; a slot's layer's stale ones there are harmless).

        A sync of the current stream, after which the host copies may be read on the host: a
        step waits for every load it issues, so the loads and write-backs into them are done
        once the current stream is. Only beam search and copying a cache pay it."""
        return torch.stack(self.lengths).tolist()

    def bytes_per_step(self) -> tuple[int, int]:
        """Bytes the next step moves, host to GPU (every streamed layer's written positions) and
        GPU to host (one new position each): a sync, reading the lengths."""
        if self.plan is None or not self.plan.streamed:
            return 0, 0
        keys, values = self.slots[0]
        per_position = keys[:, :, 0].numel() * keys.element_size() + values[:, :, 0].numel() * values.element_size()
        positions = sum(int(self.lengths[k]) for k in self.plan.streamed)
        return positions * per_position, len(self.plan.streamed) * per_position

    def queue_ahead(self, k: int, tensors: tuple | None = None) -> None:
        """Queue now the load of layer k that the next step queues at its first layer (``k`` in
        ``plan.issues[0]``): at the update of layer j, for k in ``plan.ahead[j]``, where this
        step has queued every read of k's slot. The load runs beside the rest of the step and the
        host's work between steps; the next step's first layer waits for it (:meth:`join_ahead`),
        and its own load of k then moves nothing (the claim).

        ``tensors``: what a compiled step hands over, as to :meth:`issue`. Where its slot is not
        the slot itself (a functionalizing backend's clone, which it copies back over the slot
        after the step), the current stream waits at once. Does nothing where loads ahead stopped."""
        if self.ahead_stopped or self._captured():
            return
        plan = self.plan
        slot = self.slots[plan.slot[k]]
        own = tensors is None  # eagerly: the slot and the layers' own lengths, as the launch is bound
        if own:
            tensors = (*slot, self.lengths[k], self.lengths[plan.evicts[k]])
        if self.stream is None:
            self.load_now(k, *tensors[:2], int(tensors[2]), int(tensors[3]))
            return
        clone = tensors[0].data_ptr() != slot[0].data_ptr()
        if own:
            self.issue(k)  # the bound launch, replayed
        else:
            # The step's length buffers may be rewritten or freed before the load stream reads
            # them: copied first, on the current stream, which the load waits for.
            held = self.ahead_lengths[k]
            torch.stack(tensors[2:], out=held)
            if clone or k not in self.ahead_execs:
                self.issue(k, (*tensors[:2], held[0], held[1]))
            else:
                self.issue(k, execs=self.ahead_execs)  # the launch bound to the slot and these lengths
        driver.record_event(self.ahead_done[k], self.stream.cuda_stream)
        self.pending.append(k)
        if clone:
            self.join_ahead()

    def join_ahead(self) -> None:
        """Make the current stream wait for the loads queued ahead since the last join: the first
        layer of the step they are for calls it, before its own loads and reads. A step replayed
        from a CUDA graph orders its reads after its own nodes only, not after a load queued
        outside it, so it is the stream that waits."""
        if not self.pending or self._captured():
            return
        compute = driver.current_stream_handle(self.saved.device.index)
        for k in self.pending:
            driver.wait_event(compute, self.ahead_done[k])
        self.pending.clear()

    def _captured(self) -> bool:
        """Whether the current stream is capturing a step by hand (Inductor runs the ops ahead
        between its graphs, never in one). If so, loads ahead stop for good: the capture's replays
        would not join them. ``torch.cuda.graph`` synchronizes before it captures, so none is
        under way then."""
        if self.stream is None or not capturing(self.saved.device):
            return False
        self.ahead_stopped = True
        self.pending.clear()
        return True

    # --- the two steps of a load, on a CUDA device --------------------------------------------

    def issue(self, k: int, tensors: tuple | None = None, replay: bool = True, execs: dict | None = None) -> None:
        """Queue layer k's load on the load stream, after the current stream's work so far.

        ``tensors``: what a compiled step hands over (:meth:`PrefixCopy.__call__`). ``replay``
        launches the load's own graph (of ``execs``, else the one bound to the layers' lengths),
        the cheapest call; a capture in progress needs the kernel launched instead (a graph launch
        is not a node a capture records)."""
        s = self.plan.slot[k]
        # An eager step's own load of a layer the slot does not hold: the first positions by the
        # copy engine (the host holds them: a slot taken from a layer first writes it back).
        eager = tensors is None and replay and execs is None and self.known and self.holder[s] != k
        self.holder[s] = k
        compute = driver.current_stream_handle(self.saved.device.index)
        load = self.stream.cuda_stream
        driver.record_event(self.free[k], compute)
        driver.wait_event(load, self.free[k])
        if eager:
            self.engines.load(k, self.known, self.eager_execs[k])
        elif tensors is None and replay:
            driver.graph_launch((self.execs if execs is None else execs)[k], load)
        else:
            self.copies[k](load, tensors)
        driver.record_event(self.loaded[k], load)

    def wait(self, k: int, caches: Sequence[torch.Tensor] = ()) -> None:
        """Make the current stream wait for layer k's last queued load (on the CPU the load was
        done when queued): what :func:`kv_ops.wait_layer` does, with the layer's slot as
        ``caches``; the cache's eager update calls it without them."""
        if caches:
            self._check_wait(k, caches)
        if self.stream is not None:
            driver.wait_event(driver.current_stream_handle(self.saved.device.index), self.loaded[k])

    def _check_wait(self, k: int, caches: Sequence[torch.Tensor]) -> None:
        if self.plan is None or k not in self.plan.evicts:
            streamed = [] if self.plan is None else sorted(self.plan.evicts)
            raise ValueError(
                f"kv_ops.wait_layer: layer {k} is not a streamed layer of {self.name!r} (streamed: {streamed})"
            )
        in_step.check_caches(self.name, k, caches, self.saved.device)

    # --- on the CPU: the same, at once ---------------------------------------------------------

    def load_now(self, k: int, slot_k: torch.Tensor, slot_v: torch.Tensor, length: int, out_length: int) -> None:
        """What layer k's load does, done now by :func:`kv_ops.reference.prefix_copy`: the CPU path,
        with the claim (nothing moves where the slot holds layer k already)."""
        e, s = self.plan.evicts[k], self.plan.slot[k]
        self.holder[s] = k
        if int(self.held[s]) == k:
            return
        self.held[s] = k
        self.moved += reference.prefix_copy(
            (slot_k, slot_v), self.host[k], length, self.host[e], out_length, int(self.saved[e])
        )
        self.saved[k] = length

    def check_bound(self, k: int, host_k: torch.Tensor, saved_base: torch.Tensor) -> None:
        """A ``RuntimeError`` unless ``host_k`` and ``saved_base`` are layer k's host copy and the
        saved counts that these loads bound their launches to: a step compiled or captured for
        another cache of the same name must not drive these loads."""
        if host_k.data_ptr() != self.host_views[k][0].data_ptr() or saved_base.data_ptr() != self.saved.data_ptr():
            raise RuntimeError(
                f"kv_ops.prefetch_layer: the step hands layer {k} of {self.name!r} another cache's host copy or "
                "saved counts than the live cache of that name holds"
            )

    def close(self) -> None:
        """Drop the name (the model must not run on these loads afterwards)."""
        in_step.unregister(self)


def lookup(name: str) -> SlotLoads:
    """The live :class:`SlotLoads` called ``name`` in this process."""
    return in_step.lookup(name, "kv_ops.prefetch_layer", SlotLoads)


def bound(name: str, layer: int, host_k: torch.Tensor, saved_base: torch.Tensor) -> SlotLoads:
    """:func:`lookup`, checked to hold layer ``layer``'s ``host_k`` and ``saved_base`` (what an op
    handed them is bound to: :meth:`SlotLoads.check_bound`)."""
    loads = lookup(name)
    loads.check_bound(layer, host_k, saved_base)
    return loads


# --- prefetch_layer -----------------------------------------------------------------
# The slots are declared mutated (the compiler keeps every earlier reader before the load and every
# later one after the wait); ``dep`` is the layer's input, so the load is not hoisted above the layer
# that queues it. The lengths are arguments, and the load reads them from the tensors handed over,
# not from the layers': a compiled graph may hold a count's current value in a buffer of its own
# until it writes it back (aot_eager does so at the graph's end). The target's host copy and the
# saved counts (through ``saved_base``, their first entry, which no load writes: layer 0 is never
# streamed) are inputs too, read-only here, so that a captured step is an input of every address
# its launch holds: CUDA-graph trees replay a recording only where those addresses are the same,
# and a new cache that takes a dropped one's name (and compiled step) gets a recording of its own.


def _fake_prefetch(slot_k, slot_v, dep, length, evicted_length, host_k, host_v, saved_base, name, layer):
    torch._check(layer >= 0, lambda: f"kv_ops.prefetch_layer: layer must be >= 0, got {layer}")


def _prefetch_cpu(slot_k, slot_v, dep, length, evicted_length, host_k, host_v, saved_base, name, layer) -> None:
    bound(name, layer, host_k, saved_base).load_now(layer, slot_k, slot_v, int(length), int(evicted_length))


def _prefetch_cuda(slot_k, slot_v, dep, length, evicted_length, host_k, host_v, saved_base, name, layer) -> None:
    bound(name, layer, host_k, saved_base).issue(layer, (slot_k, slot_v, length, evicted_length))


register_op(
    "kv_ops",
    "prefetch_layer(Tensor(a!) slot_k, Tensor(b!) slot_v, Tensor dep, Tensor length, Tensor evicted_length, "
    "Tensor host_k, Tensor host_v, Tensor saved_base, str name, int layer) -> ()",
    fake=_fake_prefetch,
    cpu=_prefetch_cpu,
    cuda=_prefetch_cuda,
)


# --- queue_ahead and join_ahead -------------------------------------------------------------
# Ops that Inductor runs on the host between CUDA graphs (cudagraph_unsafe), at every call: a load
# queued ahead outlives the step that queues it, which a captured step cannot (it must join every
# stream it forks). queue_ahead declares the slot it loads mutated, as prefetch_layer does, and the
# layer's own slot too, though it writes nothing there: so Inductor keeps it after the slot's last
# reads (and ``dep``, the layer's input, after every layer before) and before the layer's own.
# join_ahead returns an empty tensor that the first layer's loads take as their ``dep``, so that
# they come after it; the cache hands it only a step input, so Inductor may run it first of all.


def _fake_queue_ahead(
    slot_k, slot_v, own_k, own_v, dep, length, evicted_length, host_k, host_v, saved_base, name, layer
):
    torch._check(layer >= 0, lambda: f"kv_ops.queue_ahead: layer must be >= 0, got {layer}")


def _queue_ahead(slot_k, slot_v, own_k, own_v, dep, length, evicted_length, host_k, host_v, saved_base, name, layer):
    # The same op on either device: the loads know theirs (on the CPU, the load is done now).
    loads = bound(name, layer, host_k, saved_base)
    loads.queue_ahead(layer, (slot_k, slot_v, length, evicted_length))


register_op(
    "kv_ops",
    "queue_ahead(Tensor(a!) slot_k, Tensor(b!) slot_v, Tensor(c!) own_k, Tensor(d!) own_v, Tensor dep, "
    "Tensor length, Tensor evicted_length, Tensor host_k, Tensor host_v, Tensor saved_base, str name, int layer) -> ()",
    fake=_fake_queue_ahead,
    cpu=_queue_ahead,
    tags=(torch.Tag.cudagraph_unsafe,),
)


def _fake_join_ahead(dep, name):
    return dep.new_empty(0)


def _join_ahead(dep, name) -> torch.Tensor:
    lookup(name).join_ahead()
    return dep.new_empty(0)


register_op(
    "kv_ops",
    "join_ahead(Tensor dep, str name) -> Tensor",
    fake=_fake_join_ahead,
    cpu=_join_ahead,
    tags=(torch.Tag.cudagraph_unsafe,),
)

__all__ = ["SlotLoads", "lookup"]
