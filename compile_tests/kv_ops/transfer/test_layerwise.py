"""kv_ops.wait_layer under opcheck, torch.compile(fullgraph=True), CUDA-graph capture and AOT reload.

Every assertion is on the bytes each layer read, on the waits that ran, or on where the compiler
put them; never on "it compiled".
"""

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from layerwise_models import Reader, expected_reads, fill_mirror, make_caches

import kv_ops
from kv_ops.transfer import layerwise

gpu = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[3]
DEVICES = ["cpu", pytest.param("cuda", marks=gpu)]


COPIES = ["kernel", "dma", "staged"]


@contextlib.contextmanager
def setup(device, name, num_layers=4, num_blocks=32, host_blocks=48, seed=0, copies="kernel", **caches_kw):
    """An engine over random caches, its LayerwiseLoads and a Reader model; closed however the test ends."""
    caches = make_caches(num_layers, num_blocks, device, seed=seed, **caches_kw)
    row = sum(c[0].nbytes if caches_kw.get("blocks_first") else 2 * c[0, 0].nbytes for c in caches.values())
    engine = kv_ops.OffloadEngine(caches, num_blocks, capacity_bytes=host_blocks * row, path="kernel")
    fill_mirror(engine, seed + 1)
    model = Reader(name, list(caches.values()), blocks_first=caches_kw.get("blocks_first", False)).eval()
    loads = kv_ops.LayerwiseLoads(engine, name, copies=copies)
    try:
        yield engine, loads, model
    finally:
        loads.close()
        engine.close()


def new_pairs(gen, engine, n):
    host = torch.randperm(engine.num_host_blocks, generator=gen)[:n].tolist()
    gpu_ids = torch.randperm(engine.num_blocks, generator=gen)[:n].tolist()
    return host, gpu_ids


def same_reads(got, want) -> bool:
    return all(torch.equal(g.cpu(), w) for g, w in zip(got, want))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_wait_layer(device):
    with setup(device, f"opcheck-{device}") as (engine, loads, model):
        h = torch.randn(2, 32, device=device)
        torch.library.opcheck(torch.ops.kv_ops.wait_layer.default, ([model.caches()[2]], h, loads.name, 2))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("blocks_first", [False, True], ids=["kv-first", "blocks-first"])
def test_a_compiled_step_waits_every_layer_and_reads_the_loaded_blocks(backend, blocks_first):
    torch._dynamo.reset()
    with setup("cpu", f"compiled-{backend}-{blocks_first}", blocks_first=blocks_first) as (engine, loads, model):
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        gen = torch.Generator().manual_seed(5)
        for step in range(1, 4):
            host, gpu_ids = new_pairs(gen, engine, 6)
            read_ids = torch.tensor(gpu_ids[:3] + [b for b in range(32) if b not in gpu_ids][:2])
            want = expected_reads(engine, model, host, gpu_ids, read_ids)
            loads.start(host, gpu_ids)
            _, reads = compiled(torch.randn(2, 32), read_ids)
            assert same_reads(reads, want)
            assert np.array_equal(loads.waits, [step] * 4)  # every wait kept, once per call


def test_inductor_keeps_each_wait_after_the_previous_layer_and_before_its_own_work():
    # A wait tied to nothing is hoisted to the top of the graph, and then no load is hidden.
    # Each wait takes the layer's input and declares the layer's cache mutated: the generated
    # code must run wait 0, layer 0's matmul, wait 1, layer 1's matmul, ..., and read a cache
    # only after its wait, without cloning any cache.
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    with setup("cpu", "order") as (engine, loads, model):
        loads.start([1, 2], [3, 4])
        _, (code, *_) = run_and_get_code(torch.compile(model, fullgraph=True), torch.randn(2, 32), torch.tensor([3, 5]))
        body = code.split("def call(self, args):", 1)[1]
        lines = [line for line in body.splitlines() if "= args" not in line]
        events = [
            ("wait" if "kv_ops.wait_layer.default(" in line else "mm")
            for line in lines
            if "kv_ops.wait_layer.default(" in line or "extern_kernels.mm(" in line
        ]
        assert events == ["wait", "mm"] * 4, code
        for i in range(4):
            wait_at = next(n for n, line in enumerate(lines) if f"'{loads.name}', {i})" in line)
            cache_arg = lines[wait_at].split("wait_layer.default([", 1)[1].split("]", 1)[0]
            uses = re.compile(rf"\b{cache_arg}\b")
            readers = [
                n
                for n, line in enumerate(lines)
                if uses.search(line) and "assert_size_stride" not in line and "del " not in line and n != wait_at
            ]
            assert readers and min(readers) > wait_at, code
        assert "clone" not in code, code


def run_harness(*args):
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    )
    result = subprocess.run(
        [sys.executable, "-m", "layerwise_aot_harness", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"{args[0]} failed ({result.returncode}):\n{result.stdout}\n{result.stderr[-4000:]}"
    return result.stdout


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_loaded_in_a_fresh_process_waits_on_that_process_loads(tmp_path, device):
    path = str(tmp_path / "layerwise.aot")
    run_harness("save", path, device)
    loaded = run_harness("load", path, device)
    assert "MATCH" in loaded.splitlines(), loaded


# --- captured ----------------------------------------------------------------------------------


class Captured:
    """The compiled Reader step captured in a torch.cuda.CUDAGraph, with static inputs."""

    def __init__(self, model, num_reads: int):
        self.h = torch.randn(2, 32, device="cuda")
        self.read_ids = torch.zeros(num_reads, dtype=torch.int64, device="cuda")
        compiled = torch.compile(model, fullgraph=True)
        for _ in range(2):  # compile, then warm up
            compiled(self.h, self.read_ids)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out, self.reads = compiled(self.h, self.read_ids)

    def replay(self, read_ids) -> list[torch.Tensor]:
        self.read_ids.copy_(read_ids)
        self.graph.replay()
        return [r.clone() for r in self.reads]  # stream-ordered: after the replay


def cpu_state(model):
    return [c.cpu().clone() for c in model.caches()]


@gpu
@pytest.mark.parametrize("copies", COPIES)
def test_captured_step_replays_with_new_loads_each_equal_to_load_then_step(copies):
    torch._dynamo.reset()
    with setup("cuda", f"captured-{copies}", num_blocks=64, host_blocks=96, copies=copies) as (engine, loads, model):
        step = Captured(model, 12)
        gen = torch.Generator().manual_seed(11)
        for _ in range(4):
            host, gpu_ids = new_pairs(gen, engine, 24)
            read_ids = torch.tensor(gpu_ids[:8] + [b for b in range(64) if b not in gpu_ids][:4])
            # Load-then-step: the same load, flushed, then the same reads, eagerly.
            want = expected_reads(engine, model, host, gpu_ids, read_ids)
            loads.start(host, gpu_ids)
            got = step.replay(read_ids.cuda())
            torch.cuda.synchronize()
            assert same_reads(got, want)
        assert len(engine.flush().loads) == 4
        waits = loads.waits.copy()
        step.replay(read_ids.cuda())
        assert np.array_equal(loads.waits, waits)  # a replay runs no host code


@gpu
@pytest.mark.parametrize("copies", COPIES)
def test_blocks_held_back_behind_a_gpu_sleep_are_still_read_after_they_land(copies):
    torch._dynamo.reset()
    with setup("cuda", f"late-{copies}", num_blocks=256, host_blocks=256, copies=copies) as (engine, loads, model):
        step = Captured(model, 64)
        gen = torch.Generator().manual_seed(12)
        side = torch.cuda.Stream()
        for delay in (0, 5_000_000, 50_000_000):
            host, gpu_ids = new_pairs(gen, engine, 128)
            read_ids = torch.tensor(gpu_ids[:64])
            want = expected_reads(engine, model, host, gpu_ids, read_ids)
            # The copies wait behind a sleep on another stream; the replay is launched at once.
            with torch.cuda.stream(side):
                torch.cuda._sleep(delay)
                late = torch.cuda.Event()
                late.record(side)
            loads.start(host, gpu_ids, after=late)
            got = step.replay(read_ids.cuda())
            torch.cuda.synchronize()
            assert same_reads(got, want), f"a layer read before its blocks landed (delay {delay} cycles)"


@gpu
@pytest.mark.parametrize("copies", COPIES)
def test_queued_steps_never_deadlock_and_a_load_waits_for_the_previous_steps_readers(copies):
    # Five steps queued without a host sync, each replay held back by a GPU sleep, each start
    # loading into blocks the previous replay reads: the start must wait for those readers
    # (WAR), and no replay may wait for a later start (which writes the generation behind it).
    torch._dynamo.reset()
    with setup("cuda", f"queued-{copies}", num_blocks=64, host_blocks=96, copies=copies) as (engine, loads, model):
        step = Captured(model, 16)
        gen = torch.Generator().manual_seed(13)
        state = cpu_state(model)
        expected, got = [], []
        read_ids = torch.randperm(64, generator=gen)[:16]
        for _ in range(5):
            host = torch.randperm(96, generator=gen)[:16].tolist()
            gpu_ids = read_ids.tolist()  # exactly the blocks the previous step reads
            regions = kv_ops.infer_regions({f"layer{i}": c for i, c in enumerate(state)}, 64)
            for name, region in regions.items():
                region[torch.tensor(gpu_ids)] = engine.mirror_regions[name][torch.tensor(host)]
            expected.append([model.read(c, read_ids) for c in state])
            loads.start(host, gpu_ids)
            torch.cuda._sleep(2_000_000)
            got.append(step.replay(read_ids.cuda()))
            read_ids = read_ids[torch.randperm(16, generator=gen)]
        torch.cuda.synchronize()
        for g, w in zip(got, expected):
            assert same_reads(g, w)


@gpu
@pytest.mark.parametrize("copies", COPIES)
def test_a_replay_without_a_new_start_does_not_hang_and_reads_the_blocks_as_they_are(copies):
    torch._dynamo.reset()
    with setup("cuda", f"no-start-{copies}", copies=copies) as (engine, loads, model):
        step = Captured(model, 8)
        read_ids = torch.randperm(32)[:8]
        loads.start(*new_pairs(torch.Generator().manual_seed(2), engine, 8))
        step.replay(read_ids.cuda())
        torch.cuda.synchronize()
        want = [model.read(c, read_ids).cpu() for c in cpu_state(model)]
        got = step.replay(read_ids.cuda())  # no start since the last replay
        loads.start([], [])  # zero blocks: records nothing
        got_empty = step.replay(read_ids.cuda())
        torch.cuda.synchronize()
        assert same_reads(got, want) and same_reads(got_empty, want)


@gpu
def test_a_captured_wait_whose_layer_never_lands_gives_up_after_its_timeout_and_counts_it(monkeypatch):
    # No start leaves a layer unpublished (each writes every layer's landed flag), so this
    # backstop is forced: the generation the step waits for is raised past every landed one, as
    # a copy that never came would leave it.
    default = layerwise.WAIT_TIMEOUT_S
    timeout = 0.05
    monkeypatch.setattr(layerwise, "WAIT_TIMEOUT_S", timeout)
    with setup("cuda", "timeout") as (engine, loads, model):
        h = torch.randn(2, 32, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i, cache in enumerate(model.caches()):
                kv_ops.wait_layer(h, loads.name, i, [cache])
        loads.start(*new_pairs(torch.Generator().manual_seed(3), engine, 4))
        graph.replay()
        torch.cuda.synchronize()
        before = kv_ops.error_count("cuda")  # process-wide: the test compares differences
        loads._flags[0] += 5  # on the current stream, before the replay
        t0 = time.monotonic()
        graph.replay()
        torch.cuda.synchronize()
        took = time.monotonic() - t0
        # The waits ran out the timeout the loads were made with (one after the other on the
        # stream: at least one whole timeout of GPU time, which a loaded host never shortens), not
        # the module's default, which a wait that kept the default would run out first.
        assert timeout <= took < default, f"the waits that never saw their layer land took {took:.3f} s"
        assert kv_ops.error_count("cuda") - before == loads.num_layers  # one per layer
        loads._flags[0] -= 5
        graph.replay()  # reached again: no wait gives up
        torch.cuda.synchronize()
        assert kv_ops.error_count("cuda") - before == loads.num_layers
