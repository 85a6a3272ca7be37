"""AOT save -> fresh-process load for kv_ops, for compile_tests/kv_ops/tools/test_aot.py.

    python -m kv_aot_harness save PATH DEVICE   # process A: aot_compile a store+load step, save
    python -m kv_aot_harness load PATH DEVICE   # process B: fresh tensors and mirrors, load, check

(from the repository root, with the root and tests/ on PYTHONPATH). Process B prints "MATCH"
when the loaded step moved exactly the bytes the reference moves on B's own tensors.
"""

import sys

import torch

import kv_ops
from kv_ops import reference


def step(c0, c1, m0, m1, store_src, store_dst, load_src, load_dst):
    """Store cache blocks to the mirror, then load mirror blocks back, in one graph."""
    kv_ops.copy_blocks([c0, c1], [m0, m1], store_src, store_dst)
    kv_ops.copy_blocks([m0, m1], [c0, c1], load_src, load_dst)
    return c0.sum(dtype=torch.int64) + c1.sum(dtype=torch.int64)


def tensors(device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    kv = {"layer": torch.randint(-99, 99, (2, 16, 8, 32), generator=gen).to(device, torch.float16)}
    cache = list(kv_ops.infer_regions(kv, 16).values())
    mirror = []
    for region in cache:
        host = kv_ops.pinned_empty((24, region.shape[1]))
        host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8, generator=gen))
        mirror.append(kv_ops.device_view(host) if device == "cuda" else host)
    ids = [torch.tensor(v, device=device) for v in ([1, 5, 9], [0, 7, 20], [7, 3], [12, 14])]
    return cache, mirror, ids


def main(mode: str, path: str, device: str) -> None:
    if hasattr(torch._dynamo.config, "enable_aot_compile"):
        torch._dynamo.config.enable_aot_compile = True  # needed on torch <= 2.11
    # B uses another seed: its tensors hold other bytes, so a step that touched anything but
    # B's own tensors, or replayed A's copies, cannot match the reference.
    cache, mirror, ids = tensors(device, seed=0 if mode == "save" else 1)
    if mode == "save":
        compiled = torch.compile(step, fullgraph=True).aot_compile(((*cache, *mirror, *ids), {}))
        compiled.save_compiled_function(path)
        return
    with open(path, "rb") as f:
        loaded = torch.compiler.load_compiled_function(f)
    want = [t.clone() for t in cache + mirror]
    reference.copy_blocks(want[:2], want[2:], ids[0], ids[1])
    reference.copy_blocks(want[2:], want[:2], ids[2], ids[3])
    loaded(*cache, *mirror, *ids)
    if device == "cuda":
        torch.cuda.synchronize()
    same = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(cache + mirror, want))
    print("MATCH" if same else "MISMATCH", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
