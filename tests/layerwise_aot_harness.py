"""AOT save -> fresh-process load of a step that waits for layer-wise loads, for
compile_tests/kv_ops/transfer/test_layerwise.py.

    python -m layerwise_aot_harness save PATH DEVICE   # process A: aot_compile the Reader step, save
    python -m layerwise_aot_harness load PATH DEVICE   # process B: its own engine and loads, check

(from the repository root, with the root and tests/ on PYTHONPATH). Process B prints "MATCH" when
every layer read exactly the blocks B's own load put there, and each layer's wait ran once.
"""

import sys

import numpy as np
import torch
from layerwise_models import Reader, expected_reads, fill_mirror, make_caches

import kv_ops
import kv_ops.tools.aot

NAME = "aot-layerwise"  # what the saved graph carries; B makes its own instance of it


def step(model, h, read_ids):
    return model(h, read_ids)


def main(mode: str, path: str, device: str) -> None:
    # B uses other seeds: its caches and mirror hold other bytes, so a step that touched A's
    # tensors, or baked A's addresses in, cannot match.
    seed = 0 if mode == "save" else 7
    caches = make_caches(4, 16, device, seed=seed)
    engine = kv_ops.OffloadEngine(caches, 16, capacity_bytes=24 * 4 * 2 * 128, path="kernel")
    fill_mirror(engine, seed + 1)
    loads = kv_ops.LayerwiseLoads(engine, NAME)
    model = Reader(NAME, list(caches.values())).eval()
    h = torch.randn(2, 32, device=device)
    read_ids = torch.tensor([1, 6, 9, 13], device=device)
    with torch.no_grad():
        if mode == "save":
            kv_ops.tools.aot.compile_step(step, model, h, read_ids).save_compiled_function(path)
            return
        loaded = kv_ops.tools.aot.load_step(path)
        host_ids, gpu_ids = [20, 3, 11], [9, 13, 2]
        want = expected_reads(engine, model, host_ids, gpu_ids, read_ids)
        loads.start(host_ids, gpu_ids)
        _, reads = loaded(model, h, read_ids)
    if device == "cuda":
        torch.cuda.synchronize()
    same = all(torch.equal(r.cpu(), w) for r, w in zip(reads, want))
    counted = np.array_equal(loads.waits, [1, 1, 1, 1])
    print("MATCH" if same and counted else f"MISMATCH reads={same} waits={loads.waits.tolist()}", flush=True)
    engine.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
