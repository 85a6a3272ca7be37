"""kv_ops.StepTransfers and kv_ops.step_transfers, run eagerly: the bytes each step moves, what
it leaves alone, its ordering with the engine, and every refusal. Compile and capture are in
compile_tests."""

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from layerwise_models import fill_mirror, make_caches

import kv_ops
from kv_ops.transfer import step_transfers as step_mod

gpu = pytest.mark.gpu
DEVICES = ["cpu", pytest.param("cuda", marks=gpu)]
NUM_BLOCKS, HOST_BLOCKS = 16, 24


@contextlib.contextmanager
def setup(device, name, num_layers=3, seed=0, **kw):
    """Random caches, an engine with a random mirror, and its StepTransfers; closed however the test ends."""
    caches = make_caches(num_layers, NUM_BLOCKS, device, seed=seed)
    row = sum(2 * c[0, 0].nbytes for c in caches.values())
    engine = kv_ops.OffloadEngine(caches, NUM_BLOCKS, capacity_bytes=HOST_BLOCKS * row, path="kernel")
    fill_mirror(engine, seed + 1)
    transfers = kv_ops.StepTransfers(engine, name, **kw)
    try:
        yield engine, transfers, list(caches.values())
    finally:
        transfers.close()
        engine.close()


class State:
    """The cache and the mirror as the host sees them, copied; blocks read through regions
    inferred afresh (the engine's own views are not trusted here)."""

    def __init__(self, engine, caches):
        self.caches = {f"layer{i}": c.cpu().clone() for i, c in enumerate(caches)}
        self.regions = kv_ops.infer_regions(self.caches, NUM_BLOCKS)
        self.mirror = engine.mirror.cpu().clone()

    def gpu_block(self, b):
        return torch.cat([r[b] for r in self.regions.values()])

    def host_block(self, h):
        return self.mirror[h]  # a mirror row is every region's block side by side, in region order


def run_step(transfers, caches):
    kv_ops.step_transfers(transfers.name, caches)
    if caches[0].is_cuda:
        torch.cuda.synchronize()


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_stores_then_loads_the_staged_blocks_and_leaves_every_other_block(device):
    with setup(device, f"moves-{device}") as (engine, transfers, caches):
        before = State(engine, caches)
        stores, loads = ([3, 9, 0], [20, 1, 7]), ([5, 5, 11], [2, 14, 6])  # a host block may load twice
        transfers.stage(store=stores, load=loads)
        run_step(transfers, caches)
        after = State(engine, caches)
        for g, h in zip(*stores):
            assert torch.equal(after.host_block(h), before.gpu_block(g)), (g, h)
        for h, g in zip(*loads):
            assert torch.equal(after.gpu_block(g), before.host_block(h)), (h, g)
        for h in set(range(HOST_BLOCKS)) - set(stores[1]):
            assert torch.equal(after.host_block(h), before.host_block(h)), h
        for g in set(range(NUM_BLOCKS)) - set(loads[1]):
            assert torch.equal(after.gpu_block(g), before.gpu_block(g)), g
        assert transfers.staged == {"store": 3, "load": 3}


@pytest.mark.parametrize("device", DEVICES)
def test_stores_run_before_loads_so_a_block_can_be_swapped_out_and_in_within_one_step(device):
    with setup(device, f"order-{device}") as (engine, transfers, caches):
        before = State(engine, caches)
        # Block 4 goes to host 10 while host 12 comes into it; host 10's new bytes load into 8.
        transfers.stage(store=([4], [10]), load=([12, 10], [4, 8]))
        run_step(transfers, caches)
        after = State(engine, caches)
        assert torch.equal(after.host_block(10), before.gpu_block(4))
        assert torch.equal(after.gpu_block(4), before.host_block(12))
        assert torch.equal(after.gpu_block(8), before.gpu_block(4))


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_without_a_new_stage_moves_nothing(device):
    with setup(device, f"once-{device}") as (engine, transfers, caches):
        transfers.stage(store=([6], [3]), load=([8], [7]))
        run_step(transfers, caches)
        stored = State(engine, caches)
        for c in caches:  # new bytes in every GPU block, the stored one and the loaded one too
            c.copy_(torch.randint_like(c, -(2**31), 2**31 - 1))
        rewritten = State(engine, caches)
        run_step(transfers, caches)
        again = State(engine, caches)
        assert torch.equal(again.mirror, stored.mirror)
        assert all(torch.equal(again.caches[k], rewritten.caches[k]) for k in again.caches)


@pytest.mark.parametrize("device", DEVICES)
def test_an_empty_stage_leaves_the_last_one_and_a_later_stage_follows_its_step(device):
    with setup(device, f"empty-{device}") as (engine, transfers, caches):
        before = State(engine, caches)
        transfers.stage(store=([1], [2]))
        transfers.stage(store=([], []), load=None)  # nothing to move: no wait, no overwrite
        run_step(transfers, caches)
        transfers.stage(load=([2], [9]))
        run_step(transfers, caches)
        after = State(engine, caches)
        assert torch.equal(after.host_block(2), before.gpu_block(1))
        assert torch.equal(after.gpu_block(9), before.gpu_block(1))


def test_staging_again_before_a_step_read_the_last_ids_is_refused_and_keeps_them():
    with setup("cpu", "twice") as (engine, transfers, caches):
        before = State(engine, caches)
        transfers.stage(store=([5], [0]))
        with pytest.raises(RuntimeError, match=r"staged last were not read by a step .*kv_ops.step_transfers\('twice'"):
            transfers.stage(store=([6], [1]))
        run_step(transfers, caches)
        after = State(engine, caches)
        assert torch.equal(after.host_block(0), before.gpu_block(5))
        assert torch.equal(after.host_block(1), before.host_block(1))
        assert transfers.staged == {"store": 1, "load": 0}


BAD_STAGES = [
    (dict(store=[1, 2]), r"store gpu_ids must be a flat sequence of ids, got int"),
    (dict(store=[1, 2, 3]), r"store must be a pair \(gpu_ids, host_ids\), got \[1, 2, 3\]"),
    (dict(load=([1], [2], [3])), r"load must be a pair \(host_ids, gpu_ids\)"),
    (dict(store="ab"), r"store must be a pair"),
    (dict(store=([1, 2], [3])), r"store has 2 gpu_ids but 1 host_ids"),
    (dict(load=([1], [2, 3])), r"load has 1 host_ids but 2 gpu_ids"),
    (dict(store=([NUM_BLOCKS], [0])), rf"store gpu_ids.*{NUM_BLOCKS}"),
    (dict(store=([0], [HOST_BLOCKS])), rf"store host_ids.*{HOST_BLOCKS}"),
    (dict(store=([-1], [0])), r"store gpu_ids.*-1"),
    (dict(store=([0, 1], [4, 4])), r"store host_ids names block 4 more than once"),
    (dict(load=([0, 1], [4, 4])), r"load gpu_ids names block 4 more than once"),
    (dict(load=([0.5], [1])), r"load host_ids"),
    (dict(load=([0], [True])), r"load gpu_ids"),
    (dict(store=(torch.zeros(1, 2, dtype=torch.int64), [0])), r"store gpu_ids"),
    (dict(store=(list(range(5)), list(range(5)))), r"store has 5 pairs, more than capacity=4"),
    # A valid store with a bad load: refused whole, the store not staged either.
    (dict(store=([1], [1]), load=([1], [99])), r"load gpu_ids.*99"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("kwargs", "message"), BAD_STAGES)
def test_bad_stages_are_refused_before_anything_is_staged(device, kwargs, message):
    with setup(device, f"bad-{device}", capacity=4) as (engine, transfers, caches):
        before = State(engine, caches)
        with pytest.raises(ValueError, match=message):
            transfers.stage(**kwargs)
        run_step(transfers, caches)
        after = State(engine, caches)
        assert torch.equal(after.mirror, before.mirror)
        assert all(torch.equal(after.caches[k], before.caches[k]) for k in after.caches)
        assert transfers.staged == {"store": 0, "load": 0}
        transfers.stage(store=([2], [3]))  # and the next good stage is taken
        run_step(transfers, caches)
        assert torch.equal(State(engine, caches).host_block(3), before.gpu_block(2))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(name=""), r"name must be a non-empty string, got ''"),
        (dict(name=7), r"name must be a non-empty string, got 7"),
        (dict(capacity=0), r"capacity must be a positive integer, got 0"),
        (dict(capacity=-3), r"capacity must be a positive integer, got -3"),
        (dict(capacity=2.0), r"capacity must be a positive integer, got 2.0"),
        (dict(capacity=True), r"capacity must be a positive integer, got True"),
        (dict(capacity="8"), r"capacity must be a positive integer, got '8'"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    caches = make_caches(2, NUM_BLOCKS, "cpu")
    with kv_ops.OffloadEngine(caches, NUM_BLOCKS, capacity_bytes=1 << 20) as engine:
        with pytest.raises(ValueError, match=message):
            kv_ops.StepTransfers(engine, **{"name": "bad-args", **kwargs})
        with pytest.raises(ValueError, match=r"no StepTransfers named 'bad-args'"):
            step_mod.lookup("bad-args")


def test_a_taken_name_a_disk_engine_an_engine_with_groups_and_a_closed_engine_are_refused(tmp_path):
    caches = make_caches(2, NUM_BLOCKS, "cpu")
    with setup("cpu", "taken"):
        with kv_ops.OffloadEngine(caches, NUM_BLOCKS, capacity_bytes=1 << 20) as engine:
            with pytest.raises(ValueError, match=r"the name 'taken' is taken"):
                kv_ops.StepTransfers(engine, "taken")
    with kv_ops.OffloadEngine(caches, NUM_BLOCKS, capacity_bytes=1 << 20, disk_dir=str(tmp_path)) as engine:
        with pytest.raises(ValueError, match=r"keeps its blocks on disk"):
            kv_ops.StepTransfers(engine, "disk")
    groups = {"a": ["layer0"], "b": ["layer1"]}
    with kv_ops.OffloadEngine(caches, NUM_BLOCKS, capacity_bytes=1 << 20, groups=groups) as engine:
        with pytest.raises(ValueError, match=r"made with groups \('a', 'b'\)"):
            kv_ops.StepTransfers(engine, "groups")
    engine = kv_ops.OffloadEngine(caches, NUM_BLOCKS, capacity_bytes=1 << 20)
    engine.close()
    with pytest.raises(kv_ops.EngineClosedError):
        kv_ops.StepTransfers(engine, "closed")
    for name in ("disk", "groups", "closed"):  # none of the refused ones took its name
        with pytest.raises(ValueError, match=rf"no StepTransfers named '{name}'"):
            step_mod.lookup(name)


def test_the_op_refuses_no_caches_some_caches_copies_one_twice_and_an_unknown_name():
    with setup("cpu", "op-args") as (engine, transfers, caches):
        transfers.stage(store=([1], [1]))
        with pytest.raises(ValueError, match=r"needs the cache tensors the transfers write, got 0"):
            kv_ops.step_transfers("op-args", [])
        with pytest.raises(ValueError, match=r"needs the 3 cache tensors its engine was made over, themselves, got 2"):
            kv_ops.step_transfers("op-args", caches[:2])
        with pytest.raises(ValueError, match=r"some are not \(copies: compile the step with Inductor"):
            kv_ops.step_transfers("op-args", [c.clone() for c in caches])
        # One left out for another twice: the one left out would not be declared mutated.
        with pytest.raises(
            ValueError, match=r"got 3 tensors of which one is passed twice and another left out \(each cache once\)"
        ):
            kv_ops.step_transfers("op-args", [caches[0], caches[0], caches[2]])
        with pytest.raises(ValueError, match=r"no StepTransfers named 'nobody' in this process \(live: 'op-args'\)"):
            kv_ops.step_transfers("nobody", caches)
        with pytest.raises(ValueError, match=r"kv_ops.step_transfers: name must be a non-empty string, got 5"):
            kv_ops.step_transfers(5, caches)
        with pytest.raises(
            ValueError,
            match=r"kv_ops.step_transfers: caches must be a list of tensors, got a torch.\w+ tensor of shape",
        ):
            kv_ops.step_transfers("op-args", caches[0])
        # The engine's mapping of caches: named by its type, not by printing every cache's values.
        with pytest.raises(
            ValueError, match=r"caches must be a list of tensors, got dict with 3 entries; pass its tensors"
        ) as info:
            kv_ops.step_transfers("op-args", {f"layer{i}": c for i, c in enumerate(caches)})
        assert "tensor(" not in str(info.value) and len(str(info.value)) < 200
        before = State(engine, caches)
        run_step(transfers, caches)  # the refusals read nothing: the stage is still there
        assert torch.equal(State(engine, caches).host_block(1), before.gpu_block(1))


def test_an_engine_whose_layers_share_a_tensor_takes_its_caches_as_it_lists_them():
    # Two layer names over one tensor (a model that shares a layer's cache): the step is handed
    # every listed cache, the shared one twice, in the engine's order or another.
    caches = make_caches(2, NUM_BLOCKS, "cpu", seed=5)
    caches["alias"] = caches["layer0"]
    row = sum(2 * c[0, 0].nbytes for c in list(caches.values())[:2])
    with kv_ops.OffloadEngine(caches, NUM_BLOCKS, capacity_bytes=HOST_BLOCKS * row, path="kernel") as engine:
        fill_mirror(engine, 6)
        listed = list(caches.values())
        for order, name in ((listed, "shared-a"), (listed[::-1], "shared-b")):
            transfers = kv_ops.StepTransfers(engine, name)
            try:
                gpu = 3 if name == "shared-a" else 8
                transfers.stage(store=([gpu], [4]))
                kv_ops.step_transfers(name, order)
                regions = kv_ops.infer_regions(dict(list(caches.items())[:2]), NUM_BLOCKS)
                host = engine.mirror.view(HOST_BLOCKS, -1)[4]
                assert torch.equal(host, torch.cat([r[gpu] for r in regions.values()]))
                with pytest.raises(ValueError, match=r"needs the 3 cache tensors .*got 2 tensors$"):
                    kv_ops.step_transfers(name, listed[:2])
            finally:
                transfers.close()


def test_close_drops_the_name_and_what_was_staged():
    with setup("cpu", "closing") as (engine, transfers, caches):
        before = State(engine, caches)
        transfers.stage(store=([2], [5]))
        transfers.close()
        with pytest.raises(RuntimeError, match=r"'closing' was closed"):
            transfers.stage(store=([2], [5]))
        with pytest.raises(
            kv_ops.ClosedError,
            match=r"^StepTransfers: 'closing' was closed \(close\(\) was called\); make a new StepTransfers$",
        ):
            with transfers:
                pytest.fail("entered a closed StepTransfers")
        with pytest.raises(ValueError, match=r"no StepTransfers named 'closing'"):
            kv_ops.step_transfers("closing", caches)
        with kv_ops.StepTransfers(engine, "closing") as again:  # the name is free again
            run_step(again, caches)
        assert torch.equal(State(engine, caches).mirror, before.mirror)


def test_closing_the_engine_drops_what_was_staged_and_refuses_further_stages():
    with setup("cpu", "engine-closed") as (engine, transfers, caches):
        before = State(engine, caches)
        mirror = engine.mirror
        transfers.stage(store=([1], [1]), load=([2], [3]))
        engine.close()
        with pytest.raises(kv_ops.EngineClosedError):
            transfers.stage(store=([1], [1]))
        kv_ops.step_transfers("engine-closed", caches)  # a step after the close moves nothing
        assert torch.equal(mirror, before.mirror)
        assert all(torch.equal(c, before.caches[f"layer{i}"]) for i, c in enumerate(caches))


# --- GPU only ------------------------------------------------------------------------------------


@gpu
def test_gpu_ids_on_the_gpu_are_refused_because_they_are_written_on_the_host():
    with setup("cuda", "gpu-ids") as (_, transfers, _caches):
        with pytest.raises(ValueError, match=r"store gpu_ids is a cuda:0 tensor; the ids are written on the host"):
            transfers.stage(store=(torch.tensor([1], device="cuda"), [1]))


@gpu
def test_staging_during_a_capture_is_refused():
    with setup("cuda", "captured-stage") as (_, transfers, _caches):
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        with torch.cuda.stream(stream):
            with pytest.raises(RuntimeError, match=r"StepTransfers.stage: .*stage before the replay"):
                with torch.cuda.graph(graph):
                    transfers.stage(store=([1], [1]))


@gpu
def test_the_step_runs_after_the_engines_transfers_in_flight():
    # An engine load into block 5, held back behind a GPU sleep on another stream, then a step
    # that stores block 5: the stage orders the step after the engine's load, so the stored
    # bytes are the loaded ones, not block 5's old bytes.
    with setup("cuda", "after-engine") as (engine, transfers, caches):
        before = State(engine, caches)
        busy = torch.cuda.Stream()
        with torch.cuda.stream(busy):
            torch.cuda._sleep(200_000_000)
        engine.load([7], [5], after=busy)
        transfers.stage(store=([5], [8]))
        run_step(transfers, caches)
        assert not engine.flush().failed
        after = State(engine, caches)
        assert torch.equal(after.host_block(8), before.host_block(7))
        assert torch.equal(after.gpu_block(5), before.host_block(7))


@gpu
def test_a_stage_waits_for_the_step_still_queued_behind_gpu_work(monkeypatch):
    with setup("cuda", "queued") as (engine, transfers, caches):
        before = State(engine, caches)
        transfers.stage(store=([3], [4]))
        torch.cuda._sleep(200_000_000)  # the step below runs only after this
        kv_ops.step_transfers("queued", caches)
        transfers.stage(load=([4], [11]))  # waits until that step has read the store's ids
        run_step(transfers, caches)
        after = State(engine, caches)
        assert torch.equal(after.host_block(4), before.gpu_block(3))
        assert torch.equal(after.gpu_block(11), before.gpu_block(3))
        # And with no step at all, the wait ends in an error after the timeout.
        monkeypatch.setattr(step_mod, "STAGE_TIMEOUT_S", 0.2)
        transfers.stage(store=([1], [1]))
        with pytest.raises(RuntimeError, match=r"not read by a step within 0.2 s"):
            transfers.stage(store=([2], [2]))


# --- property ------------------------------------------------------------------------------------

pairs = st.integers(0, 4).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=n, max_size=n),  # sources may repeat
        st.lists(st.integers(0, HOST_BLOCKS - 1), min_size=n, max_size=n, unique=True),
    )
)
steps = st.lists(st.tuples(pairs, pairs, st.booleans()), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(steps=steps)
def test_any_sequence_of_stages_and_steps_moves_what_a_copy_in_order_would(steps):
    # Each step: stage its stores (GPU -> host) and loads (host -> GPU, the host ids as sources,
    # the GPU ids, distinct, as destinations), or stage nothing; then the step. The oracle copies
    # stores then loads, block by block, in pure torch over its own copy of the bytes.
    with setup("cpu", "property") as (engine, transfers, caches):
        want = State(engine, caches)
        for (store_gpu, store_host), (load_gpu_pool, load_host), stage in steps:
            load_gpu = list(dict.fromkeys(load_gpu_pool))  # destinations distinct
            load_host = load_host[: len(load_gpu)]
            if stage:
                transfers.stage(store=(store_gpu, store_host), load=(load_host, load_gpu))
                for g, h in zip(store_gpu, store_host):
                    want.mirror[h] = want.gpu_block(g)
                for h, g in zip(load_host, load_gpu):
                    row, at = want.mirror[h], 0
                    for region in want.regions.values():
                        region[g] = row[at : at + region.shape[1]]
                        at += region.shape[1]
            kv_ops.step_transfers("property", caches)
        got = State(engine, caches)
        assert torch.equal(got.mirror, want.mirror)
        assert all(torch.equal(got.caches[k], want.caches[k]) for k in got.caches)
