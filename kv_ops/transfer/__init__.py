"""kv_ops.transfer: the engine floor, ordered and tracked block transfers built on the op floor.

Where each piece lives (each imports only the op floor, ``kv_ops/*.py``, and the modules above it here):

* ``dma``         -- copy plans for the copy engines and their launch (one batched driver call).
* ``ids``         -- the engine's id intake (checked in numpy) and ``Pool`` (what the GPU reads).
* ``blocks``      -- one transfer (``Direction``, ``Blocks``) and the completion events and streams paths share.
* ``staging_ring`` -- ``StagingRing``: the staged paths' shared GPU ring, streams and slot events.
* ``staged``      -- ``StagedPath``: gather into a GPU ring, then the copy engines.
* ``paths``       -- the path contract ``TransferPath``, the zero-copy kernel and direct-DMA paths, and
                     the registry of the three mirror paths (re-exports ``blocks`` and ``staged``).
* ``crossover``   -- what ``path="auto"`` measured on the engine's own shape, and its pick.
* ``block_file``  -- ``BlockFile``: the disk tier's private file of block slots (aligned, O_DIRECT).
* ``disk``        -- ``DiskTier`` and ``DiskPath``: the disk tier's I/O and its engine path.
* ``closed``      -- ``ClosedError``: what every object here raises once closed.
* ``completion``  -- ``Completed`` (what a poll reports), each direction's ``Lane``, ``AllRanks``.
* ``groups``      -- KV-cache groups: which regions' bytes each group of an engine moves.
* ``engine_arguments`` -- the engine's arguments, checked before anything is allocated; ``PATHS``.
* ``routes``      -- the engine's host mirror or disk tier, and per group the paths it may take.
* ``ordering``    -- the event a transfer is ordered after (``after=``, or the caller's stream).
* ``sides``       -- store and load: what differs between them (``Side``), and their one docstring.
* ``engine``      -- ``OffloadEngine``: ordered, tracked stores and loads to a packed host mirror.
* ``host_blocks`` -- ``HostBlockAllocator``: which host blocks are free, handed out in runs (best fit).
* ``in_step``     -- the names every step op carries, the one per-layer wait ``torch.ops.kv_ops.wait_layer``,
                     and the memory a captured step keeps reading: what the three below share.
* ``layerwise``   -- ``LayerwiseLoads``: loads the host issues before the step, waited for layer by layer.
* ``layerwise_ring`` -- the staged mechanism of ``LayerwiseLoads``: a GPU ring and a scatter per layer.
* ``slot_loads``  -- ``SlotLoads`` and ``torch.ops.kv_ops.prefetch_layer``: layers sharing GPU slots, each
                     loaded by the step itself while an earlier layer computes (the transformers cache).
* ``step_transfers`` -- ``StepTransfers`` and the op ``torch.ops.kv_ops.step_transfers``: stores and
                     loads a captured step runs at its start, from ids staged in page-locked memory.
"""
