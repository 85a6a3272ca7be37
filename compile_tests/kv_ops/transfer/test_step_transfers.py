"""kv_ops.step_transfers under fake tensors, torch.compile(fullgraph=True) and CUDA-graph capture.

Every assertion is on the bytes the step moved and read, or on where the compiler put the op.
"""

import contextlib

import pytest
import torch
from layerwise_models import fill_mirror, make_caches
from torch import nn

import kv_ops

gpu = pytest.mark.gpu
NUM_BLOCKS, HOST_BLOCKS = 32, 48


class Mover(nn.Module):
    """A step that runs its staged transfers, then reads blocks ``read_ids`` of every cache (what
    attention would) and writes block ``write_id`` of each (what the step's new tokens would)."""

    def __init__(self, name: str, caches: list[torch.Tensor]):
        super().__init__()
        self.name, self.num_layers = name, len(caches)
        for i, c in enumerate(caches):
            self.register_buffer(f"cache{i}", c, persistent=False)

    def caches(self) -> list[torch.Tensor]:
        return [getattr(self, f"cache{i}") for i in range(self.num_layers)]

    def forward(self, read_ids: torch.Tensor, write_id: torch.Tensor, value: torch.Tensor):
        caches = self.caches()
        kv_ops.step_transfers(self.name, caches)
        reads = [c[:, read_ids] + 0 for c in caches]
        for c in caches:
            c.index_copy_(1, write_id, value.expand(2, 1, *c.shape[2:]))
        return reads


@contextlib.contextmanager
def setup(device, name, seed=0):
    caches = make_caches(3, NUM_BLOCKS, device, seed=seed)
    row = sum(2 * c[0, 0].nbytes for c in caches.values())
    engine = kv_ops.OffloadEngine(caches, NUM_BLOCKS, capacity_bytes=HOST_BLOCKS * row, path="kernel")
    fill_mirror(engine, seed + 1)
    transfers = kv_ops.StepTransfers(engine, name)
    try:
        yield engine, transfers, Mover(name, list(caches.values()))
    finally:
        transfers.close()
        engine.close()


class Oracle:
    """The cache and mirror on the CPU, moved by pure torch through regions inferred afresh."""

    def __init__(self, engine, model):
        self.caches = [c.cpu().clone() for c in model.caches()]
        self.regions = list(kv_ops.infer_regions({str(i): c for i, c in enumerate(self.caches)}, NUM_BLOCKS).values())
        self.mirror = engine.mirror.cpu().clone()
        self.columns = []
        at = 0
        for r in self.regions:
            self.columns.append(slice(at, at + r.shape[1]))
            at += r.shape[1]

    def step(self, store, load, read_ids, write_id, value):
        for g, h in zip(*store):
            for r, cols in zip(self.regions, self.columns):
                self.mirror[h, cols] = r[g]
        for h, g in zip(*load):
            for r, cols in zip(self.regions, self.columns):
                r[g] = self.mirror[h, cols]
        reads = [c[:, read_ids] for c in self.caches]
        for c in self.caches:
            c[:, write_id] = value
        return reads


def random_step(gen, device):
    """Stores from some GPU blocks to some host blocks, loads from others into others; reads of
    loaded, stored and untouched blocks; a written block that was just stored (freed)."""
    gpu_ids = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    host_ids = torch.randperm(HOST_BLOCKS, generator=gen).tolist()
    store = (gpu_ids[:4], host_ids[:4])
    load = (host_ids[4:9], gpu_ids[4:9])
    read_ids = torch.tensor([gpu_ids[4], gpu_ids[0], gpu_ids[12], gpu_ids[6]], device=device)
    write_id = torch.tensor([gpu_ids[0]], device=device)
    value = torch.randint(-(2**31), 2**31 - 1, (), dtype=torch.int32, generator=gen).to(device)
    return store, load, read_ids, write_id, value


def check(engine, model, oracle, reads, want):
    assert all(torch.equal(r.cpu(), w) for r, w in zip(reads, want)), "the step read other bytes"
    assert all(torch.equal(c.cpu(), o) for c, o in zip(model.caches(), oracle.caches)), "the cache differs"
    assert torch.equal(engine.mirror.cpu(), oracle.mirror), "the mirror differs"


def test_the_schema_declares_the_caches_written_and_the_fake_needs_no_instance():
    (caches,) = torch.ops.kv_ops.step_transfers.default._schema.arguments[:1]
    assert caches.alias_info is not None and caches.alias_info.is_write
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(c) for c in make_caches(2, 4, "cpu").values()]
        # A name no instance has: tracing (and AOT compiling) needs none.
        torch.ops.kv_ops.step_transfers.default(fakes, "nobody-traces")


def test_inductor_runs_the_transfers_every_step_before_the_caches_are_read_or_written():
    torch._dynamo.reset()
    with setup("cpu", "compiled") as (engine, transfers, model):
        compiled = torch.compile(model, fullgraph=True)
        gen = torch.Generator().manual_seed(3)
        for _ in range(3):
            store, load, *args = random_step(gen, "cpu")
            oracle = Oracle(engine, model)
            want = oracle.step(store, load, *args)
            transfers.stage(store=store, load=load)
            check(engine, model, oracle, compiled(*args), want)
        assert transfers.staged == {"store": 12, "load": 15}


def test_inductor_puts_the_op_first_and_clones_no_cache():
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    with setup("cpu", "order") as (engine, transfers, model):
        store, load, *args = random_step(torch.Generator().manual_seed(4), "cpu")
        transfers.stage(store=store, load=load)
        _, (code, *_) = run_and_get_code(torch.compile(model, fullgraph=True), *args)
        body = code.split("def call(self, args):", 1)[1]
        lines = [line for line in body.splitlines() if line.strip() and "= args" not in line]
        op_at = next(n for n, line in enumerate(lines) if "kv_ops.step_transfers.default(" in line)
        caches = lines[op_at].split("step_transfers.default([", 1)[1].split("]", 1)[0].replace(" ", "").split(",")
        for name in caches:
            uses = [n for n, line in enumerate(lines) if name in line.replace(" ", "") and n != op_at]
            uses = [n for n in uses if "assert_size_stride" not in lines[n] and "del " not in lines[n]]
            assert uses and min(uses) > op_at, code
        assert "clone" not in code, code


def test_a_backend_that_hands_the_op_copies_is_refused_rather_than_undoing_the_loads():
    torch._dynamo.reset()
    with setup("cpu", "aot-eager") as (engine, transfers, model):
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        store, load, *args = random_step(torch.Generator().manual_seed(5), "cpu")
        transfers.stage(store=store, load=load)
        with pytest.raises(ValueError, match=r"aot_eager hands the op copies and would undo its loads"):
            compiled(*args)


@gpu
def test_a_captured_step_runs_each_replays_staged_transfers_and_nothing_without_a_stage():
    torch._dynamo.reset()
    with setup("cuda", "captured") as (engine, transfers, model):
        errors = kv_ops.error_count("cuda")  # the process's counter: earlier tests may have counted
        gen = torch.Generator().manual_seed(6)
        store, load, read_ids, write_id, value = random_step(gen, "cuda")
        static = (read_ids.clone(), write_id.clone(), value.clone())
        compiled = torch.compile(model, fullgraph=True)
        for _ in range(2):  # compile, then warm up (nothing staged: nothing moves)
            compiled(*static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = compiled(*static)
        for step in range(4):
            store, load, *args = random_step(gen, "cuda")
            if step == 2:
                store, load = ([], []), ([], [])  # a replay with nothing staged
            oracle = Oracle(engine, model)
            want = oracle.step(store, load, *(a.cpu() for a in args))
            for s, a in zip(static, args):
                s.copy_(a)
            transfers.stage(store=store, load=load)
            graph.replay()
            torch.cuda.synchronize()
            check(engine, model, oracle, out, want)
        assert kv_ops.error_count("cuda") == errors
