"""The staged paths' ring: GPU slots of packed rows, the streams that fill and drain them, and the order of their reuse.

One engine has one ring, whichever of its KV groups' staged paths uses it: the first path makes
it and every later one is handed the same object (:class:`kv_ops.transfer.staged.StagedPath`'s
``share``). The slots, the cursor that deals them out, the streams and the events that order a
slot's reuse live here, so that the paths see one ring and no path reads another's state.
"""

from __future__ import annotations

import torch

from . import dma
from .blocks import Direction, low_priority_streams, recorded

# Ring slots per direction: with four, a store's gather of chunk i+1 (and i+2) runs while the
# copy engines drain chunk i, and calls issued back to back keep the pipeline full.
RING_SLOTS = 4


class StagingRing:
    """Each direction's ring of :data:`RING_SLOTS` slots of ``chunk`` packed rows, and its streams.

    A slot holds at least one row, and no more rows than a transfer can have (``num_blocks`` GPU
    blocks, or every mirror row). On the GPU each direction has a kernel stream (the gathers and
    scatters) beside the engine's copy stream; :attr:`copy_launchers` and
    :attr:`kernel_launchers` enqueue copy-engine plans and id copies on them. ``slot_free[d][s]``
    is recorded after the work that last read slot ``s`` (a store's DMA, a load's scatter), and
    ``handoff[d]`` carries each chunk from one stream to the other: it is waited on right after
    every record. Each event is recorded once here (on an idle stream), so that it exists and
    every later record is one driver call.

    Parameters
    ----------
    mirror : Tensor
        The packed mirror ``[num_host_blocks, row_bytes]`` (uint8).
    num_blocks : int
        GPU blocks of the cache.
    device : torch.device
        Where the ring lives.
    streams : dict of Direction to Stream, or None
        The engine's copy streams (None on the CPU: no kernel streams, launchers or events).
    ring_bytes : int
        GPU memory of each direction's ring.
    """

    def __init__(
        self, mirror: torch.Tensor, num_blocks: int, device: torch.device, streams: dict | None, ring_bytes: int
    ):
        self.mirror = mirror
        self.device = device
        row_bytes = mirror.shape[1]
        most_pairs = max(mirror.shape[0], num_blocks)
        self.chunk = max(1, min(ring_bytes // (RING_SLOTS * row_bytes), -(-most_pairs // RING_SLOTS)))
        self.cursor = {d: 0 for d in Direction}  # the slot each direction's next chunk takes
        # Each direction's ring. On the GPU, made with the first path's graphs; on the CPU, on
        # first use (an engine there picks the kernel path's reference copy unless told).
        self.rings: dict[Direction, torch.Tensor] = {}
        if streams is None:
            self.kernel_streams = self.copy_launchers = self.kernel_launchers = None
            self.slot_free = self.handoff = None
            return
        # Where the gathers and scatters run, beside the engine's copy streams.
        self.kernel_streams = low_priority_streams(device)
        self.copy_launchers = {d: dma.Launcher(streams[d]) for d in Direction}
        self.kernel_launchers = {d: dma.Launcher(self.kernel_streams[d]) for d in Direction}
        self.slot_free = {d: [recorded(streams[d]) for _ in range(RING_SLOTS)] for d in Direction}
        self.handoff = {d: recorded(streams[d]) for d in Direction}

    @property
    def ring_bytes(self) -> int:
        """GPU bytes of one direction's ring."""
        return RING_SLOTS * self.chunk * self.mirror.shape[1]

    def ring(self, direction: Direction) -> torch.Tensor:
        """The direction's ring of packed rows ``[RING_SLOTS * chunk, row_bytes]``, made on first use."""
        ring = self.rings.get(direction)
        if ring is None:
            ring = torch.empty((RING_SLOTS * self.chunk, self.mirror.shape[1]), dtype=torch.uint8, device=self.device)
            self.rings[direction] = ring
        return ring

    def slot_rows(self, direction: Direction, slot: int) -> torch.Tensor:
        """The ``chunk`` rows of ``slot`` in the direction's ring."""
        return self.ring(direction)[slot * self.chunk : (slot + 1) * self.chunk]

    def take_slot(self, direction: Direction) -> int:
        """The slot for the direction's next chunk: round-robin, across calls and paths."""
        slot = self.cursor[direction]
        self.cursor[direction] = (slot + 1) % RING_SLOTS
        return slot

    def close(self) -> None:
        """Wait for the gathers and scatters on the kernel streams (the engine synchronizes its
        copy streams): after an interrupted flush they must not outlive the memory they use."""
        for stream in (self.kernel_streams or {}).values():
            stream.synchronize()


__all__ = ["StagingRing", "RING_SLOTS"]
