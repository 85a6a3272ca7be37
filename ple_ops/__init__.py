"""ple_ops: per-layer-embedding rows computed in a CUDA-free CPU process, pulled by GPU streams.

Built on kv_ops: its driver helpers (``kv_ops.driver``), page-locking (``kv_ops.host_memory``) and,
for the gather transport, its zero-copy gather kernel.

Where each piece lives:

* ``shared_memory`` -- ``SharedHostBuffer``: page-locked host memory two processes map.
* ``semaphore``     -- ``CpuGpuSemaphore``: the flag (device or shared host memory) and its
                       stream and host operations; the host spin-wait and release fence.
* ``registry``      -- layer name -> this process's live flag, slot and row size.
* ``ops``           -- ``torch.ops.ple_ops.wait / wait_copy / release``, copy-geometry observation.
* ``kernels``       -- the wait, copy and release kernels a captured step replays in place of
                       stream memory operations.
* ``layer``         -- ``PleOffloadLayer``, the model-side base class.
* ``control``       -- ``ControlBlock``: the shared words both processes use (steps, flags,
                       waiting words), and the named messages of their pipe.
* ``worker``        -- the offload process: the handshake, then the serving loop.
* ``runtime``       -- ``OffloadRuntime``: starts the offload process; the GPU side of the step
                       transaction.
* ``watchdog``      -- ``Watchdog``: the runtime's thread that frees GPU streams no prepared step
                       will serve, and fails the runtime (a dead process, a late step).
* ``host_rows``     -- ``pin_rows`` / ``gather_rows``: a table as page-locked rows, and their
                       zero-copy gather.
* ``host_table``    -- ``gather_from_host``: the gather transport (lookup tables in page-locked
                       host memory, gathered zero-copy inside the graph).
* ``host_embedding`` -- ``host_embedding``: the same for a stock ``nn.Embedding`` (or Gemma 3n's
                       scaled one) in a transformers model, in one call.
* ``reference``     -- pure-torch row pull and poison: the CPU path and the test oracle.
"""

from kv_ops import __version__  # one version for the distribution, written in kv_ops

from .host_embedding import HostEmbedding, host_embedding
from .host_table import gather_from_host
from .layer import PleOffloadLayer, building_placeholders, mark_offload_worker
from .ops import observe_copy_geometry, release, wait, wait_copy
from .registry import ArmedLayer, arm, armed_names, disarm, lookup
from .runtime import OffloadError, OffloadRuntime
from .semaphore import CpuGpuSemaphore, ProducerFailed
from .shared_memory import SharedHandle, SharedHostBuffer

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
