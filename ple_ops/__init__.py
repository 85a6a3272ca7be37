"""ple_ops: per-layer-embedding rows for GPU graphs, computed in a CUDA-free CPU process or gathered from host memory.

Built on kv_ops: its driver helpers (``kv_ops.cuda.driver``), page-locking (``kv_ops.cuda.host_memory``) and,
for the gather transport, its zero-copy gather kernel.

Its layers, bottom up; each imports only the layers below it (tests/ple_ops/test_floors.py checks it):

1. the op floor, this folder's modules: what a model's forward runs.

   * ``semaphore`` -- ``CpuGpuSemaphore``: the flag (device or shared host memory), its stream
                      and host operations, the host spin-wait and release fence.
   * ``kernels``   -- the wait, copy and release kernels a captured step replays in place of
                      stream memory operations.
   * ``reference`` -- pure-torch row pull and poison: the CPU path and the test oracle.
   * ``registry``  -- layer name -> this process's live flag, slot and row size, and the
                      ``StepGuard`` protocol the ops ask.
   * ``ops``       -- ``torch.ops.ple_ops.wait / wait_copy / release``, copy-geometry
                      observation, and ``gather_rows`` (the gather transport's op).
   * ``layer``     -- ``PleOffloadLayer``, the model-side base class.

2. the transports, side by side (neither imports the other):

   * ``gather/``   -- tables in page-locked host memory read zero-copy: ``gather_from_host``,
                      ``host_embedding``.
   * ``runtime/``  -- the offload process and the step transaction: ``OffloadRuntime``.

From kv_ops it imports only the CUDA floor, ``kv_ops.cuda`` (public names in its modules'
``__all__``), the gather op ``kv_ops.ops.gather_blocks`` and the package's ``__version__``.
"""

from kv_ops import __version__  # one version for the distribution, written in kv_ops

from .gather import HostEmbedding, gather_from_host, host_embedding
from .layer import PleOffloadLayer, building_placeholders, mark_offload_worker
from .ops import observe_copy_geometry, release, wait, wait_copy
from .registry import ArmedLayer, arm, armed_names, disarm, lookup
from .runtime import OffloadError, OffloadRuntime
from .runtime.shared_memory import SharedHandle, SharedHostBuffer
from .semaphore import CpuGpuSemaphore, ProducerFailed

__all__ = [
    "__version__",
    "gather_from_host",
    "host_embedding",
    "HostEmbedding",
    "PleOffloadLayer",
    "building_placeholders",
    "mark_offload_worker",
    "wait",
    "wait_copy",
    "release",
    "observe_copy_geometry",
    "ArmedLayer",
    "arm",
    "disarm",
    "lookup",
    "armed_names",
    "OffloadRuntime",
    "OffloadError",
    "ProducerFailed",
    "CpuGpuSemaphore",
    "SharedHandle",
    "SharedHostBuffer",
]
