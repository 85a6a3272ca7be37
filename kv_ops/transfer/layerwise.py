"""LayerwiseLoads: host-to-GPU block loads, issued before the step, that a compiled, captured step waits for layer by layer.

Layer i computes while layer i+1 loads; each layer waits through ``torch.ops.kv_ops.wait_layer``
(:mod:`kv_ops.transfer.in_step`, which owns the op and the names).

:meth:`LayerwiseLoads.start` issues every layer's copies on the engine's load stream, by
``copies=``: the zero-copy kernel as one CUDA graph per start (the default), one copy-engine
descriptor per block and region (``"dma"``), or the copy engines into a GPU ring and a short
scatter kernel per layer (``"staged"``, :mod:`kv_ops.transfer.layerwise_ring`), or one of the
kernel and staged per start by the host ids' shape (``"auto"``, :func:`pick_copies`). After a layer's
copies the start's generation is written to that layer's flag word on the GPU, and last the
generation the step waits for (``wanted``) on the caller's current stream. ``wait_layer`` holds
the step's stream until its layer's flag reaches ``wanted``: captured, a one-program kernel that
reads ``wanted`` at each replay; eagerly, one ``cuStreamWaitValue32``. It takes the layer's input
and declares the layer's caches mutated, so the compiler keeps it after the previous layer and
before any reader of the cache. docs/design.md gives the reasons for each choice.

Contracts. A start's copies are ordered after ``after=`` (by default the caller's current
stream), as ``OffloadEngine.load``'s are; run the step on the stream current at the start (or
one ordered after it). A step with no start since the last one reads the last start's blocks
and never hangs; a start that fails halfway is never waited for (``wanted`` is written last). A
captured wait that has not seen its layer land after :data:`WAIT_TIMEOUT_S` returns and counts
one error (:func:`kv_ops.error_count`), a backstop no start reaches. On a CPU engine ``start``
copies at once and ``wait_layer`` only counts (:attr:`LayerwiseLoads.waits`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .. import kernels
from ..cuda import capture
from ..cuda.arguments import positive_int
from ..cuda.driver import (
    current_stream_handle,
    driver_context,
    graph_launch,
    wait_event,
    wait_value_reached,
    write_value,
)
from ..cuda.host_memory import lasting_copy, pinned_empty
from ..layer_wait import wait_landed
from ..validation import error_counter
from . import dma, in_step, layerwise_ring
from .blocks import Blocks, Direction, EventPath
from .engine import check_engine
from .ids import Pool
from .in_step import wait_layer

COPIES = ("auto", "dma", "kernel", "staged")

# copies="auto": the staged copies for a start of at least this many blocks whose staged plan
# costs the host at most STAGED_HOST_BUDGET_US, else the kernel. Staged wins where the host ids
# come in runs (a few 2-D copies per layer); with scattered ids its start issues one descriptor
# per (block, layer), host time the step waits for, and below the threshold the kernel wins
# either way. The plan's host cost is estimated per piece of a layer (regions side by side in a
# mirror row are one piece), per descriptor and per 2-D copy of a run. The figures behind each
# constant: docs/measurements.md, "copies="auto"".
STAGED_MIN_BLOCKS = 256
STAGED_HOST_BUDGET_US = 2000.0
_US_PER_DESCRIPTOR = 1.0
_US_PER_2D_COPY = 4.0

# How long a captured wait spins before it gives up and counts an error (kv_ops.error_count). A
# backstop only: every start that returns has published every layer, so a wait ends once the
# copies ahead of it on the load stream have run; read when an instance is made.
WAIT_TIMEOUT_S = 10.0


def _layer_groups(engine, layers) -> list[list[str]]:
    """Region names per layer: given, or one layer per cache tensor of the engine."""
    regions = engine.regions
    if layers is None:
        layers = []
        for key in engine.cache_names:
            # infer_regions names a layer's regions after its tensor: "key" or "key.0"/"key.1".
            names = [r for r in regions if r == key or r in (f"{key}.0", f"{key}.1")]
            if not names:
                raise ValueError(
                    f"LayerwiseLoads: cache {key!r} has no region of its own (its blocks share a "
                    "cross-layer region with another layer's); layer-wise loads need each layer's "
                    "blocks apart: pass layers= explicitly or give each layer its own tensor"
                )
            layers.append(names)
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or len(layers) == 0:
        raise ValueError(f"LayerwiseLoads: layers must be a non-empty sequence of region-name lists, got {layers!r}")
    groups, seen = [], set()
    for i, names in enumerate(layers):
        if isinstance(names, str) or not isinstance(names, Sequence) or len(names) == 0:
            raise ValueError(f"LayerwiseLoads: layers[{i}] must be a non-empty list of region names, got {names!r}")
        for n in names:
            if n not in regions:
                raise ValueError(f"LayerwiseLoads: layers[{i}] names {n!r}, not a region (regions: {list(regions)})")
            if n in seen:
                raise ValueError(f"LayerwiseLoads: region {n!r} is in two layers")
            seen.add(n)
        groups.append(list(names))
    missing = [n for n in regions if n not in seen]
    if missing:
        # A loaded block must be whole: every region of it moves, in some layer.
        raise ValueError(f"LayerwiseLoads: regions {missing} are in no layer; every region must be loaded")
    return groups


def pick_copies(host_ids, pieces: int) -> str:
    """What ``copies="auto"`` moves a start of ``host_ids`` with: ``"staged"`` or ``"kernel"``.

    ``pieces`` is the staged plan's pieces summed over the layers (a layer's regions that sit
    side by side in a mirror row are one piece). Staged for a start of at least
    :data:`STAGED_MIN_BLOCKS` blocks whose plan's host time, estimated from its runs of
    consecutive host ids (a run of :data:`~kv_ops.transfer.layerwise_ring.RUN_2D` or more is one
    2-D copy per piece, any other block one descriptor per piece), is within
    :data:`STAGED_HOST_BUDGET_US`; the kernel otherwise. Pure: five numpy operations on the ids
    (any 1-D integer sequence; the engine passes its checked int64 array).
    """
    host_ids = np.asarray(host_ids, dtype=np.int64)  # no copy of the engine's checked int64 ids
    n = host_ids.size
    if n < STAGED_MIN_BLOCKS:
        return "kernel"
    ends = np.flatnonzero(np.diff(host_ids) != 1)  # where a run ends, but for the last one
    lengths = np.diff(ends, prepend=-1, append=n - 1)
    long = lengths >= layerwise_ring.RUN_2D
    in_runs = int(lengths[long].sum())
    host_us = pieces * (_US_PER_2D_COPY * int(np.count_nonzero(long)) + _US_PER_DESCRIPTOR * (n - in_runs))
    return "staged" if host_us <= STAGED_HOST_BUDGET_US else "kernel"


class _LayerPath(EventPath):
    """The engine path of a layer-wise load by one mechanism: per layer, its copies and their
    publication. With ``copies="auto"`` there is one per mechanism, so that the engine orders a
    start after the previous one whenever the mechanism changes: the staged scatters publish on
    a stream of their own, and a kernel start's flag writes must not overtake them (a flag that
    went back to an older generation would hold its wait until the timeout)."""

    name = "layerwise"
    host_planned = frozenset({"gpu_ids", "host_ids"})  # every mechanism reads host arrays

    def __init__(self, loads: LayerwiseLoads, copies: str):
        self.loads, self.copies = loads, copies
        self._events = {Direction.LOAD: loads.engine.load_events}  # where its completion events come from, and go back

    @property
    def copy_engines(self) -> bool:
        return self.copies != "kernel"

    def enqueue(self, blocks: Blocks, ready: torch.cuda.Event | None) -> torch.cuda.Event | None:
        return self.loads.enqueue(blocks.host_ids, blocks.gpu_ids, ready, self.copies)


class LayerwiseLoads:
    """Loads host blocks into GPU blocks layer by layer, for a compiled and captured step.

    Each step: :meth:`start` with this step's pairs, then run the step (eagerly, compiled, or a
    CUDA-graph replay) in which every layer calls :func:`kv_ops.wait_layer` before it reads its
    cache. Layer ``i``'s wait ends once layer ``i``'s blocks have landed, while later layers'
    blocks are still on the way.

    Parameters
    ----------
    engine : OffloadEngine
        A host-memory engine (not the disk tier): the blocks come from its mirror, on its load
        stream, ordered with its other loads, and each start is one of its transfers (reported
        by ``engine.poll().loads``; counted in ``engine.path_counts["layerwise"]``).
    name : str
        What the ops carry; unique among the live instances of this process. A step compiled
        (or AOT-saved) against a name runs against whichever instance has it when it runs; a
        captured graph waits on the flags of the instance that had it at the capture, so
        capture again after replacing the instance.
    layers : sequence of sequence of str, optional
        The engine's region names of each layer, in the order the model visits them. By
        default one layer per cache tensor given to the engine (its one region, or its K and
        V regions).
    copies : {"kernel", "staged", "dma", "auto"}
        What moves the bytes on a GPU engine: the zero-copy kernel (``"kernel"``, the default:
        one graph launch per start, at most 8 SMs while it runs); the copy engines into a GPU
        ring, then a short scatter kernel per layer (``"staged"``: a 2-D copy per layer for a
        run of consecutive host ids, otherwise a descriptor per block and layer); or the copy
        engines straight into the cache (a descriptor per block and region, issued by
        ``start``: about 0.5-1 us of host time each). ``benchmarks/layerwise.py`` measures all
        three. ``"staged"`` hides more of a large load (hundreds of blocks) whose host ids are in
        runs, as a sequence stored in one piece, than the kernel; ``"auto"`` picks between the
        two per start by :func:`pick_copies`, from the host ids' runs (it builds both).
    ring_bytes : int
        With ``copies="staged"`` or ``"auto"``: GPU memory of the ring (128 MiB by default; no larger than
        :data:`~kv_ops.transfer.layerwise_ring.SLOTS` slots of one layer's pieces of
        ``num_blocks`` blocks). A layer whose pieces of a start do not fit in one slot moves in
        chunks.

    Attributes
    ----------
    num_layers : int
    waits : numpy.ndarray
        How many times each layer's wait ran on the host: eager calls and captures (a replay
        runs none). What the CPU path has to show for a wait, and a check that a compiled step
        kept every wait.
    starts : dict of str to int
        Starts that moved blocks, per mechanism: with ``copies="auto"``, what it picked.

    Notes
    -----
    With ``copies="dma"`` one descriptor per (block, region) goes to the copy engines: a region's
    blocks are strided in the packed mirror, so runs of ids never merge. ``copies="staged"``
    makes its ring and a scatter graph per layer and slot at construction (4 x num_layers
    graphs). A start with no blocks enqueues nothing: the step's waits find the last start's
    generation. Several starts before one replay are all waited for (generations grow, and on
    the one load stream a layer's flag reaches a later start's only after every earlier start's
    copies of that layer). Call :meth:`close` (or leave a ``with`` block) once no graph that
    waits on this instance will be replayed again.

    Examples
    --------
    >>> loads = kv_ops.LayerwiseLoads(engine, "resume")
    >>> loads.start(host_ids=[4, 5], gpu_ids=[11, 12])   # before the replay it feeds
    >>> graph.replay()        # each layer: h = kv_ops.wait_layer(h, "resume", i, [k_i, v_i])
    """

    def __init__(
        self,
        engine,
        name: str,
        layers: Sequence[Sequence[str]] | None = None,
        copies: str = "kernel",
        ring_bytes: int = layerwise_ring.RING_BYTES,
    ):
        check_engine("LayerwiseLoads", engine)
        if copies not in COPIES:
            raise ValueError(f"LayerwiseLoads: copies must be one of {', '.join(map(repr, COPIES))}, got {copies!r}")
        ring_bytes = positive_int("LayerwiseLoads", "ring_bytes", ring_bytes)
        in_step.check_name("LayerwiseLoads", name)
        if engine.disk is not None:
            raise ValueError(
                "LayerwiseLoads: this engine keeps its blocks on disk (disk_dir=); layer-wise loads read "
                "the host mirror of a memory engine"
            )
        self.engine, self.name = engine, name
        groups = _layer_groups(engine, layers)
        self.layers = groups
        self.num_layers = len(groups)
        self.waits = np.zeros(self.num_layers, dtype=np.int64)
        # Descriptor rows in layer order: row r is one region's copy of every block of a call.
        names = [n for group in groups for n in group]
        mirror, gpu = engine.mirror_regions, engine.regions
        self._src_base = np.array([mirror[n].data_ptr() for n in names], dtype=np.int64)[:, None]
        self._dst_base = np.array([gpu[n].data_ptr() for n in names], dtype=np.int64)[:, None]
        self._dst_stride = np.array([gpu[n].stride(0) for n in names], dtype=np.int64)[:, None]
        self._width = np.array([gpu[n].shape[1] for n in names], dtype=np.int64)[:, None]
        self._row_bytes = engine.block_bytes  # every mirror view's row stride
        bounds = np.cumsum([0] + [len(g) for g in groups])
        self._rows = list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
        self.device = engine.device
        self._side = engine.load_side("LayerwiseLoads.start", "start it before the replay")
        self.copies = copies
        mechanisms = ("kernel", "staged") if copies == "auto" else (copies,)
        self.starts = dict.fromkeys(mechanisms, 0)
        self._paths = {c: _LayerPath(self, c) for c in mechanisms}
        engine.path_counts.setdefault(_LayerPath.name, 0)
        self._staged = None
        if "staged" in mechanisms:
            self._staged = layerwise_ring.StagedLayers(self, ring_bytes)
            self._pieces = sum(len(p) for p in self._staged.pieces)
        self._stream = None
        if self.device.type == "cuda":
            self._bind_device(engine, mechanisms, groups)
        in_step.register(name, self)

    def _bind_device(self, engine, mechanisms: tuple[str, ...], groups: list[list[str]]) -> None:
        """On a GPU: the flags, the wait kernel (compiled now), and each mechanism's launcher."""
        mirror, gpu = engine.mirror_regions, engine.regions
        load_stream = engine.load_stream
        # Every mechanism's copies run on the engine's load stream: in issue order with its
        # other loads, so a later load of the same GPU blocks lands after this one's (the
        # staged scatters follow on a stream of their own, and the engine orders its next
        # load of another path after their completion event).
        self._stream = load_stream
        self._handle = load_stream.cuda_stream
        # [wanted, landed of layer 0, 1, ...]: see layer_wait.wait_landed. Generations: _issued
        # is the last one a start took (a start that failed halfway too: some of its layers
        # may have published it), _wanted the last one whose start was issued whole.
        self._flags = lasting_copy(torch.zeros(1 + self.num_layers, dtype=torch.int32), self.device)
        in_step.keep(self._flags)
        self._wanted_address = self._flags.data_ptr()
        self._landed = [self._wanted_address + 4 * (1 + i) for i in range(self.num_layers)]
        self._issued = self._wanted = 0
        self._errors = errors = error_counter(self.device)
        self._timeout_ns = int(WAIT_TIMEOUT_S * 1e9)
        wait_landed(self._flags, 0, self._timeout_ns, errors)  # compiled outside any capture
        if self.copies == "dma":
            self._launcher = dma.Launcher(load_stream)
        if "kernel" in mechanisms:
            bounds = [kernels.BoundCopy(self.device, [mirror[n] for n in g], [gpu[n] for n in g]) for g in groups]
            capacity = engine.num_blocks  # a load's GPU ids are distinct
            flags = self._flags
            self._kernel_copies = Pool(lambda: _LayerKernels(bounds, capacity, errors, flags), initial=2)

    # --- host side ---------------------------------------------------------------------------

    def start(self, host_ids, gpu_ids, after=None) -> int:
        """Start loading host blocks ``host_ids[i]`` into GPU blocks ``gpu_ids[i]``, layer by layer.

        Call it before the step (or the replay) whose waits it feeds, and enqueue that step on
        the stream current here (or one ordered after it): the generation the step waits for
        is written there. The copies are ordered after ``after``, by default after the work
        already enqueued on the caller's current stream (every reader of the destination
        blocks, e.g. the previous replay). Nothing blocks the caller's thread.

        Parameters
        ----------
        host_ids, gpu_ids : sequence of int, or 1-D int32/int64 numpy array or CPU tensor
            As :meth:`OffloadEngine.load`: host ids in ``[0, num_host_blocks)``, GPU ids in
            ``[0, num_blocks)`` and distinct, of equal length (zero is allowed). GPU tensors are
            refused: the copies are planned on the host.
        after : torch.cuda.Event or torch.cuda.Stream, optional
            As :meth:`OffloadEngine.load`.

        Returns
        -------
        int
            The engine's transfer id, reported by ``engine.poll().loads`` once every layer landed.

        Raises
        ------
        ValueError
            Bad ids, before any byte moves (the engine's checks and words).
        RuntimeError
            During a CUDA-graph capture (start it before the replay instead); or a driver call
            failed while issuing (``copies="dma"``): no transfer is made, and the layers that
            it did not reach keep their last load, so do not replay a step that reads them.
        ClosedError
            After the engine or this object was closed.
        """
        if not in_step.is_live(self):
            self.engine.check_open("LayerwiseLoads.start")  # a closed engine is the reason to give
            in_step.check_live(self, "LayerwiseLoads.start")
        path = self._pick if self.copies == "auto" else self._paths[self.copies]
        return self.engine.load_through(path, self._side, host_ids, gpu_ids, after)

    def _pick(self, blocks: Blocks) -> _LayerPath:
        """copies="auto": the path of the mechanism :func:`pick_copies` picks for these ids."""
        return self._paths[pick_copies(blocks.host_ids, self._pieces)]

    def enqueue(self, host: np.ndarray, gpu: np.ndarray, ready, copies: str) -> torch.cuda.Event | None:
        n = host.size
        if n == 0:
            return None  # nothing to wait for: the step's waits find the last start's layers landed
        self.starts[copies] += 1
        if self._stream is None:
            self._run_on_host(host, gpu, copies)
            return None
        generation = self._issued = self._issued + 1
        with driver_context(self.device):
            if copies == "staged":
                done = self._staged.enqueue(host, gpu, ready, self._landed, generation, self.engine.load_events)
            elif copies == "kernel":
                done = self._enqueue_kernels(host, gpu, ready, generation)
            else:
                done = self._enqueue_dma(host, gpu, ready, generation)
            # Last, once every layer's copies were issued: the generation the step waits for, on
            # the caller's stream, so that a replay enqueued after this call reads it there, and
            # one enqueued before it (still queued) keeps waiting only for the starts before it.
            write_value(current_stream_handle(self.device.index), self._wanted_address, generation)
        self._wanted = generation
        return done

    def _run_on_host(self, host: np.ndarray, gpu: np.ndarray, copies: str) -> None:
        """A CPU engine: the same copies, at once (the kernel's and the DMA's are the same bytes)."""
        if copies == "staged":
            self._staged.run_on_host(host, gpu)
            return
        for plan in self._dma_plans(host, gpu):
            dma.run_on_host(plan)

    def _dma_plans(self, host: np.ndarray, gpu: np.ndarray) -> list:
        """Per layer, one descriptor per (block, region) of this start."""
        n = host.size
        # [rows, n] in one broadcast each; row-major, so a layer's copies are one slice.
        srcs = (self._src_base + host * self._row_bytes).ravel()
        dsts = (self._dst_base + gpu * self._dst_stride).ravel()
        sizes = np.repeat(self._width.ravel(), n)
        return [dma.Plan(dsts[lo * n : hi * n], srcs[lo * n : hi * n], sizes[lo * n : hi * n]) for lo, hi in self._rows]

    def _enqueue_dma(self, host: np.ndarray, gpu: np.ndarray, ready, generation: int) -> torch.cuda.Event:
        launcher, handle = self._launcher, self._handle
        wait_event(handle, ready)
        for plan, landed in zip(self._dma_plans(host, gpu), self._landed):
            launcher(plan)
            write_value(handle, landed, generation)  # layer i's copies, and every earlier layer's
        return self.engine.load_events.record(self._stream, handle)

    def _enqueue_kernels(self, host: np.ndarray, gpu: np.ndarray, ready, generation: int) -> torch.cuda.Event:
        n, handle = host.size, self._handle
        copies = self._kernel_copies.take()
        words = copies.words  # free: the replay that last read it has run (the pool checked)
        words[0] = n
        words[1 : 1 + n] = host
        words[1 + n : 1 + 2 * n] = gpu
        words[copies.generation_word] = generation & 0xFFFFFFFF
        wait_event(handle, ready)
        graph_launch(copies.exec, handle)
        done = self.engine.load_events.record(self._stream, handle)
        self._kernel_copies.give(copies, done)
        return done

    # --- device side (the op) ----------------------------------------------------------------

    def _check_wait(self, layer: int, caches: Sequence[torch.Tensor]) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(
                f"kv_ops.wait_layer: layer {layer} is not a layer of {self.name!r} (0..{self.num_layers - 1})"
            )
        in_step.check_caches(self.name, layer, caches, self.device)

    def wait(self, layer: int, caches: Sequence[torch.Tensor]) -> None:
        """What :func:`kv_ops.wait_layer` does for layer ``layer`` of this object."""
        self._check_wait(layer, caches)
        self.waits[layer] += 1
        if self._stream is None:
            return  # the CPU engine copied at start
        if capture.capturing():
            # A kernel node: it reads the generation to wait for when it runs (a replay's value,
            # written by the last start enqueued before it), where a captured stream wait would
            # keep the one of the capture.
            wait_landed(self._flags, layer, self._timeout_ns, self._errors)
            return
        with driver_context(self.device):  # eagerly, the host knows the generation: one stream wait
            wait_value_reached(current_stream_handle(self.device.index), self._landed[layer], self._wanted)

    def close(self) -> None:
        """Give up the name, once the copies in flight have landed (their id blocks and graphs
        may then go). A graph captured against this instance waits on its flags, which stay (a
        replay then reads the last loads and never hangs), but do not replay it once the
        instance is gone: nothing loads into it any more."""
        if in_step.unregister(self):
            if self._stream is not None:
                self._stream.synchronize()  # rare, and what keeps the twins alive while read
            if self._staged is not None:
                self._staged.close()
            # Its graphs go now, not at some later garbage collection (the instance is in a
            # reference cycle with its engine path): a CUDAGraph torn down inside another
            # capture, the user's next one say, frees memory there and invalidates it.
            self._staged = self._kernel_copies = self._launcher = None

    def __enter__(self) -> LayerwiseLoads:
        in_step.check_live(self, "LayerwiseLoads")  # as every call after close() does, not at the first one inside
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _LayerKernels:
    """One start of the zero-copy kernel as one CUDA graph: the id block ``[n, host ids, GPU
    ids, ..., generation]`` copied in from its page-locked twin (``words``), then per layer the
    block-copy kernel and a 4-byte copy of the generation into that layer's landed flag (after
    the kernel: its bytes are in before the flag says so). One driver call issues every layer."""

    def __init__(self, bounds: list, capacity: int, errors: torch.Tensor, flags: torch.Tensor):
        device = errors.device
        size = 2 + 2 * capacity
        self.generation_word = size - 1  # the word past the largest id lists
        self.block = lasting_copy(torch.zeros(size, dtype=torch.int64), device)  # zero: copies nothing
        self.twin = pinned_empty(size, dtype=torch.int64)
        self.twin.zero_()
        self.words = self.twin.numpy()
        low = self.block.view(torch.int32)[2 * self.generation_word : 2 * self.generation_word + 1]  # little-endian
        stream = torch.cuda.Stream(device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(device), torch.cuda.stream(stream):
            for bound in bounds:
                bound.launch_from_block(None, self.block, capacity, errors)  # compiles outside the capture
            stream.synchronize()
            with capture.captured_into(self.graph):
                self.block.copy_(self.twin, non_blocking=True)  # a memcpy node: the ids come in
                for i, bound in enumerate(bounds):
                    bound.launch_from_block(None, self.block, capacity, errors)
                    flags[1 + i : 2 + i].copy_(low)  # layer i has landed
        self.exec = self.graph.raw_cuda_graph_exec()


__all__ = ["LayerwiseLoads", "wait_layer", "pick_copies"]
