"""kv_ops under torch.compile(fullgraph=True): no graph break, and the bytes really move.

The module stores cache blocks to a host mirror and loads mirror blocks back in one graph,
with the load reading blocks that the store just wrote, so the test also sees whether compile
kept the two ops in program order. Every assertion is on bytes, never on "it compiled".
"""

import pytest
import torch
from byte_checks import assert_same_storages, clone_views, random_bytes

import kv_ops
from kv_ops import reference

gpu = pytest.mark.gpu


class BlockMover(torch.nn.Module):
    """Stores blocks of the cache regions to the mirror, then loads mirror blocks into the cache."""

    def __init__(self, cache: list[torch.Tensor], mirror: list[torch.Tensor]):
        super().__init__()
        # Buffers, so that compile treats them as static graph inputs that may be mutated.
        self.num_regions = len(cache)
        for i, (c, m) in enumerate(zip(cache, mirror)):
            self.register_buffer(f"cache{i}", c, persistent=False)
            self.register_buffer(f"mirror{i}", m, persistent=False)

    def regions(self, kind: str) -> list[torch.Tensor]:
        return [getattr(self, f"{kind}{i}") for i in range(self.num_regions)]

    def forward(self, store_src, store_dst, load_src, load_dst):
        kv_ops.copy_blocks(self.regions("cache"), self.regions("mirror"), store_src, store_dst)
        kv_ops.copy_blocks(self.regions("mirror"), self.regions("cache"), load_src, load_dst)


def make_mover(device: str, mirror_on_host: bool, seed: int = 0):
    """A 3-layer cache in the three inferable layouts, and a mirror of 48 blocks per region."""
    gen = torch.Generator().manual_seed(seed)
    kv = {
        "kv_first": torch.randint(-99, 99, (2, 32, 4, 2, 16), generator=gen).to(device, torch.bfloat16),
        "mla": torch.randint(-99, 99, (32, 4, 24), generator=gen).to(device, torch.float16),
        "blocks_first": torch.randint(-99, 99, (32, 2, 4, 5), generator=gen).to(device, torch.float32),
    }
    cache = list(kv_ops.infer_regions(kv, 32).values())
    mirror = []
    for region in cache:
        width = region.shape[1]
        if mirror_on_host:
            # Page-locked host memory seen by the graph as a CUDA tensor (device_view), so that
            # CUDA-graph trees accept it.
            host = kv_ops.pinned_empty((48, width))
            host.copy_(random_bytes(host.shape, generator=gen))
            mirror.append(kv_ops.device_view(host))
        else:
            mirror.append(random_bytes((48, width), device, gen))
    return BlockMover(cache, mirror)


def step_ids(gen, device):
    """Store 6 cache blocks into 6 mirror slots; load 3 of those slots plus 2 older ones."""
    store_src = torch.randperm(32, generator=gen)[:6]
    store_dst = torch.randperm(48, generator=gen)[:6]
    load_src = torch.cat([store_dst[:3], torch.randperm(48, generator=gen)[:2]]).unique()
    load_dst = torch.tensor(
        [b for b in torch.randperm(32, generator=gen).tolist() if b not in store_src][: len(load_src)]
    )
    return [t.to(device) for t in (store_src, store_dst, load_src, load_dst)]


def expected_after(mover, ids):
    both = clone_views(mover.regions("cache") + mover.regions("mirror"))
    cache, mirror = both[: mover.num_regions], both[mover.num_regions :]
    store_src, store_dst, load_src, load_dst = [t.cpu() for t in ids]
    reference.copy_blocks(cache, mirror, store_src, store_dst)
    reference.copy_blocks(mirror, cache, load_src, load_dst)
    return both


def run_steps(mover, compiled, device, steps=4):
    gen = torch.Generator().manual_seed(123)
    for _ in range(steps):
        # Fresh cache contents each step, as the forward pass would write.
        for c in mover.regions("cache"):
            c.copy_(random_bytes(c.shape, device, gen))
        ids = step_ids(gen, device)
        want = expected_after(mover, ids)
        compiled(*ids)
        if device == "cuda":
            torch.cuda.synchronize()
        assert_same_storages(mover.regions("cache") + mover.regions("mirror"), want)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fullgraph_compile_moves_the_bytes_on_cpu(backend):
    torch._dynamo.reset()
    mover = make_mover("cpu", mirror_on_host=False)
    compiled = torch.compile(mover, backend=backend, fullgraph=True)
    run_steps(mover, compiled, "cpu")


def test_inductor_mutates_regions_in_place_without_copying_them():
    # Regions are independent buffers to compile (infer_regions gives each its own storage), so
    # Inductor can hand them to the op as they are. Were they views of one storage, it would
    # clone and copy back the mutated ones on every call: a KV cache's worth of bytes per step.
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    mover = make_mover("cpu", mirror_on_host=False)
    ids = step_ids(torch.Generator().manual_seed(9), "cpu")
    want = expected_after(mover, ids)
    _, (code, *_) = run_and_get_code(torch.compile(mover, backend="inductor", fullgraph=True), *ids)
    assert_same_storages(mover.regions("cache") + mover.regions("mirror"), want)
    calls = [line for line in code.splitlines() if "kv_ops.copy_blocks.default(" in line]
    assert len(calls) == 2, code
    assert "clone" not in code and "reinterpret_tensor(buf" not in code, code


@gpu
@pytest.mark.parametrize("mirror_on_host", [False, True], ids=["gpu-mirror", "host-mirror"])
def test_fullgraph_compile_moves_the_bytes_on_gpu(mirror_on_host):
    torch._dynamo.reset()
    mover = make_mover("cuda", mirror_on_host)
    compiled = torch.compile(mover, backend="inductor", fullgraph=True)
    run_steps(mover, compiled, "cuda")


@gpu
def test_reduce_overhead_records_a_cuda_graph_and_replays_it():
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    torch._dynamo.reset()
    counters.clear()
    mover = make_mover("cuda", mirror_on_host=True)
    compiled = torch.compile(mover, mode="reduce-overhead", fullgraph=True)
    with kv_ops.id_checks(False):  # the hot-path setting; a host sync would also be legal here
        run_steps(mover, compiled, "cuda", steps=6)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    # The tree manager holds the recorded graph: the steps above replayed it, not eager kernels.
    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    assert manager is not None and sum(len(nodes) for nodes in manager.roots.values()) >= 1


FIRST_USE = r"""
import torch, kv_ops
from torch._dynamo.utils import counters
from torch._inductor import cudagraph_trees

gen = torch.Generator().manual_seed(5)
cache = kv_ops.infer_regions({"l": torch.randint(-9, 9, (2, 24, 4, 2, 16), generator=gen).to("cuda", torch.float16)}, 24)
regions = list(cache.values())
mirror = [kv_ops.device_view(kv_ops.pinned_empty((24, r.shape[1]))) for r in regions]
packed = torch.empty(4, kv_ops.block_bytes(regions), dtype=torch.uint8, device="cuda")

class Step(torch.nn.Module):
    # Buffers: cudagraph trees skip graphs that mutate inputs that are not static (module buffers).
    def __init__(self):
        super().__init__()
        for i, (r, m) in enumerate(zip(regions, mirror)):
            self.register_buffer(f"r{i}", r, persistent=False)
            self.register_buffer(f"m{i}", m, persistent=False)
        self.register_buffer("packed", packed, persistent=False)

    def forward(self, src, dst, ids):
        cache, host = [self.r0, self.r1], [self.m0, self.m1]
        kv_ops.copy_blocks(cache, host, src, dst)              # first-ever copy_blocks of this process
        kv_ops.gather_blocks(host, dst[:4], self.packed)       # first-ever gather_blocks
        kv_ops.scatter_blocks(self.packed, ids, cache)         # first-ever scatter_blocks

compiled = torch.compile(Step(), mode="reduce-overhead", fullgraph=True)
with torch.no_grad(), kv_ops.id_checks(False):
    for step in range(5):
        for r in regions:
            r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8, generator=gen).cuda())
        src, dst = torch.randperm(24, generator=gen)[:6], torch.randperm(24, generator=gen)[:6]
        ids = torch.randperm(24, generator=gen)[:4]
        want_mirror = [r[src].clone() for r in regions]
        compiled(src.cuda(), dst.cuda(), ids.cuda())
        torch.cuda.synchronize()
        for r, m, w in zip(regions, mirror, want_mirror):
            assert torch.equal(m[dst.cuda()], w), f"step {step}: copy_blocks did not move the bytes"
            assert torch.equal(r[ids.cuda()], w[:4]), f"step {step}: gather + scatter did not move the bytes"
assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
assert manager is not None and sum(len(v) for v in manager.roots.values()) >= 1
print("FIRST USE OK")
"""


@gpu
def test_first_ever_call_of_every_op_is_legal_inside_reduce_overhead():
    # In a fresh process nothing is cached yet: the region tables and the skipped-pair counter
    # are made during cudagraph trees' warm-up, and must not land in the graph's pool.
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [sys.executable, "-c", FIRST_USE], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0 and "FIRST USE OK" in result.stdout, result.stderr[-4000:]
