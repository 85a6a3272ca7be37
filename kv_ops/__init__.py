"""kv_ops: KV-cache blocks between GPU memory and page-locked host memory, as compile-safe ops.

Where each piece lives, by floor (a module imports only the floors below it):

The shared CUDA floor, at the bottom: the modules both kv_ops and ple_ops build on. ple_ops imports
them by the public names in their ``__all__`` only, so what they keep private may change freely.

* ``arguments``    -- ``positive_int``, ``device``, ``cuda_device``: the count and device rules of every entry point.
* ``registration`` -- ``register_op``: the one way both packages register an operator.
* ``driver``       -- every CUDA driver call both packages make, checked: ``driver``, ``check_driver``,
                      ``driver_context``, ``device_pointer`` (cuda-bindings imported lazily).
* ``capture``      -- ``capturing``, ``refuse_capture``: the one refusal of work during CUDA-graph capture;
                      ``captured_into``: the ops' own captures.
* ``host_memory``  -- ``pinned_empty`` (exact-size page-locked memory), ``pin_mapping``, ``device_view``,
                      ``check_host_bytes`` (a size refused before anything is allocated).
* ``kernels``      -- the Triton block-copy kernel and its launcher; ``NUM_PROGRAMS``, ``NUM_WARPS``,
                      ``TILE_BYTES``, the tile ple_ops sizes its own kernels by.

The op floor (``kv_ops/*.py``): what a ``torch.ops.kv_ops`` copy needs, and nothing above it; the
shared CUDA floor is part of it.

* ``reference``   -- pure-torch copies: the CPU path and the test oracle.
* ``geometry``    -- ``KVCacheTensorSpec``, ``resolve_regions``, ``infer_regions``: cache tensors
                     to block-strided byte regions ``[num_blocks, block_bytes]``.
* ``validation``  -- eager checks, ``set_id_checks``, the skipped-pair counter.
* ``ops``         -- ``torch.ops.kv_ops.copy_blocks / gather_blocks / scatter_blocks``.

The engine floor (``kv_ops/transfer/``): ordered, tracked transfers built on the ops.

* ``transfer.dma``       -- copy plans for the copy engines and their launch (batched and 2-D driver calls).
* ``transfer.ids``       -- the engine's id intake and ``Pool`` (what the GPU reads, reused after it has).
* ``transfer.paths``     -- the engine's three paths: zero-copy kernel, staged (GPU ring + DMA), direct DMA.
* ``transfer.crossover`` -- what ``path="auto"`` measured on the engine's own shape, and its pick.
* ``transfer.disk``      -- ``BlockFile``: the disk tier's private file of block slots (aligned, O_DIRECT); its path.
* ``transfer.engine``    -- ``OffloadEngine``: ordered, tracked stores and loads to a packed host mirror;
                           ``ClosedError``, what every object here raises once closed.
* ``transfer.host_blocks`` -- ``HostBlockAllocator``: which host blocks are free, handed out in runs (best fit).
* ``transfer.layerwise`` -- ``LayerwiseLoads``, ``wait_layer``: loads a captured step waits for layer by layer.
* ``transfer.layerwise_ring`` -- their ``copies="staged"``: copy engines into a GPU ring, a scatter per layer.
* ``transfer.step_transfers`` -- ``StepTransfers``, ``step_transfers``: stores and loads a captured step runs itself.

Tools (``kv_ops/tools/``), imported only when asked for:

* ``tools.aot``    -- ``compile_step`` / ``load_step``: AOT-compiling a model's step that uses these ops.
* ``tools.doctor`` -- ``python -m kv_ops.tools.doctor``: checks a machine, measures the link.

Adapters (``kv_ops/integrations/``): ``kv_ops.integrations.vllm`` and ``kv_ops.integrations.transformers``,
imported only when asked for.
"""

import torch

__version__ = "0.2.0"

# The lowest torch the suite passes on (pyproject.toml says why); older ones fail in obscure ways.
TORCH_FLOOR = (2, 11)
if tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) < TORCH_FLOOR:
    raise ImportError(f"offload-ops needs torch >= {'.'.join(map(str, TORCH_FLOOR))}, found torch {torch.__version__}")

# After the version check: the modules below need the newer torch. The op floor first, then the
# engine floor; importing both registers every torch.ops.kv_ops op (wait_layer is transfer's).
from .cuda.host_memory import device_view, pinned_empty
from .geometry import KVCacheTensorSpec, block_bytes, infer_regions, resolve_regions  # noqa: E402
from .ops import copy_blocks, gather_blocks, scatter_blocks
from .transfer import dma
from .transfer.disk import BlockFile
from .transfer.engine import AllRanks, ClosedError, Completed, EngineClosedError, OffloadEngine
from .transfer.host_blocks import HostBlockAllocator, OutOfHostBlocksError
from .transfer.layerwise import LayerwiseLoads, wait_layer
from .transfer.step_transfers import StepTransfers, step_transfers
from .validation import error_count, error_counter, id_checks, reset_error_count, set_id_checks

__all__ = [
    "__version__",
    "KVCacheTensorSpec",
    "resolve_regions",
    "infer_regions",
    "block_bytes",
    "pinned_empty",
    "device_view",
    "copy_blocks",
    "gather_blocks",
    "scatter_blocks",
    "set_id_checks",
    "id_checks",
    "error_count",
    "error_counter",
    "reset_error_count",
    "BlockFile",
    "OffloadEngine",
    "Completed",
    "ClosedError",
    "EngineClosedError",
    "AllRanks",
    "HostBlockAllocator",
    "OutOfHostBlocksError",
    "LayerwiseLoads",
    "wait_layer",
    "StepTransfers",
    "step_transfers",
    "dma",
]
