"""SlotEngines: an eager step's slot loads of the positions the host knows, by the copy engine.

A load's kernel (:class:`kv_ops.prefix_copy.PrefixCopy`) reads host memory zero-copy from the
SMs, and those reads slow the model's kernels that run beside it, where a copy engine moving the
same bytes hardly does (docs/design.md). An eager step knows on the host how many positions every
streamed layer's host copy holds: the tokens before the step. So its load of a layer runs the
kernel told to start there (the start word), which writes the evicted layer back and loads any
positions past them, then one ``cuMemcpy2DAsync`` of every row's first positions, keys and values
together where they lie back to back, on the same stream: after the write-back has read the
slot. Where those positions are small (under :data:`FROM_BYTES` a layer), the step waits on the
host more than on the kernel's reads, and the copy's driver call is not worth it: the kernel
starts at 0. A compiled or captured step knows no count on the host; its loads start at 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..cuda import driver
from ..cuda.host_memory import bytes_at
from . import dma


def kv_pair(make, k_shape, k_dtype, v_shape, v_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's keys and values, by ``make(shape, dtype=...)``: where their shapes and dtypes agree,
    one allocation, keys then values, so that an eager load moves both in one copy, as two
    tensors of storages of their own (two views of one storage would be aliases to a compiled
    step, which then copies them in and out of a base of its own, not the memory the loads fill)."""
    if k_shape != v_shape or k_dtype != v_dtype:
        return make(k_shape, dtype=k_dtype), make(v_shape, dtype=v_dtype)
    both = make((2, *k_shape), dtype=k_dtype)
    half = both[0].numel() * both.element_size()
    return tuple(
        bytes_at(both, both.data_ptr() + i * half, half, both.device).view(k_dtype).view(k_shape) for i in (0, 1)
    )


# The bytes of a layer's known positions (keys and values) from which an eager load moves them by
# the copy engine; below, the kernel moves every position. Between the measured sides: the step
# gained with it at 32 and 128 MiB a load, and lost a little at 8 MiB, where it waits on the host
# and a driver call more per load costs more than the kernel's reads slow (docs/measurements.md).
FROM_BYTES = 16 << 20


def engine_positions(known: int, position_bytes: int) -> int:
    """The positions an eager step's loads move by the copy engine: all ``known`` ones where they
    hold at least :data:`FROM_BYTES` a layer (``position_bytes`` each), else none."""
    return known if known * position_bytes >= FROM_BYTES else 0


class SlotEngines:
    """The start word, and per streamed layer the copies of its first positions, bound once."""

    def __init__(self, stream: torch.cuda.Stream):
        self.launcher = dma.Launcher(stream)
        self.stream = stream.cuda_stream
        # int64, read by every eager launch: the first position its kernel loads. One word for all
        # layers, since an eager step's loads all start at the positions before the step.
        self.start = torch.zeros((), dtype=torch.int64, device=stream.device)
        self.word = self.start.data_ptr()
        self.written = 0  # what the last write of the word put there (the host's copy of it)
        # Per layer, its copies (bound once: a call sets the width) and the bytes of one position.
        self.copies: dict[int, tuple[tuple[Callable[[int], None], int], ...]] = {}

    def bind(self, k: int, slot: tuple[torch.Tensor, torch.Tensor], host: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Bind layer k's copies from ``host`` (its host copy's device views) into ``slot``:
        ``[batch, heads, max_cache_len, dim]`` pairs, a row's positions back to back. Keys and
        values that lie one after the other on both sides (the slots and host copies are so
        allocated where their shapes agree) move as one copy: a driver call less per load."""
        (sk, sv), (hk, hv) = slot, host
        rows = sk.shape[0] * sk.shape[1]
        adjacent = all(
            v.shape == k.shape and v.dtype == k.dtype and v.data_ptr() == k.data_ptr() + k.numel() * k.element_size()
            for k, v in ((sk, sv), (hk, hv))
        )
        pairs = [(sk, hk, 2 * rows)] if adjacent else [(sk, hk, rows), (sv, hv, sv.shape[0] * sv.shape[1])]
        self.copies[k] = tuple(
            (self.launcher.bind_2d(dma.Copy2D(s.data_ptr(), s.stride(1) * s.element_size(), h.data_ptr(),
                                              h.stride(1) * h.element_size(), 0, height)),
             s.shape[-1] * s.element_size())
            for s, h, height in pairs
        )  # fmt: skip

    def load(self, k: int, known: int, launch: int) -> None:
        """Layer k's load on the bound stream: the start word set to ``known`` (where it holds
        another count), the executable graph ``launch`` (its kernel bound to that word), then the
        copies of ``[0, known)``."""
        if known != self.written:
            # The word's low 32 bits (its high ones stay 0: a position count fits). The write is
            # stream-ordered after every launch that read the old count, and before this one.
            driver.write_value(self.stream, self.word, known)
            self.written = known
        driver.graph_launch(launch, self.stream)
        for copy, position in self.copies[k]:  # after the write-back read the slot
            copy(known * position)


__all__ = ["FROM_BYTES", "SlotEngines", "engine_positions", "kv_pair"]
