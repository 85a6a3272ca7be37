"""vLLM's ``OffloadingConnector`` backed by one :class:`kv_ops.OffloadEngine`.

vLLM loads this spec out of tree (``vllm/v1/kv_offload/factory.py``)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "OffloadOpsSpec",
            "spec_module_path": "kv_ops.integrations.vllm", "cpu_bytes_to_use": 17179869184}}'

What it is:

- **Scheduler side**: vLLM's own ``CPUOffloadingManager`` (LRU, or ARC with
  ``"eviction_policy": "arc"``), sized exactly as vLLM's ``CPUOffloadingSpec`` sizes it: it *is*
  that spec's ``get_manager`` (this class subclasses it), so ``cpu_bytes_to_use``,
  ``eviction_policy``, ``store_threshold``, ``max_tracker_size`` and ``block_size`` (via
  ``blocks_per_chunk``) mean what they mean there.
- **Worker side**: :class:`OffloadOpsWorker`, one :class:`kv_ops.OffloadEngine` over every
  ``CanonicalKVCaches.tensors`` entry, each a region ``[num_blocks, page_size_bytes]``. vLLM's
  CPU chunk ``c`` (one offloaded block) holds ``blocks_per_chunk`` GPU blocks; GPU-sized piece
  ``j`` of it is mirror row ``c * blocks_per_chunk + j``, so the mirror holds
  ``num_chunks * blocks_per_chunk`` rows of every region side by side. ``GPULoadStoreSpec``'s
  ``group_sizes`` and ``block_indices`` are honoured as vLLM's ``CPUOffloadingWorker`` honours
  them (a group's first chunk is entered at ``block_indices[g] % blocks_per_chunk``).
- Each KV-cache group moves only what vLLM's worker copies for it: per block, the first
  ``page_size_bytes`` of each tensor its refs name (an engine group, ``OffloadEngine(groups=)``;
  groups that move the same bytes share one, and where every group moves every tensor's whole
  page the engine has no groups). Each ``submit_store`` / ``submit_load`` is one
  ``engine.store`` / ``engine.load`` per engine group it touches (ordered after the caller's
  current stream, as vLLM's worker orders its copies; vLLM 0.33's expedited load is issued as any
  other); ``get_finished`` is ``engine.poll``
  (every job reported exactly once, when all its transfers are, failures with
  ``success=False``); ``wait`` flushes the engine (waits for every transfer in flight, a superset
  of the jobs asked for) and keeps what finished for the next ``get_finished``.
  ``transfer_time`` is the copy's own time, as vLLM's worker reports it: on a GPU, between two timing events on a side stream of the
  worker's, one after the caller's stream and the direction's previous copy, one after the
  engine's completion event of the transfer (:meth:`kv_ops.OffloadEngine.completion_event`); on
  a CPU engine, which copies inside ``engine.store`` / ``engine.load``, the host time of that
  call. ``transfer_size`` counts the un-padded bytes of each group's layers, as vLLM's worker
  counts them.
- ``get_worker`` builds one worker and keeps it; ``create_worker`` (vLLM's CPU spec builds its
  own worker there) builds a new :class:`OffloadOpsWorker`.
- Where vLLM's CPU spec shares one host region among a machine's ranks (CUDA, more than one
  rank), each rank's engine adopts its slab of one shared mapping
  (:func:`kv_ops.cuda.host_memory.shared_host_buffer`, which leaves nothing in ``/dev/shm``); with
  the replicated layout (MLA with tensor parallelism) every rank adopts the same slab, one copy
  for all, and vLLM's connector lets rank 0 alone store.

Limits: the canonical (parallelism-free) host layout is refused.

Importing this module imports vLLM and checks its version against
:data:`SUPPORTED_VLLM_VERSIONS` (:mod:`kv_ops.integrations.vllm_version`); any other raises
``ImportError`` naming the versions supported and how to install one. ``import kv_ops`` never
imports this module.
"""

from __future__ import annotations

import reprlib
import time
from collections.abc import Mapping

import numpy as np
import torch

import kv_ops

from ..cuda.arguments import positive_int
from ..cuda.host_memory import shared_host_buffer
from .vllm_config import cpu_bytes_to_use, engine_kwargs
from .vllm_version import SUPPORTED_VLLM_VERSIONS, VLLM_VERSION, check_vllm_version, installed_vllm_version

check_vllm_version(installed_vllm_version())

from vllm.v1.kv_offload.base import (  # noqa: E402  (after the version check)
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig  # noqa: E402
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec  # noqa: E402

__all__ = [
    "OffloadOpsSpec",
    "OffloadOpsWorker",
    "SUPPORTED_VLLM_VERSIONS",
    "VLLM_VERSION",
    "check_vllm_version",
    "chunk_rows",
    "installed_vllm_version",
]


def chunk_rows(chunk_ids: np.ndarray, blocks_per_chunk: int, skip: int, count: int) -> np.ndarray:
    """Mirror rows of ``count`` GPU-sized pieces of the chunks ``chunk_ids``, starting ``skip``
    pieces into the first chunk (the enumeration of vLLM's ``compute_sub_block_ptrs``)."""
    chunk_ids = np.asarray(chunk_ids, dtype=np.int64)
    if blocks_per_chunk == 1:
        return chunk_ids[:count]
    rows = (chunk_ids[:, None] * blocks_per_chunk + np.arange(blocks_per_chunk, dtype=np.int64)).ravel()
    return rows[skip : skip + count]


_NOTHING = object()  # the engine group of a vLLM group with no bytes on this worker
_EMPTY = np.empty(0, np.int64)


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def engine_groups(group_data_refs, regions: dict[str, torch.Tensor]) -> tuple[dict | None, list]:
    """The engine's ``groups`` for vLLM's groups, and each vLLM group's engine group.

    A vLLM group moves, per block, the first ``page_size_bytes`` of each tensor its refs name
    (vLLM's worker copies exactly those). Groups that move the same bytes share one engine
    group (vLLM's hybrid allocator overlays groups on the same tensors), so a job touching them
    is one engine call. Where every group moves every tensor's whole page, the engine needs no
    groups (None); a group with no refs on this worker moves nothing.
    """
    moved = []
    for refs in group_data_refs:
        widths: dict[str, int] = {}
        for ref in refs:  # a tensor named twice moves once, as far as the wider ref reaches
            name = f"t{ref.tensor_idx}"
            widths[name] = max(widths.get(name, 0), ref.page_size_bytes)
        moved.append(tuple(widths.items()))
    whole = frozenset((name, r.shape[1]) for name, r in regions.items())
    if all(frozenset(m) == whole for m in moved if m):
        return None, [None if m else _NOTHING for m in moved]
    first: dict[frozenset, int] = {}
    for g, m in enumerate(moved):
        if m:
            first.setdefault(frozenset(m), g)
    groups = {g: list(moved[g]) for g in first.values()}
    return groups, [first[frozenset(m)] if m else _NOTHING for m in moved]


class _Job:
    """One vLLM job: its engine transfers left to report, and how the ones reported ended."""

    __slots__ = ("job_id", "nbytes", "left", "ok", "timing")

    def __init__(self, job_id: int, nbytes: int):
        self.job_id, self.nbytes, self.left, self.ok, self.timing = job_id, nbytes, 0, True, None


class _CopyClock:
    """The copy's own time of one direction's transfers on a GPU engine, as vLLM's worker measures
    it (``start_event.elapsed_time(end_event)``), without adding a wait to the engine's streams.

    A side stream of its own waits for the caller's current stream, then records a start event:
    it runs once the KV the copy reads (or the blocks it overwrites) are ready and the previous
    copy of this direction has finished, which is when the engine's copy can start. It then waits
    for the engine's completion event of the transfer and records an end event. The engine's
    streams never wait on this one, so the timing moves nothing. Events are reused once read.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.ready = torch.cuda.Event()  # what the engine's copy waits for (its ``after=``)
        self._free: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def begin(self) -> tuple[torch.cuda.Event, tuple[torch.cuda.Event, torch.cuda.Event]]:
        """Record ``ready`` on the caller's stream and the start event after it; returns both
        (``ready`` is passed to the engine, which waits on it before its call returns, so one
        event serves every call)."""
        self.ready.record(torch.cuda.current_stream(self.device))
        pair = (
            self._free.pop()
            if self._free
            else (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
        )
        self.stream.wait_event(self.ready)
        pair[0].record(self.stream)
        return self.ready, pair

    def end(self, pair: tuple[torch.cuda.Event, torch.cuda.Event], done: torch.cuda.Event | None) -> None:
        """Record the end event after the engine's completion event ``done`` (None: the copy was
        complete at issue). Called right after the engine call, before ``done`` can be reused."""
        if done is not None:
            self.stream.wait_event(done)
        pair[1].record(self.stream)

    def give(self, pair: tuple[torch.cuda.Event, torch.cuda.Event]) -> None:
        self._free.append(pair)

    def seconds(self, pair: tuple[torch.cuda.Event, torch.cuda.Event]) -> float:
        """The time between the pair, once the engine reported the transfer (the end event
        follows its completion event by one wait on an idle stream), then the pair is reused."""
        start, end = pair
        if not end.query():
            end.synchronize()
        self.give(pair)
        return start.elapsed_time(end) * 1e-3  # elapsed_time is in milliseconds


def _check_specs(call: str, gpu: tuple[str, LoadStoreSpec], host: tuple[str, LoadStoreSpec]) -> None:
    """Refuse specs a vLLM connector never passes ``OffloadOpsWorker.<call>`` (each ``(argument,
    spec)``): GPU blocks on one side, CPU chunks on the other. A GPU spec is a block-ids spec like
    the CPU one, so without this a GPU spec where the chunks go would pass for chunk ids."""
    (gpu_name, gpu_spec), (host_name, host_spec) = gpu, host
    if not isinstance(gpu_spec, GPULoadStoreSpec):
        raise TypeError(
            f"OffloadOpsWorker.{call}: {gpu_name} must be the GPU blocks (a GPULoadStoreSpec), "
            f"got {_described(gpu_spec)}"
        )
    if isinstance(host_spec, GPULoadStoreSpec):
        raise ValueError(
            f"OffloadOpsWorker.{call}: {host_name} must be the CPU chunks (a CPULoadStoreSpec), "
            f"got GPU blocks ({_described(host_spec)})"
        )


def _described(spec) -> str:
    ids = getattr(spec, "block_ids", None)
    if ids is None:
        return repr(spec)
    return f"a {type(spec).__name__} of ids {np.array2string(np.asarray(ids), separator=', ', threshold=16)}"


class OffloadOpsWorker(OffloadingWorker):
    """vLLM ``OffloadingWorker`` over one :class:`kv_ops.OffloadEngine` (see the module docstring).

    Parameters
    ----------
    kv_caches : CanonicalKVCaches
        What vLLM hands ``OffloadingSpec.get_worker``: tensors ``[num_blocks, ...]`` with their
        (padded) page sizes, and per group the layers' references into them.
    blocks_per_chunk : int
        GPU blocks per offloaded block (vLLM's ``blocks_per_chunk``).
    num_chunks : int
        Offloaded blocks the manager hands out (vLLM's CPU spec ``num_chunks``).
    **engine_kwargs
        Passed to :class:`kv_ops.OffloadEngine` (``path``, ``ring_bytes``, ``crossover_file``).
    """

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int, **engine_kwargs):
        blocks_per_chunk = positive_int("OffloadOpsWorker", "blocks_per_chunk", blocks_per_chunk)
        num_chunks = positive_int("OffloadOpsWorker", "num_chunks", num_chunks)
        regions: dict[str, torch.Tensor] = {}
        num_blocks = None
        for i, t in enumerate(kv_caches.tensors):
            flat = t.tensor.view(torch.uint8).view(-1, t.page_size_bytes)
            if num_blocks is None:
                num_blocks = flat.shape[0]
            elif flat.shape[0] != num_blocks:
                raise ValueError(f"OffloadOpsWorker: tensor {i} has {flat.shape[0]} blocks, tensor 0 has {num_blocks}")
            regions[f"t{i}"] = flat
        if num_blocks is None:
            raise ValueError("OffloadOpsWorker: no KV-cache tensors")
        self.blocks_per_chunk = blocks_per_chunk
        self.num_chunks = num_chunks
        # vLLM counts each group's un-padded bytes per block (its transfer_size), and so do we.
        self.group_bytes = [sum(r.page_size_bytes for r in refs) for refs in kv_caches.group_data_refs]
        groups, self.engine_groups = engine_groups(kv_caches.group_data_refs, regions)
        row_bytes = sum(r.shape[1] for r in regions.values())
        # Each region is already a uint8 [num_blocks, page_size_bytes] view: the engine takes it as is.
        self.engine = kv_ops.OffloadEngine(
            regions,
            num_blocks,
            capacity_bytes=num_chunks * blocks_per_chunk * row_bytes,
            groups=groups,
            **engine_kwargs,
        )
        # The engine group an empty job is issued on (it still gets a transfer id, reported in turn).
        self._any_group = next((k for k in self.engine_groups if k is not _NOTHING), None)
        # Per direction on a GPU engine; a CPU engine copies inside its call, timed on the host.
        cuda = self.engine.device.type == "cuda"
        self._clocks = {d: _CopyClock(self.engine.device) for d in ("store", "load")} if cuda else None
        # engine id -> its job (a job is one engine transfer per engine group it touches)
        self._jobs: dict[int, _Job] = {}
        self._finished: list[TransferResult] = []
        self.submitted = {"stores": 0, "loads": 0}  # jobs so far, per direction
        self._closed = False

    def transfer_rows(self, gpu_spec: GPULoadStoreSpec, chunk_spec: LoadStoreSpec) -> tuple[list[tuple], int]:
        """vLLM's specs mapped onto the engine: ``[(engine group, GPU ids, mirror rows), ...]``, one
        entry per engine group the transfer touches (groups that move the same regions are one),
        and the bytes vLLM counts for it.

        What each submit does before it calls the engine; public so that tests time the mapping alone.
        """
        if not isinstance(chunk_spec, BlockIDsLoadStoreSpec):
            raise TypeError(f"OffloadOpsWorker: expected CPU chunk ids, got {type(chunk_spec).__name__}")
        group_sizes, block_indices = gpu_spec.group_sizes, gpu_spec.block_indices
        if len(group_sizes) != len(self.group_bytes) or len(block_indices) != len(self.group_bytes):
            raise ValueError(
                f"OffloadOpsWorker: {len(group_sizes)} group sizes and {len(block_indices)} block indices "
                f"for {len(self.group_bytes)} KV-cache groups"
            )
        chunks, gpu = chunk_spec.block_ids, gpu_spec.block_ids
        bpc = self.blocks_per_chunk
        parts: dict = {}  # engine group -> ([GPU id slices], [mirror rows])
        offset, at, nbytes = 0, 0, 0
        for size, index, gbytes, key in zip(group_sizes, block_indices, self.group_bytes, self.engine_groups):
            if size == 0:
                continue
            skip = index % bpc
            n = -(-(size + skip) // bpc)
            if offset + n > len(chunks):
                raise ValueError(f"OffloadOpsWorker: {len(chunks)} chunks cannot hold groups of {list(group_sizes)}")
            if key is not _NOTHING:
                ids, rows = parts.setdefault(key, ([], []))
                ids.append(gpu[at : at + size])
                rows.append(chunk_rows(chunks[offset : offset + n], bpc, skip, size))
            offset += n
            at += size
            nbytes += size * gbytes
        if offset != len(chunks) or at != len(gpu):
            raise ValueError(
                f"OffloadOpsWorker: {len(chunks)} chunks and {len(gpu)} GPU blocks "
                f"do not match groups of {list(group_sizes)}"
            )
        segments = [(key, _joined(ids), _joined(rows)) for key, (ids, rows) in parts.items()]
        return segments or [(self._any_group, _EMPTY, _EMPTY)], nbytes

    def _submit(self, kind: str, segments: list[tuple], job_id: int, nbytes: int) -> None:
        call = self.engine.store if kind == "store" else self.engine.load
        job = _Job(job_id, nbytes)
        clock = pair = None
        if self._clocks is None:
            t0 = time.perf_counter()
        else:
            clock = self._clocks[kind]
            ready, pair = clock.begin()
        tid = None
        try:
            for key, gpu, host in segments:
                if clock is None:
                    tid = call(gpu, host, group=key) if kind == "store" else call(host, gpu, group=key)
                elif kind == "store":
                    tid = call(gpu, host, after=ready, group=key)
                else:
                    tid = call(host, gpu, after=ready, group=key)
                job.left += 1
                self._jobs[tid] = job
        except BaseException:
            if clock is not None:
                clock.give(pair)  # the pair times nothing
            job.ok, job.timing = False, 0.0  # what was issued is still reported, as failed
            raise
        if clock is None:
            job.timing = time.perf_counter() - t0
        else:
            # A direction's transfers complete in issue order: the last one's event ends the job.
            clock.end(pair, self.engine.completion_event(tid))
            job.timing = (clock, pair)
        self.submitted[kind + "s"] += 1

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        _check_specs("submit_store", ("src_spec", src_spec), ("dst_spec", dst_spec))
        segments, nbytes = self.transfer_rows(src_spec, dst_spec)
        self._submit("store", segments, job_id, nbytes)
        return True

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        """``expedited`` (vLLM 0.33's, never passed by 0.32): vLLM's connector waits on such a load
        within the step. The engine has one load queue, so an expedited load is issued like any
        other, behind the loads already issued; the connector's ``wait`` then flushes them all:
        correct, not expedited."""
        _check_specs("submit_load", ("dst_spec", dst_spec), ("src_spec", src_spec))
        segments, nbytes = self.transfer_rows(dst_spec, src_spec)
        self._submit("load", segments, job_id, nbytes)
        return True

    def _take(self, done: kv_ops.Completed) -> None:
        for ok, tids in ((True, (*done.stores, *done.loads)), (False, done.failed)):
            for tid in tids:
                job = self._jobs.pop(tid, None)  # None: a transfer issued on self.engine directly
                if job is None:
                    continue
                job.ok = job.ok and ok
                job.left -= 1
                if job.left == 0:
                    timing = job.timing
                    seconds = timing if isinstance(timing, float) else timing[0].seconds(timing[1])
                    self._finished.append(TransferResult(job.job_id, job.ok, job.nbytes, seconds))

    def get_finished(self) -> list[TransferResult]:
        if not self._closed:  # shutdown collected every transfer, and the engine is closed
            self._take(self.engine.poll())
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        if any(job.job_id in job_ids for job in self._jobs.values()):
            self._take(self.engine.flush())

    def shutdown(self) -> None:
        """Wait for every transfer, free the mirror; what finished stays for ``get_finished``."""
        if not self._closed:
            self._closed = True
            self._take(self.engine.close())


def _world_cpu_group():
    """The CPU group of vLLM's workers, the group vLLM's CPU spec waits on for its shared region."""
    from vllm.distributed.parallel_state import get_inner_dp_world_group, get_world_group

    try:
        return get_inner_dp_world_group().cpu_group
    except AssertionError:  # no inner data-parallel group: every worker is in the world group
        return get_world_group().cpu_group


def _check_config(config) -> None:
    """A ``TypeError`` unless ``config`` is what vLLM builds a spec from: without this, a dict or
    None fails on its first attribute read, naming neither the spec nor what it takes."""
    if not isinstance(config, OffloadingConfig):
        hint = "; kv_connector_extra_config's keys go in its extra_config" if isinstance(config, Mapping) else ""
        raise TypeError(
            "OffloadOpsSpec: config must be vLLM's OffloadingConfig (what OffloadingSpecFactory.create_spec "
            f"passes a spec), got {reprlib.repr(config)} ({type(config).__name__}){hint}"
        )


class OffloadOpsSpec(CPUOffloadingSpec):
    """vLLM ``OffloadingSpec`` whose worker is :class:`OffloadOpsWorker` (module docstring).

    The manager is vLLM's CPU spec's own, sized from ``cpu_bytes_to_use`` the same way; extra
    keys ``kv_ops_path`` (``"auto"``, ``"kernel"``, ``"staged"``, ``"dma"``) and
    ``kv_ops_crossover_file`` reach the engine, checked here (:mod:`kv_ops.integrations.vllm_config`),
    and any other ``kv_ops_`` key is refused.
    """

    def __init__(self, config: OffloadingConfig):
        _check_config(config)
        if config.canonical_layout:
            raise ValueError(
                "OffloadOpsSpec: the canonical host layout (kv_connector_extra_config "
                '"canonical_layout": true) is not supported; leave it off'
            )
        cpu_bytes = cpu_bytes_to_use(config.extra_config)
        self._engine_kwargs = engine_kwargs(config.extra_config)
        # Sized as vLLM's CPU spec sizes itself, replicated layout included (one host copy for
        # every rank where the ranks share host memory: MLA with tensor parallelism).
        super().__init__(config)
        if self.num_chunks == 0 and self.kv_bytes_per_chunk > 0:
            raise ValueError(
                f'OffloadOpsSpec: kv_connector_extra_config "cpu_bytes_to_use" {cpu_bytes} holds no '
                f"offloaded block: one takes {self.kv_bytes_per_chunk} bytes (blocks_per_chunk "
                f"{self.blocks_per_chunk}: that many GPU blocks of every rank's KV cache, padded to the page)"
            )
        self._worker: OffloadOpsWorker | None = None

    def create_worker(self, kv_caches: CanonicalKVCaches, group=None) -> OffloadOpsWorker:
        """A new :class:`OffloadOpsWorker` over ``kv_caches`` (vLLM's CPU spec builds its own worker
        here; ``get_worker`` calls this once and keeps the worker).

        Where vLLM's CPU spec shares one host region among the ranks (on CUDA, with more than one
        rank), so does this one: :func:`kv_ops.cuda.host_memory.shared_host_buffer` over vLLM's world
        group (``group``, a ``torch.distributed`` group, stands in for it), one slab per rank, or
        one slab for every rank with the replicated layout; each worker's engine adopts its
        slab."""
        kwargs = dict(self._engine_kwargs)
        parallel = self.config.parallel
        if self._uses_shared_region() and self.num_chunks > 0 and (parallel.world_size > 1 or group is not None):
            slab = self.num_chunks * self.cpu_page_size_per_worker
            copies = 1 if self.replicated_layout else parallel.world_size
            shared = shared_host_buffer(slab * copies, _world_cpu_group() if group is None else group)
            first = 0 if self.replicated_layout else parallel.rank * slab
            kwargs["host_buffer"] = shared[first : first + slab]
        return OffloadOpsWorker(kv_caches, self.blocks_per_chunk, self.num_chunks, **kwargs)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadOpsWorker:
        if self._worker is None:
            self._worker = self.create_worker(kv_caches)
        return self._worker
