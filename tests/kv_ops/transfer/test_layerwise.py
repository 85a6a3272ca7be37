"""kv_ops.LayerwiseLoads and kv_ops.wait_layer, eagerly: the bytes each layer reads, the engine's
bookkeeping, and every refusal. Compile, capture and AOT reload are in compile_tests."""

import gc

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from layerwise_models import Reader, expected_reads, fill_mirror, make_caches

import kv_ops
from kv_ops.transfer import layerwise, layerwise_ring
from kv_ops.transfer.layerwise import pick_copies

gpu = pytest.mark.gpu


COPIES = ["kernel", "dma", "staged", "auto"]


def make(device, num_layers=3, num_blocks=16, capacity_blocks=24, name="lw", seed=0, copies="kernel", **kw):
    caches = make_caches(num_layers, num_blocks, device, seed=seed)
    row = sum(c[0, 0].nbytes * 2 for c in caches.values())
    engine = kv_ops.OffloadEngine(caches, num_blocks, capacity_bytes=capacity_blocks * row, path="kernel")
    fill_mirror(engine, seed + 1)
    return engine, kv_ops.LayerwiseLoads(engine, name, copies=copies, **kw), Reader(name, list(caches.values()))


@pytest.fixture(params=COPIES)
def cpu_setup(request):
    # Every mechanism, so that each refusal and each lifecycle rule holds for each.
    engine, loads, model = make("cpu", copies=request.param)
    yield engine, loads, model
    loads.close()
    engine.close()


def assert_reads(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g.cpu(), w), f"layer {i} read other bytes"


def test_each_layer_reads_the_loaded_blocks_and_the_engine_reports_the_load(cpu_setup):
    engine, loads, model = cpu_setup
    host_ids, gpu_ids = [5, 0, 17, 9], [3, 11, 4, 12]
    read_ids = torch.tensor([4, 3, 7, 12])  # loaded blocks, and 7, which keeps its bytes
    want = expected_reads(engine, model, host_ids, gpu_ids, read_ids)
    tid = loads.start(host_ids, gpu_ids)
    _, reads = model(torch.randn(2, 32), read_ids)
    assert_reads(reads, want)
    assert np.array_equal(loads.waits, [1, 1, 1])
    assert engine.flush().loads == [tid]
    assert engine.path_counts["layerwise"] == 1


def test_default_layers_follow_the_engines_cache_tensors(cpu_setup):
    engine, loads, _ = cpu_setup
    assert loads.layers == [[f"layer{i}.0", f"layer{i}.1"] for i in range(3)]
    assert loads.num_layers == 3


def test_a_start_with_no_blocks_moves_nothing_and_is_still_a_transfer(cpu_setup):
    engine, loads, model = cpu_setup
    before = [c.clone() for c in model.caches()]
    tid = loads.start([], [])
    model(torch.randn(2, 32), torch.tensor([0, 1]))
    assert all(torch.equal(a, b) for a, b in zip(before, model.caches()))
    assert engine.flush().loads == [tid]


def test_layerwise_and_plain_loads_share_the_engines_transfer_ids_in_issue_order(cpu_setup):
    engine, loads, _ = cpu_setup
    a = engine.load([1], [2])
    b = loads.start([3], [2])  # the same destination: the later load wins
    c = engine.store([5], [7])
    done = engine.flush()
    assert done.loads == [a, b] and done.stores == [c]
    assert torch.equal(engine.regions["layer0.0"][2], engine.mirror_regions["layer0.0"][3])


@pytest.mark.parametrize(
    "host_ids, gpu_ids, message",
    [
        ([24], [0], r"LayerwiseLoads.start: host_ids\[0\] = 24 is outside \[0, 24\)"),
        ([0], [16], r"gpu_ids\[0\] = 16 is outside \[0, 16\)"),
        ([0, 1], [3, 3], r"gpu_ids names block 3 more than once"),
        ([0, 1], [3], r"1 gpu_ids but 2 host_ids"),
        ([0.5], [1], r"host_ids"),
        ([-1], [1], r"host_ids\[0\] = -1"),
    ],
)
def test_bad_ids_are_refused_before_any_byte_moves(cpu_setup, host_ids, gpu_ids, message):
    engine, loads, model = cpu_setup
    before = [c.clone() for c in model.caches()]
    with pytest.raises(ValueError, match=message):
        loads.start(host_ids, gpu_ids)
    assert all(torch.equal(a, b) for a, b in zip(before, model.caches()))
    assert engine.flush().loads == []  # no transfer id was used up


def test_a_wait_needs_a_live_name_a_layer_in_range_and_a_cache(cpu_setup):
    engine, loads, model = cpu_setup
    h, caches = torch.randn(2, 32), model.caches()
    with pytest.raises(
        ValueError, match=r"no LayerwiseLoads or HostOffloadedCache named 'other' in this process \(live: .*'lw'"
    ):
        kv_ops.wait_layer(h, "other", 0, [caches[0]])
    with pytest.raises(ValueError, match=r"layer 3 is not a layer of 'lw' \(0\.\.2\)"):
        kv_ops.wait_layer(h, "lw", 3, [caches[0]])
    with pytest.raises(ValueError, match=r"kv_ops.wait_layer: layer must be an integer >= 0, got -1"):
        kv_ops.wait_layer(h, "lw", -1, [caches[0]])
    # The wrong types a slip gives: each named, where the op's schema would raise its own error
    # (or take True for layer 1, and a tensor for its rows).
    for args, message in [
        ((h, "lw", True, [caches[1]]), "layer must be an integer >= 0, got True"),
        ((h, "lw", 1.0, [caches[1]]), "layer must be an integer >= 0, got 1.0"),
        ((h, 5, 1, [caches[1]]), "name must be a non-empty string, got 5"),
        ((1.0, "lw", 1, [caches[1]]), r"dep must be a tensor \(the layer's input\), got 1.0"),
        ((h, "lw", 1, caches[1]), r"caches must be a list of tensors, got a torch.\w+ tensor of shape \("),
    ]:
        with pytest.raises(ValueError, match=f"kv_ops.wait_layer: {message}"):
            kv_ops.wait_layer(*args)
    with pytest.raises(ValueError, match=r"at least one cache tensor"):
        kv_ops.wait_layer(h, "lw", 0, [])
    assert kv_ops.wait_layer(h, "lw", 1, [caches[1]]) is h
    assert np.array_equal(loads.waits, [0, 1, 0])  # only the wait that passed its checks counted


def test_a_name_is_taken_until_close_and_a_closed_instance_refuses_to_start(cpu_setup):
    engine, loads, _ = cpu_setup
    with pytest.raises(ValueError, match=r"the name 'lw' is taken"):
        kv_ops.LayerwiseLoads(engine, "lw")
    loads.close()
    with pytest.raises(ValueError, match=r"'lw' was closed"):
        loads.start([0], [0])
    with pytest.raises(kv_ops.ClosedError, match=r"^LayerwiseLoads: 'lw' was closed"):
        with loads:  # entering it fails as a call does, not at the first call inside
            pytest.fail("entered a closed LayerwiseLoads")
    again = kv_ops.LayerwiseLoads(engine, "lw")  # the name is free again
    again.close()


@pytest.mark.parametrize("copies", ["DMA", None, "ring"])
def test_an_unknown_copy_mechanism_is_refused(cpu_setup, copies):
    engine, _, _ = cpu_setup
    with pytest.raises(ValueError, match=r"copies must be one of 'auto', 'dma', 'kernel', 'staged', got"):
        kv_ops.LayerwiseLoads(engine, "copies", copies=copies)


@pytest.mark.parametrize("ring_bytes", [0, -1, 2.5, True, "big", None])
def test_a_bad_ring_size_is_refused_by_name(cpu_setup, ring_bytes):
    engine, _, _ = cpu_setup
    with pytest.raises(ValueError, match=rf"ring_bytes must be a positive integer, got {ring_bytes!r}"):
        kv_ops.LayerwiseLoads(engine, "ring", copies="staged", ring_bytes=ring_bytes)
    kv_ops.LayerwiseLoads(engine, "ring", copies="staged", ring_bytes=1).close()  # the name was not taken


@pytest.mark.parametrize("name", ["", None, 3])
def test_a_name_must_be_a_non_empty_string(cpu_setup, name):
    engine, _, _ = cpu_setup
    with pytest.raises(ValueError, match=r"name must be a non-empty string"):
        kv_ops.LayerwiseLoads(engine, name)


@pytest.mark.parametrize(
    "layers, message",
    [
        ([["layer0.0", "layer0.1"], ["nope"]], r"layers\[1\] names 'nope', not a region"),
        (
            [["layer0.0", "layer0.1", "layer1.0"], ["layer1.0", "layer1.1", "layer2.0", "layer2.1"]],
            r"'layer1.0' is in two",
        ),
        ([["layer0.0", "layer0.1"]], r"regions \['layer1.0', .*\] are in no layer"),
        ([], r"non-empty sequence"),
        ("layer0.0", r"non-empty sequence"),
        ([[]], r"layers\[0\] must be a non-empty list"),
    ],
)
def test_bad_layer_groups_are_refused(cpu_setup, layers, message):
    engine, _, _ = cpu_setup
    with pytest.raises(ValueError, match=message):
        kv_ops.LayerwiseLoads(engine, "groups", layers=layers)


def test_explicit_layers_may_group_regions_as_the_model_visits_them(cpu_setup):
    engine, _, model = cpu_setup
    names = list(engine.regions)
    with kv_ops.LayerwiseLoads(engine, "two", layers=[names[:4], names[4:]]) as two:
        two.start([1, 2], [5, 6])
        caches = model.caches()
        kv_ops.wait_layer(torch.zeros(1), "two", 0, caches[:2])
        kv_ops.wait_layer(torch.zeros(1), "two", 1, caches[2:])
        for n in names:
            assert torch.equal(engine.regions[n][[5, 6]], engine.mirror_regions[n][[1, 2]])
    engine.flush()


def test_a_cross_layer_region_cannot_be_split_into_layers():
    # Two layers' tensors back to back in one storage become one region named after the first.
    backing = torch.randint(0, 99, (8, 2, 16), dtype=torch.int32)
    caches = {"a": backing[:, 0], "b": backing[:, 1]}
    engine = kv_ops.OffloadEngine(caches, 8, capacity_bytes=1 << 16)
    try:
        assert list(engine.regions) == ["a"]
        with pytest.raises(ValueError, match=r"cache 'b' has no region of its own"):
            kv_ops.LayerwiseLoads(engine, "cross")
    finally:
        engine.close()


def test_a_disk_engine_and_a_closed_engine_are_refused(tmp_path):
    caches = make_caches(2, 8, "cpu")
    engine = kv_ops.OffloadEngine(caches, 8, capacity_bytes=1 << 20, disk_dir=str(tmp_path))
    try:
        with pytest.raises(ValueError, match=r"keeps its blocks on disk"):
            kv_ops.LayerwiseLoads(engine, "disk")
    finally:
        engine.close()
    with pytest.raises(kv_ops.EngineClosedError):
        kv_ops.LayerwiseLoads(engine, "closed")


def test_start_on_a_closed_engine_raises_engine_closed(cpu_setup):
    engine, loads, _ = cpu_setup
    engine.close()
    with pytest.raises(kv_ops.EngineClosedError):
        loads.start([0], [0])


@settings(max_examples=40, deadline=None)
@given(
    num_layers=st.integers(1, 5),
    num_blocks=st.integers(3, 12),  # 2 blocks would make a K/V axis ambiguous to infer_regions
    tokens=st.integers(1, 3),
    width=st.sampled_from([1, 3, 8]),
    blocks_first=st.booleans(),
    copies=st.sampled_from(COPIES),
    slot_rows=st.integers(1, 13),  # staged: a ring slot of this many rows (chunks of that many pairs)
    data=st.data(),
)
def test_any_layer_count_block_count_and_layout_reads_the_mirrors_rows(
    num_layers, num_blocks, tokens, width, blocks_first, copies, slot_rows, data
):
    seed = data.draw(st.integers(0, 2**16))
    caches = make_caches(
        num_layers, num_blocks, "cpu", tokens=tokens, width=width, seed=seed, blocks_first=blocks_first
    )
    row = 2 * num_layers * tokens * width * 4
    host_blocks = data.draw(st.integers(1, 20))
    engine = kv_ops.OffloadEngine(caches, num_blocks, capacity_bytes=host_blocks * row)
    fill_mirror(engine, seed + 1)
    name = f"prop{seed}"
    ring = 4 * slot_rows * 2 * tokens * width * 4  # SLOTS slots of slot_rows rows of one layer
    try:
        with kv_ops.LayerwiseLoads(engine, name, copies=copies, ring_bytes=ring) as loads:
            n = data.draw(st.integers(0, min(num_blocks, host_blocks)))
            gpu_ids = data.draw(st.permutations(range(num_blocks)))[:n]
            if data.draw(st.booleans()):  # host ids in runs, which the staged copies move 2-D
                first = data.draw(st.integers(0, host_blocks - n))
                cut = data.draw(st.integers(0, n))
                host_ids = list(range(first + cut, first + n)) + list(range(first, first + cut))
            else:
                host_ids = data.draw(st.lists(st.integers(0, host_blocks - 1), min_size=n, max_size=n))
            model = Reader(name, list(caches.values()), hidden=4, blocks_first=blocks_first)
            read_ids = torch.arange(num_blocks)
            want = expected_reads(engine, model, host_ids, gpu_ids, read_ids)
            loads.start(host_ids, gpu_ids)
            _, reads = model(torch.randn(1, 4), read_ids)
            assert_reads(reads, want)
    finally:
        engine.close()


# --- copies="auto" ------------------------------------------------------------------------------


def runs_of(lengths, gap=3, start=0):
    """Host ids in runs of the given lengths, each run ``gap`` ids after the last."""
    ids, at = [], start
    for n in lengths:
        ids += range(at, at + n)
        at += n + gap
    return np.array(ids, dtype=np.int64)


def test_pick_copies_takes_the_kernel_under_the_minimum_whatever_the_ids():
    n = layerwise.STAGED_MIN_BLOCKS - 1
    assert pick_copies(runs_of([n]), pieces=1) == "kernel"
    assert pick_copies(np.arange(0), pieces=1) == "kernel"


def test_pick_copies_takes_the_staged_copies_for_a_large_run_and_the_kernel_for_random_ids():
    n = layerwise.STAGED_MIN_BLOCKS
    assert pick_copies(runs_of([n]), pieces=32) == "staged"
    assert pick_copies(list(range(5, 5 + n)), pieces=32) == "staged"  # a list, as a user may pass
    assert pick_copies(runs_of([4 * n]), pieces=32) == "staged"
    random = np.random.default_rng(1).permutation(4 * n).astype(np.int64)
    assert pick_copies(random, pieces=32) == "kernel"  # 32 layers of one piece each


def test_pick_copies_estimates_the_staged_host_time_from_the_runs_and_the_pieces():
    budget = layerwise.STAGED_HOST_BUDGET_US
    # Runs of RUN_2D or more are one 2-D copy per piece each: the pick turns at the budget.
    runs, long = int(budget // layerwise._US_PER_2D_COPY), layerwise_ring.RUN_2D
    assert pick_copies(runs_of([long] * runs), pieces=1) == "staged"
    assert pick_copies(runs_of([long] * (runs + 1)), pieces=1) == "kernel"
    assert pick_copies(runs_of([long] * (runs // 2)), pieces=2) == "staged"
    assert pick_copies(runs_of([long] * (runs // 2 + 1)), pieces=2) == "kernel"
    # Runs one shorter are a descriptor per block and piece.
    blocks, short = int(budget // layerwise._US_PER_DESCRIPTOR), long - 1
    assert pick_copies(runs_of([short] * (blocks // short)), pieces=1) == "staged"
    assert pick_copies(runs_of([short] * (blocks // short + 1)), pieces=1) == "kernel"


def test_auto_on_the_cpu_moves_each_start_by_its_pick_and_every_layer_reads_the_mirror():
    n = layerwise.STAGED_MIN_BLOCKS
    # 12 layers: a random start of n blocks is 12 x n descriptors, past the staged host budget.
    engine, loads, model = make(
        "cpu", num_layers=12, num_blocks=n + 8, capacity_blocks=2 * n, name="lw-auto", copies="auto"
    )
    try:
        gen = torch.Generator().manual_seed(5)
        read_ids = torch.arange(n + 8)
        for host_ids, picked in (
            (list(range(7, 7 + n)), "staged"),
            (torch.randperm(2 * n, generator=gen)[:n].tolist(), "kernel"),
            (list(range(n, 2 * n)), "staged"),
            (torch.randperm(2 * n, generator=gen)[:16].tolist(), "kernel"),
        ):
            gpu_ids = torch.randperm(n + 8, generator=gen)[: len(host_ids)].tolist()
            want = expected_reads(engine, model, host_ids, gpu_ids, read_ids)
            before = dict(loads.starts)
            loads.start(host_ids, gpu_ids)
            assert loads.starts[picked] == before[picked] + 1, picked
            _, reads = model(torch.randn(1, 32), read_ids)
            assert_reads(reads, want)
        assert loads.starts == {"kernel": 2, "staged": 2}
        assert engine.path_counts["layerwise"] == 4
    finally:
        loads.close()
        engine.close()


# --- GPU ---------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("copies", COPIES)
def test_gpu_start_loads_every_layer_and_an_eager_forward_waits_for_it(copies):
    engine, loads, model = make("cuda", num_layers=4, num_blocks=64, capacity_blocks=96, name="lw-gpu", copies=copies)
    try:
        gen = torch.Generator().manual_seed(3)
        for _ in range(3):
            host_ids = torch.randperm(96, generator=gen)[:40].tolist()
            gpu_ids = torch.randperm(64, generator=gen)[:40].tolist()
            read_ids = torch.randperm(64, generator=gen)[:48].cuda()
            want = expected_reads(engine, model, host_ids, gpu_ids, read_ids)
            # Held back: the copies wait behind a GPU sleep on the caller's stream.
            torch.cuda._sleep(20_000_000)
            loads.start(host_ids, gpu_ids)
            _, reads = model(torch.randn(2, 32, device="cuda"), read_ids)
            assert_reads(reads, want)
        assert len(engine.flush().loads) == 3
    finally:
        loads.close()
        engine.close()


@gpu
@pytest.mark.parametrize("copies", COPIES)
@pytest.mark.parametrize("first", ["engine", "layerwise"])
def test_gpu_loads_into_one_block_land_in_issue_order_across_the_streams(copies, first):
    # The kernel copies run on a stream of their own. The first load is held back behind a GPU
    # sleep (after= a busy stream); the second is free to start at once (after= an idle stream).
    # Only the bridge between the streams keeps the second from landing first.
    engine, loads, _ = make("cuda", num_layers=2, name="lw-order", copies=copies)
    try:
        busy, idle = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(busy):
            torch.cuda._sleep(50_000_000)
        calls = {"engine": engine.load, "layerwise": loads.start}
        second = "layerwise" if first == "engine" else "engine"
        calls[first]([4], [7], after=busy)
        calls[second]([9], [7], after=idle)
        engine.flush()
        for name, region in engine.regions.items():
            assert torch.equal(region[7].cpu(), engine.mirror_regions[name][9]), f"{name}: the {first} load won"
    finally:
        loads.close()
        engine.close()


@gpu
def test_gpu_a_dma_start_whose_copy_call_fails_raises_and_the_next_start_loads():
    engine, loads, model = make("cuda", num_layers=3, name="lw-dma-fail", copies="dma")
    try:
        launch, calls = loads._launcher, []

        def failing(plan):
            calls.append(plan)
            if len(calls) == 2:  # layer 1: layer 0's copies went out, layers 1 and 2 never do
                raise RuntimeError("cuMemcpyBatchAsync failed: injected")
            launch(plan)

        loads._launcher = failing
        with pytest.raises(RuntimeError, match="injected"):
            loads.start([1, 2], [3, 4])
        loads._launcher = launch
        model(torch.randn(2, 32, device="cuda"), torch.tensor([3, 4], device="cuda"))
        torch.cuda.synchronize()  # returns: no wait was left behind a copy that never came
        assert engine.flush().loads == []  # the failed start was never a transfer
        host_ids, gpu_ids = [5, 9], [6, 3]
        read_ids = torch.tensor([6, 3, 4], device="cuda")
        want = expected_reads(engine, model, host_ids, gpu_ids, read_ids)
        later = loads.start(host_ids, gpu_ids)
        _, reads = model(torch.randn(2, 32, device="cuda"), read_ids)
        assert_reads(reads, want)
        assert engine.flush().loads == [later]
    finally:
        loads.close()
        engine.close()


@gpu
def test_gpu_auto_orders_a_start_after_the_last_one_when_its_pick_changes(monkeypatch):
    # Staged, kernel, staged, kernel starts, each staged one held back behind a GPU sleep and the
    # kernel one after it free to start at once, into some of the same GPU blocks. The staged
    # copies into the ring run at once (4 layers: every (layer, chunk) has a slot of its own),
    # only its scatters wait, and they publish on a stream of their own: just the engine's
    # ordering on a change of path keeps the kernel start's bytes and flags from landing first,
    # where the staged scatters would then overwrite them and set each layer's flag back (its
    # captured wait would give up and count an error).
    monkeypatch.setattr(layerwise, "WAIT_TIMEOUT_S", 2.0)  # read when the instance is made
    n = layerwise.STAGED_MIN_BLOCKS
    engine, loads, model = make(
        "cuda", num_layers=4, num_blocks=n + 8, capacity_blocks=3 * n, name="lw-auto-order", copies="auto"
    )
    try:
        h = torch.randn(2, 32, device="cuda")
        waits = torch.cuda.CUDAGraph()
        with torch.cuda.graph(waits):
            for i, cache in enumerate(model.caches()):
                kv_ops.wait_layer(h, loads.name, i, [cache])
        gen = torch.Generator().manual_seed(7)
        gpu_ids = torch.randperm(n + 8, generator=gen)[:n].tolist()
        runs = [list(range(n)), list(range(2 * n, 3 * n))]  # staged: n blocks in one run
        few = [torch.randperm(3 * n, generator=gen)[:16].tolist() for _ in range(2)]  # kernel: too few for staged
        read_ids = torch.tensor(gpu_ids[:16], device="cuda")
        want = expected_reads(engine, model, few[1], gpu_ids[:16], read_ids)
        busy, idle = torch.cuda.Stream(), torch.cuda.Stream()
        before = kv_ops.error_count("cuda")
        for held, free in zip(runs, few):
            with torch.cuda.stream(busy):
                torch.cuda._sleep(100_000_000)
            loads.start(held, gpu_ids, after=busy)
            loads.start(free, gpu_ids[:16], after=idle)
        waits.replay()
        torch.cuda.synchronize()
        assert kv_ops.error_count("cuda") == before, "a layer's flag went back: a wait gave up"
        assert loads.starts == {"kernel": 2, "staged": 2}
        # The caches read directly, not through the model's eager waits: a flag set back to an
        # older generation after the captured waits passed would hold an eager wait forever.
        assert_reads([model.read(c, read_ids) for c in model.caches()], want)
        assert len(engine.flush().loads) == 4
    finally:
        loads.close()
        engine.close()


@gpu
@pytest.mark.parametrize("copies", COPIES)
def test_gpu_ids_are_refused_because_the_copies_are_planned_on_the_host(copies):
    engine, loads, model = make("cuda", name="lw-gpu-ids", copies=copies)
    try:
        before = [c.clone() for c in model.caches()]
        with pytest.raises(ValueError, match=r"gpu_ids is a cuda:0 tensor, but path='layerwise' plans"):
            loads.start([1, 2], torch.tensor([3, 4], device="cuda"))
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(before, model.caches()))
    finally:
        loads.close()
        engine.close()


@gpu
def test_start_during_a_capture_is_refused():
    engine, loads, _ = make("cuda", name="lw-capture")
    try:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        # As torch.cuda.graph does before a capture: a CUDAGraph that earlier tests left to the
        # collector, torn down inside this global-mode capture, would invalidate it.
        gc.collect()
        with torch.cuda.stream(side):
            graph.capture_begin()
            try:
                with pytest.raises(
                    RuntimeError, match=r"LayerwiseLoads.start: a transfer cannot be captured.*before the replay"
                ):
                    loads.start([0], [0])
            finally:
                graph.capture_end()
    finally:
        loads.close()
        engine.close()


@gpu
def test_a_wait_with_a_cache_on_another_device_is_refused():
    engine, loads, model = make("cuda", name="lw-device")
    try:
        h = torch.randn(2, 32, device="cuda")
        with pytest.raises(ValueError, match=r"a cache of layer 1 is on cpu, but 'lw-device' loads into cuda:0"):
            kv_ops.wait_layer(h, "lw-device", 1, [model.caches()[1], torch.zeros(4)])
    finally:
        loads.close()
        engine.close()
