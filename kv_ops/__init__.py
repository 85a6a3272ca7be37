"""kv_ops: KV-cache blocks between GPU memory and page-locked host memory, as compile-safe ops.

Where each piece lives, by floor (a module imports only the floors below it):

The CUDA floor, ``kv_ops/cuda/``, at the bottom: what both kv_ops and ple_ops stand on
(:mod:`kv_ops.cuda` lists it). ple_ops imports it by the public names in each module's
``__all__`` only, so what the modules keep private may change freely.

The op floor (``kv_ops/*.py``): what a ``torch.ops.kv_ops`` copy needs, and nothing above it.

* ``reference``     -- pure-torch copies: the CPU path and the test oracle.
* ``geometry``      -- ``KVCacheTensorSpec``, ``resolve_regions``, ``infer_regions``: cache tensors
                       to block-strided byte regions ``[num_blocks, block_bytes]``.
* ``validation``    -- eager checks, ``set_id_checks``, the skipped-pair counter.
* ``region_tables`` -- the block-copy kernel's per-region tables, built once per region set.
* ``kernels``       -- the Triton block-copy kernel and its launchers (``BoundCopy``, ``GraphedCopy``).
* ``prefix_copy``   -- the Triton kernel that writes a slot's new positions back and loads the next
                       layer's written positions, lengths read on the GPU.
* ``layer_wait``    -- the layer-wise wait kernel: a captured step's stream held until a flag lands.
* ``ops``           -- ``torch.ops.kv_ops.copy_blocks / gather_blocks / scatter_blocks``.

The engine floor (``kv_ops/transfer/``): ordered, tracked transfers built on the ops;
:mod:`kv_ops.transfer` lists its modules. ``OffloadEngine``, ``LayerwiseLoads``, ``StepTransfers``
and ``wait_layer`` come from there.

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
from .transfer.block_file import BlockFile
from .transfer.closed import ClosedError, EngineClosedError
from .transfer.completion import AllRanks, Completed
from .transfer.engine import OffloadEngine
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
