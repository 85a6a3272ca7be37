"""The Triton kernel that loads a layer's written positions into a GPU slot, and its bound launcher.

A layer's keys (or values) are ``[batch, heads, max_cache_len, dim]``: ``batch x heads`` rows,
each ``max_cache_len`` positions of ``dim`` elements. A slot on the GPU serves several layers in
turn. One launch does, per row and per tile of positions, two things in order:

1. **write back** the positions the slot's last layer (the *evicted* layer) wrote since it was
   loaded, ``[saved, length)`` of that layer, from the slot to the layer's host copy;
2. **load** the positions the next layer (the *target*) has written so far, ``[start, length)``,
   from its host copy into the slot. ``start`` is 0 but where the copy engine brings the first
   positions in after the launch (an eager step's loads: :mod:`kv_ops.transfer.slot_loads`).

Both lengths are read on the GPU when the kernel runs, so one captured launch serves every step
of a growing sequence, and the bytes moved follow the positions in use, not ``max_cache_len``.
A load bound with a *claim* first runs a one-program kernel that marks the slot as the
target's and tells the copy whether it already was: a load queued twice (ahead of the step,
then by the step itself) moves its bytes once, whichever comes first, with no host in between.
Positions past the target's length keep what the slot held: finite keys and values of an
earlier layer, which the attention mask hides. Host copies are reached through their mapped
device addresses (zero-copy), so there is no staging buffer and the launch is one kernel node.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cuda.launch import NUM_PROGRAMS, NUM_WARPS, TILE_BYTES, alignment, direct_launcher, interpreting, launch_compiled


@triton.jit(do_not_specialize=["rows", "k_row_bytes", "v_row_bytes", "k_pos_bytes", "v_pos_bytes"])
def _prefix_copy_kernel(
    slot_k_ptr,  # the slot's keys, [rows, max_cache_len * dim] (any dtype: addressed in bytes)
    slot_v_ptr,  # the slot's values
    host_k_ptr,  # the target layer's host keys (device address of page-locked memory)
    host_v_ptr,  # the target layer's host values
    length_ptr,  # int64 [1]: positions the target layer holds (its cumulative_length)
    start_ptr,  # int64 [1]: the first of them to load (the copy engine brings those below)
    out_k_ptr,  # the evicted layer's host keys
    out_v_ptr,  # the evicted layer's host values
    out_length_ptr,  # int64 [1]: positions the evicted layer holds, those in the slot included
    out_saved_ptr,  # int64 [1]: the evicted layer's positions already on its host copy
    saved_ptr,  # int64 [1]: the target's, set here to its length (all of it is on the host now)
    go_ptr,  # int64 [1]: 0 skips the launch, the slot holding the target already (_claim_kernel)
    rows,  # batch x heads
    k_row_bytes,  # bytes from one row's first position to the next row's (max_cache_len x dim x size)
    v_row_bytes,
    k_pos_bytes,  # bytes of one position (dim x element size)
    v_pos_bytes,
    TILE: tl.constexpr,  # bytes a program moves per tile
    ALIGN: tl.constexpr,  # power of two (<= 16) dividing every address and byte count: lets accesses vectorize
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    go = tl.load(go_ptr) != 0
    length = tl.load(length_ptr)
    load_from = tl.minimum(tl.load(start_ptr), length)
    out_hi = tl.load(out_length_ptr)
    # A crop (cumulative_length.sub_) can leave fewer positions than were saved: none to write.
    out_lo = tl.minimum(tl.load(out_saved_ptr), out_hi)
    top = tl.where(go, tl.maximum(length, out_hi), 0)  # the furthest position either part touches
    lanes = tl.arange(0, TILE).to(tl.int64)
    first = tl.full([], 0, tl.int64)  # global index of this tensor's first tile
    for t in tl.static_range(2):  # keys, then values
        if t == 0:
            slot, host, out, row_bytes, pos_bytes = slot_k_ptr, host_k_ptr, out_k_ptr, k_row_bytes, k_pos_bytes
        else:
            slot, host, out, row_bytes, pos_bytes = slot_v_ptr, host_v_ptr, out_v_ptr, v_row_bytes, v_pos_bytes
        slot = slot.to(tl.pointer_type(tl.uint8))
        host = host.to(tl.pointer_type(tl.uint8))
        out = out.to(tl.pointer_type(tl.uint8))
        load_start = tl.multiple_of(load_from * pos_bytes, ALIGN)
        load_end = tl.multiple_of(length * pos_bytes, ALIGN)
        out_start = tl.multiple_of(out_lo * pos_bytes, ALIGN)
        out_end = tl.multiple_of(out_hi * pos_bytes, ALIGN)
        per_row = (top * pos_bytes + TILE - 1) // TILE
        tiles = rows * per_row
        # Tiles are dealt round-robin across both tensors, so the values start on the program
        # after the one that took the keys' last tile.
        start = ((pid - first) % nprog + nprog) % nprog
        for i in range(start, tiles, nprog):
            row = i // per_row
            col = (i - row * per_row) * TILE
            offsets = tl.multiple_of(row * row_bytes + col, ALIGN) + lanes
            _move_tile(slot, host, out, offsets, col + lanes, col, out_start, out_end, load_start, load_end, TILE)
        first += tiles
    if go & (pid == 0):
        # No program reads the target's saved count (the target is never the evicted layer).
        tl.store(saved_ptr, length)


@triton.jit
def _move_tile(slot, host, out, offsets, within, col, out_start, out_end, load_start, load_end, TILE: tl.constexpr):
    """One tile of a row (bytes ``within`` of it, at ``offsets``): the evicted layer's new bytes
    out of the slot, then the target's into it."""
    if (col < out_end) & (col + TILE > out_start):
        mask = (within >= out_start) & (within < out_end)
        tl.store(out + offsets, tl.load(slot + offsets, mask=mask), mask=mask)
        # Every thread's read of the slot above comes before any thread's write below: the same
        # bytes may be both a new position of the evicted layer and a position of the target.
        tl.debug_barrier()
    if (col < load_end) & (col + TILE > load_start):
        mask = (within >= load_start) & (within < load_end)
        tl.store(slot + offsets, tl.load(host + offsets, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["target"])
def _claim_kernel(
    holder_ptr,  # int64 [1]: the layer whose keys the slot holds (-1: none yet)
    go_ptr,  # int64 [1]: set to whether the load that follows must move its bytes
    target,  # the layer the load brings in
):
    # One program, before the copy on the same stream: the copy's programs all read go, which
    # none of them could both read and write without a grid-wide barrier.
    tl.store(go_ptr, (tl.load(holder_ptr) != target).to(tl.int64))
    tl.store(holder_ptr, target.to(tl.int64))


class _Kernel:
    """One ``@jit`` kernel's launch on a raw stream: through ``@jit`` the first time (which
    compiles), then through the compiled kernel's own launcher
    (:func:`kv_ops.cuda.launch.launch_compiled`), whose host time is a fraction of ``@jit``'s."""

    def __init__(self, kernel, programs: int, warps: int, device: torch.device):
        self.kernel, self.programs, self.warps, self.device = kernel, programs, warps, device
        self.compiled = None

    def __call__(self, stream: int, args: tuple, constexprs: dict) -> None:
        # The compiled kernel's launcher takes the constexprs too, in the signature's order.
        if self.compiled is not None and launch_compiled(
            self.compiled, self.device, self.programs, stream, (*args, *constexprs.values())
        ):
            return
        if self.device.type == "cpu" and not interpreting():
            raise RuntimeError("kv_ops.prefix_copy runs on CPU tensors only under TRITON_INTERPRET=1")
        launch = self.kernel[(self.programs,)]
        if self.device.type == "cuda":
            with torch.cuda.device(self.device), torch.cuda.stream(torch.cuda.ExternalStream(stream)):
                handle = launch(*args, **constexprs, num_warps=self.warps)
        else:
            handle = launch(*args, **constexprs, num_warps=self.warps)
        self.compiled = handle if direct_launcher(handle) else None


class PrefixCopy:
    """One slot's load of one target layer, with the write-back of the layer it evicts, bound once.

    Every tensor is fixed at binding; a call launches on a raw stream handle. ``slot``, ``host``
    (the target's) and ``out`` (the evicted layer's host copy) are (keys, values) pairs of one
    shape ``[batch, heads, max_cache_len, dim]``, contiguous; the lengths and saved counts are
    int64 scalars on the kernel's device. CPU tensors run under ``TRITON_INTERPRET=1`` only.

    ``start``, where given, is an int64 scalar on the device: the first target position to load
    (those below are left to the caller). Without it every load starts at 0.

    ``claim``, where given, is ``(holder, go, target)``: the slot's holder word and this load's
    go word (int64 scalars on the device, kept as long as the launch may run) and the target's
    number. Each call then launches the claim first, and moves nothing where the slot already
    holds ``target``. Without it every call moves its bytes.
    """

    def __init__(
        self, slot, host, length, out, out_length, out_saved: torch.Tensor, saved: torch.Tensor, claim=None, start=None
    ):
        (slot_k, slot_v), (host_k, host_v), (out_k, out_v) = slot, host, out
        rows = slot_k.shape[0] * slot_k.shape[1]
        self.device = slot_k.device
        go = torch.ones((), dtype=torch.int64, device=self.device) if claim is None else claim[1]
        if start is None:
            start = torch.zeros((), dtype=torch.int64, device=self.device)
        self.args = (
            slot_k,
            slot_v,
            host_k,
            host_v,
            length,
            start,
            out_k,
            out_v,
            out_length,
            out_saved,
            saved,
            go,
            rows,
            slot_k.stride(1) * slot_k.element_size(),
            slot_v.stride(1) * slot_v.element_size(),
            slot_k.shape[-1] * slot_k.element_size(),
            slot_v.shape[-1] * slot_v.element_size(),
        )
        # The byte-addressed tensors and byte counts (the counts' scalars are read whole).
        byte_tensors = (slot_k, slot_v, host_k, host_v, out_k, out_v)
        self.constexprs = {
            "TILE": TILE_BYTES,
            "ALIGN": alignment([t.data_ptr() for t in byte_tensors] + list(self.args[13:])),
        }
        self.copy = _Kernel(_prefix_copy_kernel, NUM_PROGRAMS, NUM_WARPS, self.device)
        # (launcher, arguments) of the claim, or None: every call then moves its bytes.
        self.claim = None if claim is None else (_Kernel(_claim_kernel, 1, 1, self.device), (*claim[:2], int(claim[2])))

    def __call__(self, stream: int, tensors: tuple | None = None) -> None:
        """Launch on the raw ``stream`` handle (the current stream's under the interpreter).

        ``tensors`` replaces the bound slot keys, slot values, length and evicted length for this
        launch: a compiled graph hands over the buffers that hold those values at that point."""
        args = (
            self.args
            if tensors is None
            else (*tensors[:2], *self.args[2:4], tensors[2], *self.args[5:8], tensors[3], *self.args[9:])
        )
        if self.claim is not None:
            launch, claim_args = self.claim
            launch(stream, claim_args, {})
        self.copy(stream, args, self.constexprs)


__all__ = ["PrefixCopy"]
