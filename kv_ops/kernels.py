"""The Triton kernel that copies blocks between byte regions, and its launcher; ple_ops sizes its kernels by its tiles.

One kernel serves all three ops. Each side of a copy is either a list of regions (a block is
row ``id`` of region ``r``) or a packed buffer (row ``i`` holds pair ``i``'s blocks of every
region side by side, at column ``col[r]``):

* ``copy_blocks``:    regions -> regions
* ``gather_blocks``:  regions -> packed
* ``scatter_blocks``: packed  -> regions

Any side may be GPU memory or page-locked host memory: the kernel reads and writes host memory
through its device address (zero-copy over PCIe), so there is no staging copy and the launch is
a plain kernel node that CUDA graphs capture.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .cuda import driver, host_memory
from .cuda.capture import captured_into
from .cuda.launch import NUM_PROGRAMS, NUM_WARPS, TILE_BYTES, alignment, direct_launcher, interpreting, launch_compiled
from .region_tables import address, geometry_table

# Ids checked per step in the kernel's counting phase.
CHECK_LANES = 1024


@triton.jit(do_not_specialize=["num_regions", "num_pairs", "src_limit", "dst_limit", "packed_stride"])
def _block_copy_kernel(
    table_ptr,  # int64 [6, num_regions], per region r: src offset, dst offset (bytes from anchor_ptr),
    #             src block stride, dst block stride, block bytes, column in the packed buffer
    anchor_ptr,  # uint8*: the table's own first byte; region addresses are offsets from it, so they
    #              carry the table pointer's alignment, which Triton knows, into the address math
    packed_ptr,  # uint8*: the packed buffer of gather (dst) or scatter (src); unused by copy
    packed_stride,  # bytes between rows of the packed buffer
    num_regions,
    src_ids_ptr,  # int32/int64 [num_pairs]: source block of pair i (unused when SRC_PACKED); with
    #               IDS_IN_BLOCK, the id block instead (see there)
    dst_ids_ptr,  # int32/int64 [num_pairs]: destination block of pair i (unused when DST_PACKED or IDS_IN_BLOCK)
    num_pairs,  # pairs to copy (unused with IDS_IN_BLOCK)
    src_limit,  # a source id is valid in [0, src_limit)
    dst_limit,  # a destination id is valid in [0, dst_limit)
    error_ptr,  # int64 [1]: incremented by the number of invalid (skipped) pairs
    COLS: tl.constexpr,  # bytes of a block that one tile row covers (a block is ceil(bytes / COLS) rows)
    ROWS: tl.constexpr,  # tile rows; ROWS * COLS bytes move per program per iteration
    ALIGN: tl.constexpr,  # power of two (<= 16) dividing every address, stride and width: lets loads vectorize
    SRC_PACKED: tl.constexpr,
    DST_PACKED: tl.constexpr,
    LANES: tl.constexpr,  # ids examined per step of the counting phase
    IDS_IN_BLOCK: tl.constexpr,  # src_ids_ptr is an int64 id block [n, src ids (n), dst ids (n)],
    #                              without the ids of a packed side: what a CUDA-graph replay reads
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n, src_ids_ptr, dst_ids_ptr = _pair_count(src_ids_ptr, dst_ids_ptr, num_pairs, SRC_PACKED, IDS_IN_BLOCK)
    # Count invalid pairs once per launch (they are skipped in every region below).
    if not (SRC_PACKED and DST_PACKED):
        _count_invalid(
            src_ids_ptr, dst_ids_ptr, n, src_limit, dst_limit, error_ptr, pid, nprog, SRC_PACKED, DST_PACKED, LANES
        )

    lanes = tl.arange(0, COLS).to(tl.int64)
    first = tl.full([], 0, tl.int64)  # global index of region r's first tile
    for r in range(num_regions):
        src_off, dst_off, src_stride, dst_stride, column = _region(table_ptr, num_regions, r)
        # The hint goes on the load itself: Triton 3.6 drops it from a value a helper returns.
        width = tl.multiple_of(tl.load(table_ptr + 4 * num_regions + r), ALIGN)
        chunks = (width + COLS - 1) // COLS  # tile rows per block
        items = n * chunks
        tiles = (items + ROWS - 1) // ROWS
        # Tiles are dealt round-robin over programs across region boundaries: the program after
        # the one that took region r's last tile takes region r + 1's first, so many small
        # regions still keep every program busy.
        start = ((pid - first) % nprog + nprog) % nprog
        for t in range(start, tiles, nprog):
            item = t * ROWS + tl.arange(0, ROWS).to(tl.int64)
            live = item < items
            pair = item // chunks
            col = (item - pair * chunks) * COLS  # first byte of this row within the block
            sid, did, ok = _tile_ids(src_ids_ptr, dst_ids_ptr, pair, live, src_limit, dst_limit, SRC_PACKED, DST_PACKED)
            src_base = packed_ptr if SRC_PACKED else anchor_ptr
            dst_base = packed_ptr if DST_PACKED else anchor_ptr
            src_row = _side_row(sid, src_off, src_stride, packed_stride, column, col, ALIGN, SRC_PACKED)
            dst_row = _side_row(did, dst_off, dst_stride, packed_stride, column, col, ALIGN, DST_PACKED)
            mask = ok[:, None] & ((col[:, None] + lanes[None, :]) < width)
            values = tl.load(src_base + (src_row[:, None] + lanes[None, :]), mask=mask)
            tl.store(dst_base + (dst_row[:, None] + lanes[None, :]), values, mask=mask)
        first += tiles


@triton.jit
def _region(table_ptr, num_regions, r):
    """Region r's row of the table but its block bytes: src and dst offsets, src and dst block
    strides, and column in the packed buffer."""
    return (
        tl.load(table_ptr + r),
        tl.load(table_ptr + num_regions + r),
        tl.load(table_ptr + 2 * num_regions + r),
        tl.load(table_ptr + 3 * num_regions + r),
        tl.load(table_ptr + 5 * num_regions + r),
    )


@triton.jit
def _pair_count(src_ids_ptr, dst_ids_ptr, num_pairs, SRC_PACKED: tl.constexpr, IDS_IN_BLOCK: tl.constexpr):
    """The pair count and where each side's ids begin: the arguments, or with ``IDS_IN_BLOCK``
    read from the id block at ``src_ids_ptr``."""
    if IDS_IN_BLOCK:
        # The count is data, not an argument: one captured graph serves every call size, and
        # programs beyond the work simply find no tile.
        block = src_ids_ptr
        n = tl.load(block).to(tl.int64)
        src_ids_ptr = block + 1
        if SRC_PACKED:
            dst_ids_ptr = block + 1
        else:
            dst_ids_ptr = block + 1 + n
    else:
        n = num_pairs.to(tl.int64)
    return n, src_ids_ptr, dst_ids_ptr


@triton.jit
def _count_invalid(
    src_ids_ptr,
    dst_ids_ptr,
    n,
    src_limit,
    dst_limit,
    error_ptr,
    pid,
    nprog,
    SRC_PACKED: tl.constexpr,
    DST_PACKED: tl.constexpr,
    LANES: tl.constexpr,
):
    """Add to ``error_ptr`` the pairs with an id outside its side's limit, ``LANES`` ids per step
    (the programs share the pairs round-robin, so each is counted once)."""
    for start in range(pid * LANES, n, nprog * LANES):
        i = start + tl.arange(0, LANES).to(tl.int64)
        live = i < n
        bad = tl.zeros([LANES], dtype=tl.int1)
        if not SRC_PACKED:
            s = tl.load(src_ids_ptr + i, mask=live, other=0).to(tl.int64)
            bad = bad | (s < 0) | (s >= src_limit)
        if not DST_PACKED:
            d = tl.load(dst_ids_ptr + i, mask=live, other=0).to(tl.int64)
            bad = bad | (d < 0) | (d >= dst_limit)
        count = tl.sum((bad & live).to(tl.int64), axis=0)
        if count > 0:
            tl.atomic_add(error_ptr, count)


@triton.jit
def _tile_ids(
    src_ids_ptr, dst_ids_ptr, pair, live, src_limit, dst_limit, SRC_PACKED: tl.constexpr, DST_PACKED: tl.constexpr
):
    """Each tile row's source and destination block, and whether the row moves: a live row of a
    pair whose ids are both valid. A packed side's block is the pair itself (its packed row)."""
    if SRC_PACKED:
        sid = pair
    else:
        sid = tl.load(src_ids_ptr + pair, mask=live, other=0).to(tl.int64)
    if DST_PACKED:
        did = pair
    else:
        did = tl.load(dst_ids_ptr + pair, mask=live, other=0).to(tl.int64)
    ok = live & (sid >= 0) & (sid < src_limit) & (did >= 0) & (did < dst_limit)
    return sid, did, ok


@triton.jit
def _side_row(block, offset, stride, packed_stride, column, col, ALIGN: tl.constexpr, PACKED: tl.constexpr):
    """Each tile row's first byte on one side, as an offset from that side's base pointer: in
    the packed buffer, row ``block`` at the region's ``column``; in a region (from the anchor),
    block ``block``. A multiple of ``ALIGN``."""
    if PACKED:
        row = block * packed_stride + column + col
    else:
        row = offset + block * stride + col
    # Said here, on the op that makes the row: a hint given to a helper's returned value (a call
    # result) is dropped, and the copy would not vectorise.
    return tl.multiple_of(row, ALIGN)


class BoundCopy:
    """One side-to-side copy with everything but the ids and the packed rows fixed.

    Binding builds (or finds) the region table and works out the tile shape once; each call then
    only sizes the grid and launches, after its first call of each specialisation through the
    compiled kernel's own launcher (:meth:`launch_kernel`). The ops and the engine's paths bind
    their copies once and launch one per call, where rebuilding this per call cost more host
    time than the launch itself.

    ``src`` and ``dst`` are each a list of uint8 regions ``[num_blocks, block_bytes]`` or ``None``
    for the packed side (rows of every region's block side by side). Not both packed.
    """

    def __init__(
        self,
        device: torch.device,
        src: Sequence[torch.Tensor] | None,
        dst: Sequence[torch.Tensor] | None,
        *,
        num_programs: int = NUM_PROGRAMS,
        tile_bytes: int = TILE_BYTES,
        num_warps: int = NUM_WARPS,
    ):
        if device.type == "cpu" and not interpreting():
            raise RuntimeError("kv_ops.kernels.block_copy runs on CPU tensors only under TRITON_INTERPRET=1")
        self.device = device
        self.src_packed, self.dst_packed = src is None, dst is None
        regions = dst if self.src_packed else src
        self.widths = [r.shape[1] for r in regions]
        self.table, self.align = geometry_table(device, src, dst, self.widths)
        self.anchor = self.table.view(torch.uint8)
        self.src_limit = None if self.src_packed else min(r.shape[0] for r in src)
        self.dst_limit = None if self.dst_packed else min(r.shape[0] for r in dst)
        self.cols = min(tile_bytes, triton.next_power_of_2(max(1, min(self.widths))))
        self.rows = max(1, tile_bytes // self.cols)
        self.chunks = [-(-w // self.cols) for w in self.widths]  # tile rows per block, per region
        self.num_programs, self.num_warps = num_programs, num_warps
        # From this many pairs on the copy has a tile for every program: the tiles grow with the
        # pairs, and num_programs x rows pairs make at least num_programs tiles.
        low, high = 1, num_programs * self.rows
        while low < high:
            mid = (low + high) // 2
            low, high = (low, mid) if self._programs(mid) == num_programs else (mid + 1, high)
        self.full_from = low
        self._compiled: dict[tuple, object] = {}  # specialisation -> compiled kernel (launch_kernel)

    def __call__(
        self,
        packed: torch.Tensor | None,
        src_ids: torch.Tensor | None,
        dst_ids: torch.Tensor | None,
        num_pairs: int,
        errors: torch.Tensor,
        stream: torch.cuda.Stream | None = None,
    ):
        """Launch on ``stream`` (default: the current stream); returns the compiled kernel, or
        None when nothing was launched (or under the interpreter)."""
        if num_pairs == 0:
            return None
        programs = self.num_programs if num_pairs >= self.full_from else self._programs(num_pairs)
        return self.launch_kernel(packed, src_ids, dst_ids, num_pairs, errors, programs, False, stream)

    def _programs(self, num_pairs: int) -> int:
        """Programs worth launching: no more than the copy has tiles."""
        tiles = sum(-(-num_pairs * c // self.rows) for c in self.chunks)
        return min(self.num_programs, tiles)

    def launch_from_block(self, packed: torch.Tensor | None, block: torch.Tensor, capacity: int, errors: torch.Tensor):
        """Launch on the current stream with the count and ids read from ``block`` (int64
        ``[n, src ids, dst ids]``, ``n <= capacity``), on every program: what :class:`GraphedCopy`
        captures."""
        return self.launch_kernel(packed, block, block, capacity, errors, self.num_programs, True)

    def launch_kernel(
        self,
        packed,
        src_ids,
        dst_ids,
        num_pairs: int,
        errors,
        programs: int,
        in_block: bool,
        stream: torch.cuda.Stream | None = None,
    ):
        """The one kernel launch under :meth:`__call__` and :meth:`launch_from_block`; public so
        that tests count launches.

        The first launch of each specialisation goes through Triton's ``@jit`` launcher, which
        binds the arguments, works out the specialisation, compiles or finds the kernel, and
        launches it. Later launches of the same specialisation call the compiled kernel's own
        launcher directly (what ``@jit`` calls last), skipping the binder, which cost more host
        time than the launch. The key (:func:`specialisation`) holds everything ``@jit``
        specialises these arguments on.
        """
        align, packed_stride = self.align, 0
        if packed is None:
            packed = self.anchor  # a copy never reads it
        else:
            packed_stride = packed.stride(0)
            align = min(align, alignment([address(packed, self.device), packed_stride]))
        # The kernel reads pair i's ids at ids + i: a strided view (a caller's ids[::2]) is made
        # contiguous first, on the current stream (the ops launch there, and a capture records
        # the copy too; the engine hands over contiguous ids).
        src_ids = self.table if src_ids is None else src_ids if src_ids.is_contiguous() else src_ids.contiguous()
        dst_ids = self.table if dst_ids is None else dst_ids if dst_ids.is_contiguous() else dst_ids.contiguous()
        src_limit = num_pairs if self.src_packed else self.src_limit
        dst_limit = num_pairs if self.dst_packed else self.dst_limit
        # In _block_copy_kernel's order.
        args = (
            self.table, self.anchor, packed, packed_stride, len(self.widths), src_ids, dst_ids, num_pairs,
            src_limit, dst_limit, errors, self.cols, self.rows, align, self.src_packed, self.dst_packed,
            CHECK_LANES, in_block,
        )  # fmt: skip
        key = specialisation(
            align, in_block, src_ids, dst_ids, packed, (packed_stride, num_pairs, src_limit, dst_limit)
        )
        compiled = self._compiled.get(key)
        if compiled is not None:
            handle = stream.cuda_stream if stream is not None else driver.current_stream_handle(self.device.index)
            if launch_compiled(compiled, self.device, programs, handle, args):
                return compiled
        on_device = self.device.type == "cuda" and torch.cuda.current_device() != self.device.index
        with (
            torch.cuda.device(self.device) if on_device else contextlib.nullcontext(),
            torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(),
        ):
            handle = _block_copy_kernel[(max(1, programs),)](*args, num_warps=self.num_warps)
        if direct_launcher(handle):
            self._compiled[key] = handle
        return handle


# Triton passes an integer argument as i32 below this, as i64 from it: another specialisation.
_INT32_END = 1 << 31


def specialisation(align: int, in_block: bool, src_ids, dst_ids, packed, ints: Sequence[int]) -> tuple:
    """What ``@jit`` compiles the block copy for, of what varies per launch: the per-call
    constexprs, the ids' dtypes, every varying pointer's 16-byte alignment (Triton assumes it of
    a pointer it saw aligned), and which of the integers (all unspecialised) fit in 32 bits
    (Triton passes each as i32 or i64). Launches with equal keys run the same compiled kernel.
    Public so that tests check it."""
    return (
        align,
        in_block,
        src_ids.dtype,
        src_ids.data_ptr() % 16 == 0,
        dst_ids.dtype,
        dst_ids.data_ptr() % 16 == 0,
        packed.data_ptr() % 16 == 0,
        tuple(value < _INT32_END for value in ints),
    )


class GraphedCopy:
    """A :class:`BoundCopy` captured once into a CUDA graph that reads its ids from a block of its own.

    The block (``self.block``, int64 on the device) holds the pair count, the source ids and the
    destination ids, back to back (``[n, src (n), dst (n)]``; a packed side has no ids), at most
    ``capacity`` pairs. ``packed`` (for a gather or scatter) is the packed buffer the graph reads
    or writes, fixed at capture. CUDA only. Two ways to fill the block:

    * ``from_host=True``: the graph itself first copies the block in from a page-locked twin,
      ``self.words`` (a numpy view). A call writes the ids there and replays: one driver call
      (``cuGraphLaunch``). The twin may be rewritten only once that replay has run (the caller
      pools graphs and checks an event after the replay).
    * otherwise, the caller copies the count and the ids into ``self.block`` (at
      ``self.address``) on the stream it then replays on, so the block is rewritten only after
      the replay before it has read it.

    No Triton binder, no stream context and no allocation per call either way.
    """

    def __init__(
        self,
        bound: BoundCopy,
        capacity: int,
        errors: torch.Tensor,
        packed: torch.Tensor | None = None,
        from_host: bool = False,
    ):
        device = bound.device
        self.capacity = capacity
        self.sides = (not bound.src_packed) + (not bound.dst_packed)
        words = 1 + self.sides * capacity
        # Outside any graph pool (lasting_copy), zero: the warm-up below copies nothing.
        self.block = host_memory.lasting_copy(torch.zeros(words, dtype=torch.int64), device)
        self.address = self.block.data_ptr()
        self.words = None
        if from_host:
            twin = host_memory.pinned_empty(words, dtype=torch.int64)
            twin.zero_()
            self.twin, self.words = twin, twin.numpy()
        self.packed = packed  # the graph holds its address: keep it alive
        stream = torch.cuda.Stream(device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(device), torch.cuda.stream(stream):
            bound.launch_from_block(packed, self.block, capacity, errors)  # compiles outside the capture
            stream.synchronize()
            with captured_into(self.graph):
                if from_host:
                    self.block.copy_(self.twin, non_blocking=True)  # a memcpy node: the ids come in
                bound.launch_from_block(packed, self.block, capacity, errors)
        self._exec = self.graph.raw_cuda_graph_exec()

    def replay(self, stream: int) -> None:
        """Launch the graph on ``stream`` (a raw handle), after whatever wrote the block there."""
        driver.graph_launch(self._exec, stream)


def block_copy(
    src: Sequence[torch.Tensor] | torch.Tensor,
    dst: Sequence[torch.Tensor] | torch.Tensor,
    src_ids: torch.Tensor | None,
    dst_ids: torch.Tensor | None,
    num_pairs: int,
    errors: torch.Tensor,
    *,
    num_programs: int = NUM_PROGRAMS,
    tile_bytes: int = TILE_BYTES,
    num_warps: int = NUM_WARPS,
):
    """Launch the block-copy kernel on the current stream. Arguments are trusted (validated by the op).

    ``src`` and ``dst`` are each a list of uint8 regions ``[num_blocks, block_bytes]`` or one packed
    uint8 buffer ``[num_pairs, sum(block_bytes)]`` (then its ids are ``None``: pair i is row i).
    The kernel runs on ``errors.device``; host-memory sides must be page-locked. Returns Triton's
    handle of the launched kernel (its ``asm`` holds the PTX), or None when nothing was launched.
    """
    if num_pairs == 0:
        return None
    src_packed, dst_packed = isinstance(src, torch.Tensor), isinstance(dst, torch.Tensor)
    bound = BoundCopy(
        errors.device,
        None if src_packed else src,
        None if dst_packed else dst,
        num_programs=num_programs,
        tile_bytes=tile_bytes,
        num_warps=num_warps,
    )
    packed = src if src_packed else dst if dst_packed else None
    return bound(packed, src_ids, dst_ids, num_pairs, errors)


__all__ = [
    "block_copy",
    "BoundCopy",
    "GraphedCopy",
]
