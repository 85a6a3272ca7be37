"""kv_ops.transfer: the engine floor, ordered and tracked block transfers built on the op floor.

Where each piece lives (each imports only the op floor, ``kv_ops/*.py``, and the modules above it here):

* ``dma``       -- copy plans for the copy engines and their launch (one batched driver call).
* ``ids``       -- the engine's id intake (checked in numpy) and ``Pool`` (what the GPU reads).
* ``blocks``    -- one transfer (``Direction``, ``Blocks``) and the completion events and streams paths share.
* ``staged``    -- ``StagedPath``: gather into a GPU ring, then the copy engines.
* ``paths``     -- the path contract ``TransferPath``, the zero-copy kernel and direct-DMA paths, and
                   the registry of the three mirror paths (re-exports ``blocks`` and ``staged``).
* ``crossover`` -- what ``path="auto"`` measured on the engine's own shape, and its pick.
* ``disk``      -- ``BlockFile``, ``DiskTier`` and ``DiskPath``: the disk tier's file, its I/O, its engine path.
* ``engine``    -- ``OffloadEngine``: ordered, tracked stores and loads to a packed host mirror.
* ``layerwise`` -- ``LayerwiseLoads`` and the op ``torch.ops.kv_ops.wait_layer`` (defined here:
                   it resolves its name to a ``LayerwiseLoads``, so it cannot live on the op floor).
* ``layerwise_ring`` -- the staged mechanism of ``LayerwiseLoads``: a GPU ring and a scatter per layer.
* ``step_transfers`` -- ``StepTransfers`` and the op ``torch.ops.kv_ops.step_transfers``: stores and
                   loads a captured step runs at its start, from ids staged in page-locked memory.
"""
