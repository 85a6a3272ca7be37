"""HostOffloadedCache: a transformers ``Cache`` whose full-attention K and V live in page-locked host memory.

The full-attention layers hold GPU slots by a :class:`~kv_ops.transfer.slot_plan.SlotPlan`:
some keep a slot of their own (*resident*; by default only the first, with ``max_gpu_bytes`` as
many as the budget holds), the others (*streamed*) take turns in two slots, each loaded while an
earlier layer computes. A load moves only the positions the layer has written, and writes back
the new positions of the layer it evicts (:mod:`kv_ops.transfer.slot_loads`). Sliding-window
layers stay on the GPU as transformers' own static layers, as its ``offload_only_non_sliding``
does. The ops carry the cache's name, never an address, so the cache works eagerly, under
``torch.compile(fullgraph=True)`` and in a captured CUDA graph.

Why a slot is a whole ``max_cache_len`` layer: attention reads every position up to
``max_cache_len`` (the static mask hides the rest), as it does in ``StaticCache``, so the step's
kernels and their results are the static cache's; a slot's positions past the sequence hold an
earlier layer's finite values, which the mask zeroes exactly.
"""

from __future__ import annotations

import copy
import gc
import itertools
import weakref

import torch

try:
    from transformers import PreTrainedConfig
    from transformers.cache_utils import Cache, StaticLayer, StaticSlidingWindowLayer, get_layer_types_and_kwargs
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "kv_ops.integrations.transformers needs transformers: pip install '.[hf]' from this package's checkout, or 'transformers>=5.16.1,<5.25'"
    ) from error

from ..cuda import arguments
from ..cuda.capture import capturing
from ..cuda.torch_internals import mark_static_address
from ..transfer import in_step
from ..transfer.slot_loads import SlotLoads
from ..transfer.slot_plan import plan_slots, slot_bytes

try:  # transformers >= 5.24: layers that keep no cache (Gemma 4's KV-shared ones) are "dummy"
    from transformers.cache_utils import DummyLayer
except ImportError:
    DummyLayer = None

# Layer types this cache serves: full attention (offloaded), the windowed kinds (kept on the GPU)
# and, where transformers has them, the placeholders of layers that keep no cache of their own.
FULL = "full_attention"
WINDOWED = ("sliding_attention", "chunked_attention")
NO_CACHE = ("dummy",) if DummyLayer is not None else ()

# The ops carry a cache's name as a constant that the compiled step is specialised on, so a new
# cache takes the first name no living (unclosed) cache holds in in_step: a cache made per request,
# once the last one is dropped, reuses its name and the step compiled for it (StaticCache's compiled
# step serves every StaticCache alike).
_minted: set[str] = set()  # every name a cache has had in this process


def _new_loads() -> SlotLoads:
    """The SlotLoads of a new cache, under the first ``hf-cache-<n>`` free in this process. Before
    minting a name no cache had (a compiled step would recompile for it), one garbage collection:
    the cache a compilation traced stays referenced by Dynamo's leftovers (cyclic garbage) until
    the collector runs, and would otherwise push every next cache to a new name."""
    name = _first_free()
    if name not in _minted:
        gc.collect()
        name = _first_free()
        _minted.add(name)
    return SlotLoads(name)


def _first_free() -> str:
    names = (f"hf-cache-{n}" for n in itertools.count())
    return next(name for name in names if not in_step.is_taken(name))


def _held_tensor(name: str) -> property:
    """A layer's ``keys`` or ``values``: set as StaticLayer sets them, read through ``_held``."""
    stored = "_" + name

    def read(self: HostOffloadedLayer) -> torch.Tensor | None:
        return self._held(getattr(self, stored))

    def write(self: HostOffloadedLayer, tensor: torch.Tensor | None) -> None:
        setattr(self, stored, tensor)

    return property(read, write)


class HostOffloadedLayer(StaticLayer):
    """One full-attention layer: its K and V in a GPU slot, its own or one it shares with others."""

    def __init__(self, max_cache_len: int, cache: HostOffloadedCache, index: int, **kwargs):
        # The cache only weakly: a dropped cache must go at once, not at the next cyclic garbage
        # collection, freeing its name for the next one (_new_loads). The step reads the loads only.
        self.cache_ref, self.loads, self.index = weakref.ref(cache), cache.loads, index
        super().__init__(max_cache_len=max_cache_len)

    @property
    def cache(self) -> HostOffloadedCache:
        return self.cache_ref()

    # A streamed layer's keys and values are its slot's only while the slot holds that layer (from
    # its load's queuing to the next load into the slot): inside its update. Read at another time
    # (cross-attention a step later, code inspecting a layer) they may be another layer's, so such
    # a read is refused. Compiled, only the update reads them.
    keys = _held_tensor("keys")
    values = _held_tensor("values")

    def _held(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        loads = self.loads
        if tensor is None or torch.compiler.is_compiling() or loads.plan is None:
            return tensor
        holder = loads.holder[loads.plan.slot[self.index]]
        if holder == self.index:
            return tensor
        offloaded = self.cache.offloaded
        raise RuntimeError(
            f"HostOffloadedCache: layer {offloaded[self.index]}'s keys and values are streamed from host "
            "memory, and its GPU slot now holds "
            + (f"layer {offloaded[holder]}'s" if holder >= 0 else "no layer's")
            + ": they are read only inside the layer's own update (a decoder's self-attention). Use "
            "StaticCache to read a layer's keys elsewhere, or as an encoder-decoder's cross-attention cache"
        )

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        loads = self.loads
        if loads.plan is None:
            self.cache.allocate(key_states, value_states)
        keys, values = loads.slots[loads.plan.slot[self.index]]
        if key_states.shape[:2] != keys.shape[:2] or key_states.shape[-1] != keys.shape[-1]:
            raise ValueError(
                f"HostOffloadedCache: layer {self.cache.offloaded[self.index]}'s keys are {tuple(key_states.shape)}, "
                f"but the full-attention layers' slots are {tuple(keys.shape)}: every full-attention layer must "
                "have the same batch, KV heads and head dim"
            )
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        self.keys, self.values = keys, values
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        loads, k = self.loads, self.index
        plan = loads.plan
        # Eagerly on CUDA the loads are driver calls bound once; compiled, the ops record them in
        # the graph (and on the CPU the op is the copy itself).
        direct = self.device.type == "cuda" and not torch.compiler.is_compiling()
        lengths, dep = loads.lengths, key_states
        if loads.ahead and k == 0:  # the step before's loads ahead land before this step's loads
            if direct:
                loads.join_ahead()
            else:  # on a step input only: Inductor may run it first, before any graph of the step
                dep = torch.ops.kv_ops.join_ahead(loads.saved[:1], loads.name)
        # Loads first: with one shared slot a layer queues its own (once the layer before it in
        # the slot has been read), then waits for it.
        for target in plan.issues.get(k, ()):
            if direct:
                loads.issue(target, replay=not loads.capturing_now)
            else:
                slot_k, slot_v = loads.slots[plan.slot[target]]
                host_k, host_v = loads.host_views[target]
                torch.ops.kv_ops.prefetch_layer(
                    slot_k, slot_v, dep, lengths[target], lengths[plan.evicts[target]],
                    host_k, host_v, loads.saved[:1], loads.name, target,
                )  # fmt: skip
        if k in plan.evicts:  # streamed: its own load must be done
            if direct:
                loads.wait(k)
            else:
                torch.ops.kv_ops.wait_layer([self.keys, self.values], key_states, loads.name, k)
        for target in plan.ahead.get(k, ()) if loads.ahead else ():  # the next step's, its slot read
            if direct:
                loads.queue_ahead(target)
            else:
                slot_k, slot_v = loads.slots[plan.slot[target]]
                host_k, host_v = loads.host_views[target]
                torch.ops.kv_ops.queue_ahead(
                    slot_k, slot_v, self.keys, self.values, key_states, lengths[target],
                    lengths[plan.evicts[target]], host_k, host_v, loads.saved[:1], loads.name, target,
                )  # fmt: skip
        return super().update(key_states, value_states, *args, **kwargs)

    def reset(self) -> None:
        self.cumulative_length.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        # A layer's rows live in a slot other layers share and in a host copy: only the cache
        # reorders them, all at once (HostOffloadedCache.reorder_cache).
        raise NotImplementedError("HostOffloadedCache: reorder the whole cache (cache.reorder_cache), not one layer")

    def __deepcopy__(self, memo: dict):
        raise NotImplementedError("HostOffloadedCache: copy the whole cache (copy.deepcopy(cache)), not one layer")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(
            "HostOffloadedCache: the batch is fixed when the slots are allocated, so it cannot be repeated; "
            "expand the inputs before the prefill (as generate() does for beam search)"
        )

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("HostOffloadedCache: the batch is fixed when the slots are allocated")


class HostOffloadedCache(Cache):
    """A ``transformers.Cache`` for ``model.generate(..., past_key_values=cache)`` that keeps the
    full-attention layers' K and V in page-locked host memory and as few of them on the GPU as asked.

    Made like ``StaticCache``: ``HostOffloadedCache(config=model.config, max_cache_len=N)``.
    Allocation happens at the first ``update`` (the prefill), from the keys' batch, heads, dtype
    and device; ``max_batch_size`` and ``device``, when given, are checked there. Call
    :meth:`reset` before reusing it for another prompt, as with ``StaticCache``. Beam search
    (:meth:`reorder_cache`), assisted generation (a crop) and ``copy.deepcopy`` (prefix caching)
    work; a batch that changes size after allocation does not. It serves a decoder's
    self-attention: a streamed layer's ``keys`` and ``values`` are readable only where its slot
    holds it (inside its update), so it is no encoder-decoder's cross-attention cache.

    ``max_gpu_bytes`` is the GPU memory the full-attention layers may hold (sliding-window
    layers stay on the GPU besides): as many layers as it holds stay resident, the rest are
    streamed through two shared slots (one, where the budget holds two layers: each load then
    waits for the layer before it). By default the GPU holds three layers' worth (one resident);
    a budget for every layer makes the cache a ``StaticCache`` that streams nothing.
    Each step moves, per streamed layer, the positions written so far host-to-GPU and its new
    positions GPU-to-host (:meth:`bytes_per_step`), whatever ``max_cache_len`` is.

    ``load_ahead`` (off by default) keeps the last full-attention layer resident instead of the
    first and queues each of the next step's first loads once the step has read its slot, beside
    the step's last layers and the host's work between steps; the next step's first layer waits
    for them. Compiled with CUDA graphs, these ops run between graphs. Off, the step queues every
    load itself. Tokens are the same either way. A step captured by hand stops the loads ahead.

    Raises
    ------
    TypeError
        A ``config`` that is not a transformers config (a model, say); pickling (``torch.save``).
    ValueError
        Before anything moves. At construction: a bad ``max_cache_len``, ``max_batch_size``,
        ``max_gpu_bytes`` or ``load_ahead``, a keyword it does not take (a misspelt one), a layer
        type other than full, sliding or chunked attention. At the first update: keys on another
        device than ``device``, a batch over ``max_batch_size``, a prompt past ``max_cache_len``,
        a budget below two layers (naming the minimum), host memory the machine lacks. Eagerly: a
        step past ``max_cache_len``, keys of another batch or dtype than the slots', a layer the
        config lacks, a bad ``beam_idx``, a closed cache (stepped, reordered or copied).
    RuntimeError
        A capture of the first step (it allocates); a streamed layer's ``keys`` read while its slot holds another.
    """

    def __init__(
        self,
        config,
        max_cache_len: int,
        max_batch_size: int | None = None,
        device: torch.device | str | None = None,
        max_gpu_bytes: int | None = None,
        load_ahead: bool = False,
        **kwargs,
    ):
        _check_static_cache_arguments(kwargs)
        if not isinstance(config, PreTrainedConfig):
            hint = "; pass model.config" if isinstance(getattr(config, "config", None), PreTrainedConfig) else ""
            raise TypeError(
                f"HostOffloadedCache: config must be a transformers configuration, got {type(config).__name__}{hint}"
            )
        self.max_cache_len_ = arguments.positive_int("HostOffloadedCache", "max_cache_len", max_cache_len)
        self.max_batch_size_, self.max_gpu_bytes = (
            None if value is None else arguments.positive_int("HostOffloadedCache", what, value)
            for what, value in (("max_batch_size", max_batch_size), ("max_gpu_bytes", max_gpu_bytes))
        )
        self.device = None if device is None else arguments.device("HostOffloadedCache", device)
        self.load_ahead = arguments.flag("HostOffloadedCache", "load_ahead", load_ahead)
        text = config.get_text_config(decoder=True)
        layer_types, kwargs_ = get_layer_types_and_kwargs(text)
        # One dict for every layer (transformers < 5.19) or one per layer.
        per_layer = kwargs_ if isinstance(kwargs_, list) else [kwargs_] * len(layer_types)
        others = sorted({t for t in layer_types if t != FULL and t not in WINDOWED and t not in NO_CACHE})
        if others:
            raise ValueError(
                f"HostOffloadedCache: {type(config).__name__} has layers of type {others}; this cache serves "
                f"{FULL!r} (offloaded) and {', '.join(map(repr, WINDOWED))} (kept on the GPU) only"
            )
        # Model indices, in order. None (every layer windowed: Mistral with a sliding window) makes
        # this cache a StaticCache that streams nothing, as transformers' offloading does there.
        self.offloaded = [i for i, t in enumerate(layer_types) if t == FULL]
        self.loads = _new_loads()
        self.name = self.loads.name
        index = {layer: k for k, layer in enumerate(self.offloaded)}
        layers = [
            HostOffloadedLayer(self.max_cache_len_, self, index[i])
            if t == FULL
            else DummyLayer()
            if t in NO_CACHE
            else StaticSlidingWindowLayer(max_cache_len=self.max_cache_len_, sliding_window=kw["sliding_window"])
            for i, (t, kw) in enumerate(zip(layer_types, per_layer, strict=True))
        ]
        super().__init__(layers=layers)
        self._seen = 0  # tokens so far, counted eagerly only (a compiled step cannot read it back)

    def allocate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Plan the slots for the budget and allocate them (the first full-attention layer's first update)."""
        count = len(self.offloaded)
        layer = slot_bytes(keys, values, self.max_cache_len_)
        slots = min(3, count)
        if self.max_gpu_bytes is not None:
            slots = min(2, count)
            if self.max_gpu_bytes < slots * layer:
                raise ValueError(
                    f"HostOffloadedCache: max_gpu_bytes={self.max_gpu_bytes} is below the {slots} layer slots the "
                    f"cache needs at least: {slots * layer} bytes ({layer} per full-attention layer at batch "
                    f"{keys.shape[0]} and max_cache_len {self.max_cache_len_})"
                )
            slots = min(count, self.max_gpu_bytes // layer)
        full = [self.layers[i] for i in self.offloaded]
        for layer_ in full:  # the loads read every layer's count on the device, from the first step
            layer_.cumulative_length = layer_.cumulative_length.to(keys.device)
            mark_static_address(layer_.cumulative_length)
        lengths = [layer_.cumulative_length for layer_ in full]
        self.loads.ahead = self.load_ahead
        self.loads.allocate(plan_slots(count, slots, self.load_ahead), keys, values, self.max_cache_len_, lengths)

    # Cache's update, with the checks an eager first call can make before anything is allocated.
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # A compiled or captured step cannot count (its Python runs once, its replays many times).
        if not torch.compiler.is_compiling():
            capturing_now = self.loads.capturing_now = capturing(key_states.device)
            if not capturing_now:
                self._check(key_states, layer_idx)
            elif not getattr(self.layers[layer_idx], "is_initialized", True):  # it would allocate (pin, copy)
                raise RuntimeError(
                    "HostOffloadedCache: a CUDA graph cannot capture the first step, which allocates the cache; "
                    "run one step before capturing (the warm-up torch.cuda.graph asks for)"
                )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _check(self, key_states: torch.Tensor, layer_idx: int) -> None:
        if layer_idx == 0:  # once a step, before any layer writes
            self._check_open()
        if not 0 <= layer_idx < len(self.layers):  # a model with more layers than the config
            raise ValueError(f"HostOffloadedCache: no layer_idx {layer_idx} in the config's {len(self.layers)} layers")
        if self.device is not None and key_states.device != self.device:
            raise ValueError(
                f"HostOffloadedCache: the model's keys are on {key_states.device}, but the cache was made for {self.device}"
            )
        batch, new = key_states.shape[0], key_states.shape[-2]
        if self.max_batch_size_ is not None and batch > self.max_batch_size_:
            raise ValueError(f"HostOffloadedCache: a batch of {batch} is over max_batch_size {self.max_batch_size_}")
        if self.offloaded and layer_idx == self.offloaded[0]:  # windowed layers never run out
            self._check_slots(key_states)
            if self._seen + new > self.max_cache_len_:
                n, cap = self._seen, self.max_cache_len_
                raise ValueError(f"HostOffloadedCache: {n} tokens cached and {new} more would pass max_cache_len {cap}")
            self.loads.know(self._seen)  # on every streamed layer's host copy: its eager loads' copy-engine part
            self._seen += new

    def _check_slots(self, key_states: torch.Tensor) -> None:
        """Keys that the slots, allocated at the first prefill, cannot hold: a clear error where
        the copy into the slot would fail with torch's (a reset cache reused at another batch)."""
        if self.loads.plan is None:
            return
        keys = self.loads.slots[0][0]
        got = (*key_states.shape[:2], key_states.shape[-1], key_states.dtype)
        if got != (*keys.shape[:2], keys.shape[-1], keys.dtype):
            raise ValueError(
                f"HostOffloadedCache: the slots were allocated for keys of batch {keys.shape[0]}, "
                f"{keys.shape[1]} heads, head dim {keys.shape[-1]} and {keys.dtype}, but got keys "
                f"{tuple(key_states.shape)} of {key_states.dtype}: make a new cache for another batch or dtype"
            )

    def _check_open(self) -> None:
        if not in_step.is_live(self.loads):
            raise ValueError(f"HostOffloadedCache: {self.name!r} was closed (close()); make a new cache")

    def reset(self) -> None:
        super().reset()
        self.loads.reset()
        self._seen = 0

    def crop(self, max_length: int) -> None:
        """As ``StaticCache.crop``: ``-n`` forgets the last n tokens (assisted generation's
        rejected ones); they no longer count against ``max_cache_len``. Forgetting more than the
        cache holds empties it (``StaticCache``'s lengths go below zero there, and its next step
        fails to write); each count is clamped where it is, the GPU's without a sync."""
        max_length = arguments.integer("HostOffloadedCache.crop", "max_length", max_length)
        super().crop(max_length)
        for layer in self.layers:
            if isinstance(layer, StaticLayer):  # full and windowed (the placeholders keep no count)
                layer.cumulative_length.clamp_(min=0)
            if hasattr(layer, "cumulative_length_int"):  # a windowed layer's host count (transformers 5.24)
                layer.cumulative_length_int = max(0, layer.cumulative_length_int)
        self.loads.crop()
        if max_length < 0:
            self._seen = max(0, self._seen + max_length)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the sequences for beam search (``generate(num_beams=...)``): sequence i takes
        sequence ``beam_idx[i]``'s keys and values, the indices checked on the host first (a bad
        one is a ``ValueError``, not a device assert). The full-attention layers are reordered in
        place, slots and host copies keeping their addresses (so a captured step still reads
        them), after the GPU's loads (a sync); the other layers as transformers does."""
        self._check_open()
        if self.get_seq_length() == 0:  # nothing cached, nothing to reorder (nor a batch to check against)
            return
        arguments.rows("HostOffloadedCache.reorder_cache", "beam_idx", beam_idx, self.layers[0].batch_size)
        kept = set(self.offloaded)
        for i, layer in enumerate(self.layers):  # a placeholder layer (DummyLayer) keeps nothing
            if i not in kept and not (DummyLayer is not None and isinstance(layer, DummyLayer)):
                layer.reorder_cache(beam_idx)
        if self.offloaded:
            self.loads.reorder(beam_idx)

    def __deepcopy__(self, memo: dict) -> HostOffloadedCache:
        """A cache of its own (a new name, slots and host copies) holding what this one holds, as
        transformers' prefix caching uses it: fill a cache with a shared prompt once, then
        ``copy.deepcopy`` it for each request. Waits for the GPU's loads (a sync), as
        :meth:`reorder_cache` does. A closed cache holds nothing to copy: ``ValueError``."""
        self._check_open()
        new = self.__copy__()
        memo[id(self)] = new
        new.loads = _new_loads()
        new.name = new.loads.name
        index = {layer: k for k, layer in enumerate(self.offloaded)}
        new.layers = [
            HostOffloadedLayer(self.max_cache_len_, new, index[i]) if i in index else copy.deepcopy(layer, memo)
            for i, layer in enumerate(self.layers)
        ]
        if self.loads.plan is not None:
            # Allocated alike: the same keys' shape gives the same plan, and every count is still
            # zero while the loads are bound; then the contents.
            keys, values = (t[:, :, :0] for t in self.loads.slots[0])
            for i in self.offloaded:
                if self.layers[i].is_initialized:
                    new.layers[i].lazy_initialization(keys, values)
            for i in self.offloaded:
                new.layers[i].cumulative_length.copy_(self.layers[i].cumulative_length)
            new.loads.copy_from(self.loads)
        return new

    @property
    def max_cache_len(self) -> int:
        return self.max_cache_len_

    def __copy__(self) -> HostOffloadedCache:
        """The same cache under a second reference (name, slots, loads), as StaticCache's shallow copy."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "HostOffloadedCache cannot be pickled (torch.save included): its slots, page-locked host copies "
            "and loads live in this process. Copy it here with copy.deepcopy, or keep the prompt and prefill "
            "a new cache"
        )

    @property
    def max_batch_size(self) -> int:
        """The ``max_batch_size`` given, else the batch the slots were allocated for (-1 before)."""
        return self.max_batch_size_ if self.max_batch_size_ is not None else self.batch_size

    def resident(self) -> list[int]:
        """Model indices of the full-attention layers that keep a GPU slot of their own (once allocated)."""
        plan = self.loads.plan
        return [] if plan is None else [self.offloaded[k] for k in range(plan.layers) if k not in plan.evicts]

    def bytes_per_step(self) -> tuple[int, int]:
        """Bytes the next decode step moves, host to GPU and GPU to host, at the current sequence
        length (read from the GPU: a sync). Zero before the first update, or with nothing streamed."""
        return self.loads.bytes_per_step()

    def gpu_bytes(self) -> int:
        """GPU bytes this cache holds for the full-attention layers (the resident and the shared slots)."""
        return sum(t.numel() * t.element_size() for pair in self.loads.slots for t in pair)

    def close(self) -> None:
        """Drop the cache's name, for the next cache to take; a step on it afterwards raises
        ``ValueError`` (a compiled one ``RuntimeError``: it hands the op this cache's host copies,
        which the name's new loads do not hold). Closing twice is harmless."""
        self.loads.close()


def _check_static_cache_arguments(kwargs: dict) -> None:
    """A ``ValueError`` for a keyword argument it would drop (a misspelt ``max_gpu_bytes``). StaticCache's
    ``dtype`` (the keys' decides) and ``offload_only_non_sliding`` pass; ``offloading`` only as False."""
    if kwargs.get("offloading", False):
        raise ValueError(
            "HostOffloadedCache: offloading=True is StaticCache's own offloading; this cache offloads by "
            "itself (max_gpu_bytes sets what stays on the GPU)"
        )
    unknown = sorted(set(kwargs) - {"dtype", "offloading", "offload_only_non_sliding"})
    if unknown:
        raise ValueError(
            f"HostOffloadedCache: unknown keyword argument(s) {unknown}; it takes config, max_cache_len, "
            "max_batch_size, device, max_gpu_bytes and load_ahead"
        )


__all__ = ["HostOffloadedCache", "HostOffloadedLayer"]
