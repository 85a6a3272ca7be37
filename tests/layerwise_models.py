"""A small model whose every layer waits for its layer-wise load, then reads its cache blocks and
computes: shared by tests/kv_ops/transfer/test_layerwise.py, compile_tests and the AOT harness."""

from __future__ import annotations

import torch
from torch import nn

import kv_ops


class Reader(nn.Module):
    """Layer i: ``h = wait_layer(h, name, i, caches[i])``, read the cache blocks ``read_ids`` of
    layer i (what attention would read), then ``h = tanh(h @ w_i)``.

    The caches are integer tensors, K/V-first ``[2, num_blocks, tokens, width]`` or blocks-first
    ``[num_blocks, 2, tokens, width]`` (``blocks_first``), registered as buffers so that compile
    treats them as mutable graph inputs. ``forward`` returns ``h`` and the blocks read, layer by
    layer, so a test compares them bitwise with what the mirror holds.
    """

    def __init__(self, name: str, caches: list[torch.Tensor], hidden: int = 32, seed: int = 0, blocks_first=False):
        super().__init__()
        self.name, self.num_layers, self.blocks_first = name, len(caches), blocks_first
        gen = torch.Generator().manual_seed(seed)
        for i, c in enumerate(caches):
            self.register_buffer(f"cache{i}", c, persistent=False)
            w = torch.randn(hidden, hidden, generator=gen) / hidden**0.5
            self.register_buffer(f"w{i}", w.to(c.device), persistent=False)

    def caches(self) -> list[torch.Tensor]:
        return [getattr(self, f"cache{i}") for i in range(self.num_layers)]

    def forward(self, h: torch.Tensor, read_ids: torch.Tensor):
        reads = []
        for i in range(self.num_layers):
            cache = getattr(self, f"cache{i}")
            h = kv_ops.wait_layer(h, self.name, i, [cache])
            reads.append(self.read(cache, read_ids))
            h = torch.tanh(h @ getattr(self, f"w{i}"))
        return h, reads

    def read(self, cache: torch.Tensor, read_ids: torch.Tensor) -> torch.Tensor:
        return cache[read_ids] if self.blocks_first else cache[:, read_ids]


def make_caches(
    num_layers: int, num_blocks: int, device, tokens: int = 4, width: int = 8, seed: int = 0, blocks_first=False
):
    """Random int32 caches, one tensor per layer (``layer{i}``), K/V-first or blocks-first."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, 2, tokens, width) if blocks_first else (2, num_blocks, tokens, width)
    return {
        f"layer{i}": torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, generator=gen).to(device)
        for i in range(num_layers)
    }


def fill_mirror(engine, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    engine.mirror.copy_(torch.randint(0, 256, engine.mirror.shape, dtype=torch.uint8, generator=gen))


def expected_reads(engine, model: Reader, host_ids, gpu_ids, read_ids) -> list[torch.Tensor]:
    """What each layer reads after a load of ``host_ids`` into ``gpu_ids``: the cache as it is,
    with the loaded blocks replaced by the mirror's rows (computed on clones, on the CPU, through
    regions inferred afresh: the engine's own are not trusted here)."""
    clones = {f"layer{i}": c.cpu().clone() for i, c in enumerate(model.caches())}
    host = torch.as_tensor(host_ids, dtype=torch.long)
    gpu = torch.as_tensor(gpu_ids, dtype=torch.long)
    for name, region in kv_ops.infer_regions(clones, engine.num_blocks).items():
        region[gpu] = engine.mirror_regions[name].cpu()[host]
    return [model.read(c, read_ids.cpu()) for c in clones.values()]
