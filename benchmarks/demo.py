"""The main job: offload KV-cache blocks to page-locked host memory and back, checked byte for
byte; on a GPU, also a short bandwidth table against the contiguous pinned memcpy. Runs on the
CPU implementation where there is no CUDA device. Exits non-zero if a byte differs.

Usage: python benchmarks/demo.py
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch

import kv_ops


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if not cuda:
        warnings.simplefilter("ignore")  # pinned_empty says once that it falls back to plain memory
    gen = torch.Generator().manual_seed(0)
    num_blocks, host_blocks = 256, 128

    # A small model's cache: 4 layers, K/V-first, 16 tokens per block, 8 KV heads of 128, bf16.
    kv_caches = {
        f"model.layers.{i}.self_attn": torch.randn(2, num_blocks, 16, 8, 128, generator=gen).to(device, torch.bfloat16)
        for i in range(4)
    }
    regions = kv_ops.infer_regions(kv_caches, num_blocks)
    mirror = {name: kv_ops.pinned_empty((host_blocks, r.shape[1])) for name, r in regions.items()}
    print(
        f"device {device}: {len(regions)} regions of {next(iter(regions.values())).shape[1]} bytes per block, "
        f"host mirror {sum(m.numel() for m in mirror.values()) / 2**20:.0f} MiB"
    )

    # Store 64 blocks, load them back into 64 other blocks, compare.
    gpu_ids = torch.randperm(num_blocks, generator=gen)
    stored, restored = gpu_ids[:64], gpu_ids[64:128]
    host_ids = torch.randperm(host_blocks, generator=gen)[:64]
    before = {name: r[stored].clone() for name, r in regions.items()}
    kv_ops.copy_blocks(regions, mirror, stored.to(device), host_ids.to(device))
    kv_ops.copy_blocks(mirror, regions, host_ids.to(device), restored.to(device))
    if cuda:
        torch.cuda.synchronize()
    ok = all(torch.equal(regions[n][restored], before[n]) for n in regions)
    print(f"store 64 blocks -> host, load back into 64 other blocks: {'bytes match' if ok else 'MISMATCH'}")

    # Gather into one packed host buffer (what goes to disk or network), scatter back.
    packed = kv_ops.pinned_empty((64, kv_ops.block_bytes(regions)))
    kv_ops.gather_blocks(regions, stored.to(device), packed)
    back = gpu_ids[128:192]
    kv_ops.scatter_blocks(packed, back.to(device), regions)
    if cuda:
        torch.cuda.synchronize()
    ok2 = all(torch.equal(regions[n][back], before[n]) for n in regions)
    print(
        f"gather 64 blocks into one {packed.shape[1]}-byte-per-row host buffer, scatter back: "
        f"{'bytes match' if ok2 else 'MISMATCH'}"
    )
    if not (ok and ok2):
        sys.exit(1)

    if cuda:
        from block_copy import Setup
        from common import time_graph  # this script's own directory

        kv_ops.set_id_checks(False)
        print("\n| block | direction | memcpy GB/s | copy_blocks GB/s | ratio |\n| ---: | --- | ---: | ---: | ---: |")
        for block in (1024, 4096, 65536):
            s = Setup(block, 2048, gen)
            for d2h in (True, False):
                base, kernel = time_graph(s.memcpy(d2h)), time_graph(s.op(d2h))
                total = block * 2048
                print(
                    f"| {block // 1024} KiB | {'GPU->host' if d2h else 'host->GPU'} | {total / base / 1e9:.1f} | "
                    f"{total / kernel / 1e9:.1f} | {base / kernel:.2f} |"
                )
    else:
        print("no CUDA device: the copies above ran on the CPU implementation; no bandwidth table")


if __name__ == "__main__":
    main()
