"""HostOffloadedCache: a transformers ``Cache`` whose full-attention K and V live in page-locked host memory.

The GPU holds three layer slots. The first full-attention layer keeps its own slot for good;
every other full-attention layer is streamed into one of two rotating slots by the copy engines
while the layer before it computes (``torch.ops.kv_ops.prefetch_layer`` on a load stream of its
own, ``torch.ops.kv_ops.wait_prefetch`` before the layer reads it). A step's new tokens go to the
slot and, through a zero-copy view, to the host copy: the rest is never copied back.
Sliding-window layers stay on the GPU as transformers' own static layers, as its
``offload_only_non_sliding`` does. The ops carry the cache's name, never an address, so the cache
works eagerly, under ``torch.compile(fullgraph=True)`` and in a captured CUDA graph (the copies
become memcpy nodes at fixed addresses, the waits event edges).

Why a slot holds a whole layer: a layer's attention reads every position up to
``max_cache_len`` (the static mask hides the rest), so the slot must hold the layer's own bytes
there; copying all of them keeps the content bitwise what ``StaticCache`` holds, and the copy is
one contiguous transfer per tensor, at the link's rate.
"""

from __future__ import annotations

import itertools

import torch

try:
    from transformers.cache_utils import Cache, StaticLayer, StaticSlidingWindowLayer, get_layer_types_and_kwargs
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError("kv_ops.integrations.transformers needs transformers: pip install 'offload-ops[hf]'") from error

from .. import arguments
from ..capture import capturing
from ..host_memory import check_host_bytes, device_view, pinned_empty
from ..registration import find_named, register_op

# Layer types this cache serves: full attention (offloaded) and the windowed kinds (kept on the GPU).
FULL = "full_attention"
WINDOWED = ("sliding_attention", "chunked_attention")

_registry: dict[str, _Offload] = {}
_names = itertools.count()


def _lookup(name: str) -> _Offload:
    return find_named(_registry, name, "kv_ops.prefetch_layer", "HostOffloadedCache")


class _Offload:
    """The live state behind one cache's ops: host copies, slots, the load stream and its events."""

    def __init__(self, name: str, offloaded: list[int]):
        self.name = name
        self.offloaded = offloaded  # model layer indices of the full-attention layers, in order
        # The first full-attention layer keeps slot 0; the others alternate between slots 1 and 2,
        # so a layer's prefetch overwrites the slot of the layer two before it, which has been read.
        self.slot = {layer: 0 if k == 0 else 1 + (k - 1) % 2 for k, layer in enumerate(offloaded)}
        self.host: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> page-locked (K, V)
        self.host_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # what the GPU writes through
        self.slots: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.stream: torch.cuda.Stream | None = None
        self.free: dict[int, torch.cuda.Event] = {}  # recorded where a layer's slot may be overwritten
        self.loaded: dict[int, torch.cuda.Event] = {}  # recorded after a layer's copy into its slot

    def allocate(self, keys: torch.Tensor, values: torch.Tensor, max_cache_len: int) -> None:
        batch, heads, _, k_dim = keys.shape
        v_dim = values.shape[-1]
        k_shape, v_shape = (batch, heads, max_cache_len, k_dim), (batch, heads, max_cache_len, v_dim)
        layer_bytes = (k_dim + v_dim) * batch * heads * max_cache_len * keys.element_size()
        device = keys.device
        streamed = self.offloaded[1:]
        if device.type == "cuda":
            check_host_bytes(
                "HostOffloadedCache", "the host copy of the full-attention layers", len(streamed) * layer_bytes
            )
        for layer in streamed:
            if device.type == "cuda":
                # Zeros, as StaticCache's: positions past the sequence are read (and masked); stale
                # page-locked bytes could hold NaN, which a zero attention weight does not cancel.
                k = pinned_empty(k_shape, dtype=keys.dtype).zero_()
                v = pinned_empty(v_shape, dtype=values.dtype).zero_()
                self.host_views[layer] = (device_view(k, device), device_view(v, device))
            else:
                k, v = torch.zeros(k_shape, dtype=keys.dtype), torch.zeros(v_shape, dtype=values.dtype)
                self.host_views[layer] = (k, v)
            self.host[layer] = (k, v)
        for _ in range(min(3, len(self.offloaded))):
            k = torch.zeros(k_shape, dtype=keys.dtype, device=device)
            v = torch.zeros(v_shape, dtype=values.dtype, device=device)
            for t in (k, v):
                torch._dynamo.mark_static_address(t)
            self.slots.append((k, v))
        for views in self.host_views.values():
            for t in views:
                torch._dynamo.mark_static_address(t)
        if device.type == "cuda":
            # Low priority: a prefetch must never delay the layer that computes beside it.
            self.stream = torch.cuda.Stream(device, priority=torch.cuda.Stream.priority_range()[0])
            self.free = {layer: torch.cuda.Event() for layer in streamed}
            self.loaded = {layer: torch.cuda.Event() for layer in streamed}

    def reset(self) -> None:
        for k, v in [*self.host.values(), *self.slots]:
            k.zero_()
            v.zero_()


# --- prefetch_layer / wait_prefetch ---------------------------------------------------------------


def _fake(slot_k, slot_v, dep, name, layer):
    torch._check(layer >= 0, lambda: f"kv_ops.prefetch_layer: layer must be >= 0, got {layer}")


def _prefetch_cpu(slot_k, slot_v, dep, name, layer) -> None:
    k, v = _lookup(name).host[layer]
    slot_k.copy_(k)
    slot_v.copy_(v)


def _prefetch_cuda(slot_k, slot_v, dep, name, layer) -> None:
    state = _lookup(name)
    k, v = state.host[layer]
    # The slot's last reader (the layer two before) is already on the current stream: the load
    # stream waits for it there, then copies the whole layer; ``loaded`` marks the end.
    free = state.free[layer]
    free.record()
    state.stream.wait_event(free)
    with torch.cuda.stream(state.stream):
        slot_k.copy_(k, non_blocking=True)
        slot_v.copy_(v, non_blocking=True)
        state.loaded[layer].record()


def _wait_cpu(slot_k, slot_v, dep, name, layer) -> None:
    _lookup(name)


def _wait_cuda(slot_k, slot_v, dep, name, layer) -> None:
    torch.cuda.current_stream().wait_event(_lookup(name).loaded[layer])


register_op(
    "kv_ops",
    "prefetch_layer(Tensor(a!) slot_k, Tensor(b!) slot_v, Tensor dep, str name, int layer) -> ()",
    fake=_fake,
    cpu=_prefetch_cpu,
    cuda=_prefetch_cuda,
)
register_op(
    "kv_ops",
    "wait_prefetch(Tensor(a!) slot_k, Tensor(b!) slot_v, Tensor dep, str name, int layer) -> ()",
    fake=_fake,
    cpu=_wait_cpu,
    cuda=_wait_cuda,
)


# --- the cache -------------------------------------------------------------------------------------


class HostOffloadedLayer(StaticLayer):
    """One full-attention layer: its K and V in a GPU slot, streamed from page-locked host memory."""

    def __init__(self, max_cache_len: int, state: _Offload, index: int, following: int | None, **kwargs):
        super().__init__(max_cache_len=max_cache_len)
        self.state, self.index, self.following = state, index, following

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        state = self.state
        if not state.slots:
            state.allocate(key_states, value_states, self.max_cache_len)
        keys, values = state.slots[state.slot[self.index]]
        if key_states.shape[:2] != keys.shape[:2] or key_states.shape[-1] != keys.shape[-1]:
            raise ValueError(
                f"HostOffloadedCache: layer {self.index}'s keys are {tuple(key_states.shape)}, but the "
                f"full-attention layers' slots are {tuple(keys.shape)}: every full-attention layer must "
                "have the same batch, KV heads and head dim"
            )
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        self.keys, self.values = keys, values
        self.cumulative_length = self.cumulative_length.to(self.device)
        torch._dynamo.mark_static_address(self.cumulative_length)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        state = self.state
        if self.index != state.offloaded[0]:
            torch.ops.kv_ops.wait_prefetch(self.keys, self.values, key_states, state.name, self.index)
        if self.following is not None:
            k, v = state.slots[state.slot[self.following]]
            torch.ops.kv_ops.prefetch_layer(k, v, key_states, state.name, self.following)
        positions = torch.arange(key_states.shape[-2], device=self.device) + self.cumulative_length
        self.cumulative_length.add_(key_states.shape[-2])
        self.keys.index_copy_(2, positions, key_states)
        self.values.index_copy_(2, positions, value_states)
        host = state.host_views.get(self.index)
        if host is not None:  # the step's new tokens, and nothing else, go back to the host
            host[0].index_copy_(2, positions, key_states)
            host[1].index_copy_(2, positions, value_states)
        return self.keys, self.values

    def reset(self) -> None:
        self.cumulative_length.zero_()


class HostOffloadedCache(Cache):
    """A ``transformers.Cache`` for ``model.generate(..., past_key_values=cache)`` that keeps the
    full-attention layers' K and V in page-locked host memory and three layer slots on the GPU.

    Made like ``StaticCache``: ``HostOffloadedCache(config=model.config, max_cache_len=N)``.
    Allocation happens at the first ``update`` (the prefill), from the keys' batch, heads, dtype
    and device; ``max_batch_size`` and ``device``, when given, are checked there. Call
    :meth:`reset` before reusing it for another prompt, as with ``StaticCache``.

    Each step moves every streamed layer's K and V host-to-GPU once (all layers but the first
    full-attention one, which keeps its slot) and the step's new tokens GPU-to-host.

    Raises
    ------
    ValueError
        At construction: a bad ``max_cache_len`` or ``max_batch_size``, a model with no
        full-attention layer, or a layer type other than full, sliding or chunked attention. At
        the first update: keys on another device than ``device``, a batch over
        ``max_batch_size``, a prompt longer than ``max_cache_len``, or host memory the machine
        lacks. Eagerly, a step past ``max_cache_len``.
    """

    def __init__(
        self,
        config,
        max_cache_len: int,
        max_batch_size: int | None = None,
        device: torch.device | str | None = None,
        **kwargs,
    ):
        self.max_cache_len_ = arguments.positive_int("HostOffloadedCache", "max_cache_len", max_cache_len)
        self.max_batch_size_ = (
            None
            if max_batch_size is None
            else arguments.positive_int("HostOffloadedCache", "max_batch_size", max_batch_size)
        )
        self.device = None if device is None else arguments.device("HostOffloadedCache", device)
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        layer_types, kwargs_ = get_layer_types_and_kwargs(text)
        # One dict for every layer (transformers < 5.19) or one per layer.
        per_layer = kwargs_ if isinstance(kwargs_, list) else [kwargs_] * len(layer_types)
        others = sorted({t for t in layer_types if t != FULL and t not in WINDOWED})
        if others:
            raise ValueError(
                f"HostOffloadedCache: {type(config).__name__} has layers of type {others}; this cache serves "
                f"{FULL!r} (offloaded) and {', '.join(map(repr, WINDOWED))} (kept on the GPU) only"
            )
        offloaded = [i for i, t in enumerate(layer_types) if t == FULL]
        if not offloaded:
            raise ValueError(
                f"HostOffloadedCache: {type(config).__name__} has no full-attention layer to offload "
                f"(layer types {sorted(set(layer_types))}); use transformers' StaticCache"
            )
        self.name = f"hf-cache-{next(_names)}"
        self.state = _Offload(self.name, offloaded)
        following = dict(zip(offloaded, offloaded[1:]))
        layers = [
            HostOffloadedLayer(self.max_cache_len_, self.state, i, following.get(i))
            if t == FULL
            else StaticSlidingWindowLayer(max_cache_len=self.max_cache_len_, sliding_window=kw["sliding_window"])
            for i, (t, kw) in enumerate(zip(layer_types, per_layer, strict=True))
        ]
        super().__init__(layers=layers)
        self._seen = 0  # tokens so far, counted eagerly only (a compiled step cannot read it back)
        _registry[self.name] = self.state

    # Cache's update, with the checks an eager first call can make before anything is allocated.
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # A compiled or captured step cannot count (its Python runs once, its replays many times).
        if not torch.compiler.is_compiling() and not capturing(key_states.device):
            self._check(key_states, layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _check(self, key_states: torch.Tensor, layer_idx: int) -> None:
        if self.device is not None and key_states.device != self.device:
            raise ValueError(
                f"HostOffloadedCache: the model's keys are on {key_states.device}, but the cache was made for {self.device}"
            )
        batch, new = key_states.shape[0], key_states.shape[-2]
        if self.max_batch_size_ is not None and batch > self.max_batch_size_:
            raise ValueError(f"HostOffloadedCache: a batch of {batch} is over max_batch_size {self.max_batch_size_}")
        if layer_idx == self.state.offloaded[0]:
            if self._seen + new > self.max_cache_len_:
                raise ValueError(
                    f"HostOffloadedCache: {self._seen} tokens cached and {new} more would pass max_cache_len "
                    f"{self.max_cache_len_}"
                )
            self._seen += new

    def reset(self) -> None:
        super().reset()
        self.state.reset()
        self._seen = 0

    @property
    def max_cache_len(self) -> int:
        return self.max_cache_len_

    @property
    def max_batch_size(self) -> int:
        return self.max_batch_size_ if self.max_batch_size_ is not None else super().max_batch_size

    def bytes_per_step(self) -> tuple[int, int]:
        """Bytes one decode step moves (host to GPU, GPU to host per new token), once allocated."""
        if not self.state.slots:
            return 0, 0
        k, v = self.state.slots[0]
        layer = k.numel() * k.element_size() + v.numel() * v.element_size()
        streamed = len(self.state.offloaded) - 1
        per_token = layer // self.max_cache_len_
        return streamed * layer, streamed * per_token

    def gpu_bytes(self) -> int:
        """GPU bytes this cache holds for the full-attention layers (its slots)."""
        return sum(t.numel() * t.element_size() for pair in self.state.slots for t in pair)

    def close(self) -> None:
        """Drop the cache's host memory and its name (the model must not run on it afterwards)."""
        if _registry.get(self.name) is self.state:
            del _registry[self.name]


__all__ = ["HostOffloadedCache", "HostOffloadedLayer"]
