"""kv_ops: KV-cache blocks between GPU memory and page-locked host memory, as compile-safe ops.

Where each piece lives:

* ``geometry``    -- ``KVCacheTensorSpec``, ``resolve_regions``, ``infer_regions``: cache tensors
                     to block-strided byte regions ``[num_blocks, block_bytes]``.
* ``driver``      -- every CUDA driver call both packages make, checked: ``driver``, ``check_driver``,
                     ``driver_context``, ``device_pointer`` (cuda-bindings imported lazily).
* ``host_memory`` -- ``pinned_empty`` (exact-size page-locked memory), ``device_view``.
* ``kernels``     -- the Triton block-copy kernel and its launcher.
* ``ops``         -- ``torch.ops.kv_ops.copy_blocks / gather_blocks / scatter_blocks``.
* ``validation``  -- eager checks, ``set_id_checks``, the skipped-pair counter.
* ``dma``         -- copy plans for the copy engines and their launch (one batched driver call).
* ``paths``       -- the engine's three paths: zero-copy kernel, staged (GPU ring + DMA), direct DMA.
* ``crossover``   -- what ``path="auto"`` measured on the engine's own shape, and its pick.
* ``engine``      -- ``OffloadEngine``: ordered, tracked stores and loads to a packed host mirror.
* ``layerwise``   -- ``LayerwiseLoads``, ``wait_layer``: loads a captured step waits for layer by layer.
* ``disk``        -- ``BlockFile``: the disk tier's private file of block slots (aligned, O_DIRECT).
* ``reference``   -- pure-torch copies: the CPU path and the test oracle.
* ``aot``         -- ``compile_step`` / ``load_step``: AOT-compiling a model's step that uses these ops.
* ``doctor``      -- ``python -m kv_ops.doctor``: checks a machine, measures the link.
"""

import torch

__version__ = "0.2.0"

# The lowest torch the suite passes on (pyproject.toml says why); older ones fail in obscure ways.
TORCH_FLOOR = (2, 11)
if tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) < TORCH_FLOOR:
    raise ImportError(f"offload-ops needs torch >= {'.'.join(map(str, TORCH_FLOOR))}, found torch {torch.__version__}")

from . import dma  # noqa: E402  (after the version check: the modules below need the newer torch)
from .disk import BlockFile
from .engine import AllRanks, Completed, EngineClosedError, OffloadEngine
from .geometry import KVCacheTensorSpec, block_bytes, infer_regions, resolve_regions
from .host_memory import device_view, pinned_empty
from .layerwise import LayerwiseLoads, wait_layer
from .ops import copy_blocks, gather_blocks, scatter_blocks
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
    "EngineClosedError",
    "AllRanks",
    "LayerwiseLoads",
    "wait_layer",
    "dma",
]
