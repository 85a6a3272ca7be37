"""The engine's three paths (kernel, staged, dma) move exactly the same bytes.

On the CPU every path runs synchronously through the plans the GPU runs (kv_ops.dma.run_on_host
executes them with memmove), so hypothesis drives byte-exact round trips through the engine over
random layouts: K/V-first, blocks-first, MLA and cross-layer tensors of mixed dtypes and block
sizes, ids in random order (sources repeating) or in runs, and a staged ring of 1 to 3 rows per
slot, so that transfers cross chunk boundaries and slots are reused across calls. The bytes are
read by plain indexing of the typed cache tensors, never through the engine's regions: a mirror
row must be every layer's block side by side in layer order (K before V), the mirror starts as
random bytes, and rows and blocks that no call addressed must keep theirs. Then: how many copies
the plans issue (one per run where the layout allows it), after= on a CPU engine, and that an
engine makes only the paths it may pick.

On the GPU (marker gpu): the same round trips, the staged ring reused under 100 back-to-back
store and load calls, after= with an event or a stream instead of the caller's stream (and not
a stream being captured), and the staged ring allocated with the engine rather than by its
first transfer.
"""

import inspect
import math
import time
import warnings
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from byte_checks import as_bytes
from hypothesis import example, given, settings
from hypothesis import strategies as st

import kv_ops
from kv_ops.transfer import dma, paths
from kv_ops.transfer import staged as staged_mod
from kv_ops.transfer.paths import RING_SLOTS, Blocks, Direction

gpu = pytest.mark.gpu
PATH_NAMES = ("kernel", "staged", "dma")
PATHS = pytest.mark.parametrize("path", PATH_NAMES)
KINDS = ("kv_first", "blocks_first", "mla", "cross_layer")
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int8)


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(-2, 3), st.integers(-2, 3)), min_size=1, max_size=40))
def test_the_run_count_auto_picks_by_is_the_number_of_runs_the_plans_merge(steps):
    # num_runs is counted apart from run_starts (fewer operations on every auto call); they must agree.
    gpu = torch.tensor([g for g, _ in steps]).cumsum(0) + 100
    host = torch.tensor([h for _, h in steps]).cumsum(0) + 100
    assert Blocks.of(Direction.LOAD, gpu, host).num_runs == dma.run_starts(gpu, host)[0].size


# --- layouts and their bytes, read through the typed tensors ---------------------------------------


@dataclass(frozen=True)
class Layer:
    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def layer_shape(kind, num_blocks, tokens, heads, dim, layers=2):
    return {
        "kv_first": (2, num_blocks, tokens, heads, dim),
        "blocks_first": (num_blocks, 2, tokens, heads, dim),  # K and V inside the block
        "mla": (num_blocks, tokens, dim),
        "cross_layer": (num_blocks, layers, 2, tokens, heads, dim),  # every layer in one block
    }[kind]


def random_typed(shape, dtype, gen, device="cpu"):
    """Random bytes (NaN and infinity patterns included) seen as ``dtype``."""
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).to(device)


def make_cache(layers, gen, device="cpu"):
    return {f"l{i}": random_typed(layer.shape, layer.dtype, gen, device) for i, layer in enumerate(layers)}


def block_row(kv, layers, g):
    """GPU block ``g`` as a mirror row: each layer's block in layer order, K then V for K/V-first."""
    parts = []
    for layer, t in zip(layers, kv.values()):
        parts += [t[0, g], t[1, g]] if layer.kind == "kv_first" else [t[g]]
    return torch.cat([as_bytes(p).cpu() for p in parts])


def cache_rows(kv, layers, num_blocks):
    return torch.stack([block_row(kv, layers, g) for g in range(num_blocks)])


def scramble(kv, gen):
    """The compute overwrites the whole cache with fresh random bytes."""
    for t in kv.values():
        t.copy_(random_typed(t.shape, t.dtype, gen, t.device))


def open_engine(kv, num_blocks, host_blocks, path, ring_rows=1):
    per_block = sum(t.numel() // num_blocks * t.element_size() for t in kv.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA: pinned_empty warns that it returns plain memory
        return kv_ops.OffloadEngine(
            kv,
            num_blocks,
            host_blocks * per_block + per_block - 1,
            path=path,
            ring_bytes=RING_SLOTS * ring_rows * per_block,
        )


# --- random cases ----------------------------------------------------------------------------------


@dataclass
class Case:
    num_blocks: int
    host_blocks: int
    layers: list[Layer]
    ring_rows: int
    calls: list[tuple[str, list[int], list[int]]]  # (direction, gpu_ids, host_ids), in issue order
    seed: int


@st.composite
def layers_of(draw, num_blocks):
    layers = []
    for kind in draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=3)):
        tokens, heads, dim = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.sampled_from([2, 8, 24]))
        shape = layer_shape(kind, num_blocks, tokens, heads, dim, layers=draw(st.integers(2, 3)))
        layers.append(Layer(kind, shape, draw(st.sampled_from(DTYPES))))
    return layers


@st.composite
def placed_runs(draw, lengths, limit):
    """Start of each run of ``lengths``, the runs disjoint inside ``[0, limit)``, in address order."""
    spare = limit - sum(lengths)
    gaps = sorted(draw(st.lists(st.integers(0, spare), min_size=len(lengths), max_size=len(lengths))))
    return [gap + sum(lengths[:i]) for i, gap in enumerate(gaps)]


@st.composite
def call_ids(draw, num_blocks, host_blocks, direction):
    """gpu_ids and host_ids of one call. Random: any order, sources may repeat. Runs: stretches
    that go up by one on both sides at once (what merges into one copy), in random order."""
    limit = min(num_blocks, host_blocks)
    if draw(st.booleans()):
        n = draw(st.integers(0, limit))
        destinations = st.permutations(range(host_blocks if direction == "store" else num_blocks))
        dst = draw(destinations)[:n]
        sources = num_blocks if direction == "store" else host_blocks
        src = draw(st.lists(st.integers(0, sources - 1), min_size=n, max_size=n))
        return (src, dst) if direction == "store" else (dst, src)
    lengths = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    while sum(lengths) > limit:
        lengths.pop()
    if not lengths:
        lengths = [limit]
    gpu_starts = draw(placed_runs(lengths, num_blocks))
    host_starts = draw(placed_runs(lengths, host_blocks))
    order = draw(st.permutations(range(len(lengths))))
    gpu = [gpu_starts[i] + k for i in order for k in range(lengths[i])]
    host = [host_starts[i] + k for i in order for k in range(lengths[i])]
    return gpu, host


@st.composite
def cases(draw, max_rounds=2):
    num_blocks = draw(st.integers(3, 12))  # 2 would make (2, 2, ...) ambiguous
    host_blocks = draw(st.integers(3, 14))
    calls = []
    for _ in range(draw(st.integers(1, max_rounds))):
        for direction in ("store", "load"):
            calls.append((direction, *draw(call_ids(num_blocks, host_blocks, direction))))
    layers, ring_rows, seed = draw(layers_of(num_blocks)), draw(st.integers(1, 3)), draw(st.integers(0, 2**31 - 1))
    return Case(num_blocks, host_blocks, layers, ring_rows, calls, seed)


CROSS_LAYER_RUNS = Case(
    num_blocks=10,
    host_blocks=12,
    layers=[Layer("cross_layer", layer_shape("cross_layer", 10, 3, 2, 8, layers=3), torch.bfloat16)],
    ring_rows=2,
    calls=[("store", [2, 3, 4, 9, 0, 1], [5, 6, 7, 0, 10, 11]), ("load", [5, 6, 7, 8], [6, 7, 8, 9])],
    seed=1,
)
# Empty calls, then a real one: an empty call's completion event goes back to the direction's
# pool like any other and is recorded again by the next call (the GPU suite found the staged path's
# empty call handing back an event of its own making, which the next record could not count).
EMPTY_THEN_ONE = Case(
    num_blocks=3,
    host_blocks=3,
    layers=[Layer("kv_first", (2, 3, 1, 1, 2), torch.float16)],
    ring_rows=1,
    calls=[("store", [], []), ("load", [], []), ("store", [], []), ("load", [0], [0])],
    seed=0,
)


def run_case(case: Case, path: str, device: str) -> None:
    """Issue the case's calls (store, load, ...), flushing after each, and compare the whole mirror
    and the whole cache with a model after every call."""
    gen = torch.Generator().manual_seed(case.seed)
    kv = make_cache(case.layers, gen, device)
    engine = open_engine(kv, case.num_blocks, case.host_blocks, path, case.ring_rows)
    width = engine.block_bytes
    assert engine.num_host_blocks == case.host_blocks and width == cache_rows(kv, case.layers, case.num_blocks).shape[1]
    if path == "staged":  # the ring holds what ring_bytes allows (or what the largest transfer needs)
        most = max(case.num_blocks, case.host_blocks)
        assert engine.paths["staged"].chunk == min(case.ring_rows, math.ceil(most / RING_SLOTS))
    engine.mirror.copy_(torch.randint(0, 256, engine.mirror.shape, dtype=torch.uint8, generator=gen))  # poison
    mirror = engine.mirror.clone()  # the model of every host row...
    cache = cache_rows(kv, case.layers, case.num_blocks)  # ...and of every GPU block
    for i, (direction, gpu_ids, host_ids) in enumerate(case.calls):
        if direction == "store":
            tid = engine.store(gpu_ids, host_ids)
            for g, h in zip(gpu_ids, host_ids):
                mirror[h] = cache[g]
            assert engine.flush() == kv_ops.Completed(stores=[tid])
        else:
            tid = engine.load(host_ids, gpu_ids)
            for g, h in zip(gpu_ids, host_ids):
                cache[g] = mirror[h]
            assert engine.flush() == kv_ops.Completed(loads=[tid])
        # Rows and blocks the call did not address keep their bytes: the whole of both sides.
        assert torch.equal(engine.mirror, mirror), f"call {i} ({direction}): the mirror"
        assert torch.equal(cache_rows(kv, case.layers, case.num_blocks), cache), f"call {i} ({direction}): the cache"
        if direction == "store":  # the compute reuses the blocks
            scramble(kv, gen)
            cache = cache_rows(kv, case.layers, case.num_blocks)
    assert engine.path_counts == {p: len(case.calls) * (p == path) for p in PATH_NAMES}
    engine.close()


@PATHS
@settings(max_examples=40, deadline=None)
@given(case=cases(max_rounds=3))
@example(case=CROSS_LAYER_RUNS)
@example(case=EMPTY_THEN_ONE)
def test_every_path_round_trips_byte_for_byte_over_random_layouts_on_cpu(path, case):
    run_case(case, path, "cpu")


@gpu
@PATHS
@settings(max_examples=8, deadline=None)  # each new block width compiles kernels
@given(case=cases())
@example(case=CROSS_LAYER_RUNS)
@example(case=EMPTY_THEN_ONE)
def test_every_path_round_trips_byte_for_byte_over_random_layouts_on_gpu(path, case):
    run_case(case, path, "cuda")


def test_a_cross_layer_tensor_is_one_region_as_wide_as_its_block():
    kv = {"x": torch.zeros(layer_shape("cross_layer", 10, 3, 2, 8, layers=3), dtype=torch.bfloat16)}
    regions = kv_ops.infer_regions(kv, 10)
    assert {n: tuple(r.shape) for n, r in regions.items()} == {"x": (10, 3 * 2 * 3 * 2 * 8 * 2)}


# --- the plans: how many copies ---------------------------------------------------------------------


def recorded_plans(monkeypatch):
    """Every plan the paths hand to the copy engines (on the CPU: run_on_host), still executed."""
    plans = []
    run = dma.run_on_host

    def record(plan):
        plans.append(plan)
        run(plan)

    monkeypatch.setattr(dma, "run_on_host", record)
    return plans


def test_direct_dma_moves_each_run_in_one_copy_where_the_cache_is_one_cross_layer_region(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    layers = [Layer("cross_layer", layer_shape("cross_layer", 16, 2, 2, 8, layers=3), torch.bfloat16)]
    kv = make_cache(layers, gen)
    engine = open_engine(kv, 16, 20, "dma")
    width = engine.block_bytes
    assert list(engine.regions) == ["l0"] and width == 3 * 2 * 2 * 2 * 8 * 2
    plans = recorded_plans(monkeypatch)
    region, mirror = engine.regions["l0"], engine.mirror
    # Runs: 2..4 -> 5..7, 9 -> 0, 0..1 -> 12..13 (9 -> 0 then 0 -> 12 is no run: 0 follows 9 only on one side).
    engine.store([2, 3, 4, 9, 0, 1], [5, 6, 7, 0, 12, 13])
    (plan,) = plans
    assert plan.sizes.tolist() == [3 * width, width, 2 * width]
    assert plan.srcs.tolist() == [region.data_ptr() + g * width for g in (2, 9, 0)]
    assert plan.dsts.tolist() == [mirror.data_ptr() + h * width for h in (5, 0, 12)]
    engine.load([5, 6, 7, 12, 13], [10, 11, 12, 14, 15])  # 10..12 <- 5..7, 14..15 <- 12..13
    assert plans[1].sizes.tolist() == [3 * width, 2 * width]
    assert plans[1].dsts.tolist() == [region.data_ptr() + g * width for g in (10, 14)]
    engine.flush()
    rows = cache_rows(kv, layers, 16)
    assert torch.equal(mirror[[5, 6, 7, 0, 12, 13]], rows[[2, 3, 4, 9, 0, 1]])
    assert torch.equal(rows[[10, 11, 12, 14, 15]], mirror[[5, 6, 7, 12, 13]])


def test_direct_dma_copies_block_by_block_where_the_mirror_interleaves_several_regions(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    layers = [
        Layer("kv_first", layer_shape("kv_first", 16, 2, 2, 8), torch.float16),
        Layer("mla", (16, 2, 24), torch.float32),
    ]
    kv = make_cache(layers, gen)
    engine = open_engine(kv, 16, 20, "dma")
    assert [tuple(r.shape) for r in engine.regions.values()] == [(16, 64), (16, 64), (16, 192)]
    plans = recorded_plans(monkeypatch)
    engine.store([2, 3, 4, 5], [8, 9, 10, 11])  # one run, but each region's mirror columns are strided
    assert plans[0].count == 3 * 4 and sorted(set(plans[0].sizes.tolist())) == [64, 192]
    engine.flush()
    assert torch.equal(engine.mirror[8:12], cache_rows(kv, layers, 16)[2:6])


@pytest.mark.parametrize("direction", ["store", "load"])
def test_staged_moves_each_run_of_host_ids_in_a_chunk_as_one_copy(monkeypatch, direction):
    gen = torch.Generator().manual_seed(5)
    layers = [
        Layer("kv_first", layer_shape("kv_first", 32, 2, 2, 8), torch.bfloat16),
        Layer("mla", (32, 3, 8), torch.float16),
    ]
    kv = make_cache(layers, gen)
    engine = open_engine(kv, 32, 32, "staged", ring_rows=4)
    width, mirror = engine.block_bytes, engine.mirror
    mirror.copy_(torch.randint(0, 256, mirror.shape, dtype=torch.uint8, generator=gen))
    assert engine.paths["staged"].chunk == 4
    plans = recorded_plans(monkeypatch)
    gpu_ids = torch.randperm(32, generator=gen)[:10].tolist()  # the gather takes any GPU ids
    # Chunks of 4 pairs: host 3..6 | 7..8, 20..21 | 22, 0 -> runs 1 | 2 | 2.
    host_ids = [3, 4, 5, 6, 7, 8, 20, 21, 22, 0]
    want_rows = cache_rows(kv, layers, 32)[gpu_ids] if direction == "store" else mirror[host_ids].clone()
    if direction == "store":
        engine.store(gpu_ids, host_ids)
    else:
        engine.load(host_ids, gpu_ids)
    host_side = [[(p.dsts if direction == "store" else p.srcs)[i].item() for i in range(p.count)] for p in plans]
    assert [p.sizes.tolist() for p in plans] == [[4 * width], [2 * width, 2 * width], [width, width]]
    assert host_side == [[mirror.data_ptr() + h * width for h in runs] for runs in ([3], [7, 20], [22, 0])]
    engine.flush()
    got = mirror[host_ids] if direction == "store" else cache_rows(kv, layers, 32)[gpu_ids]
    assert torch.equal(got, want_rows)


# --- after= on the CPU ------------------------------------------------------------------------------


@PATHS
@pytest.mark.parametrize("kind", ["store", "load"])
@pytest.mark.parametrize("after", [object(), 0, "stream"], ids=["object", "zero", "string"])
def test_after_on_a_cpu_engine_is_refused_before_any_byte_moves_and_uses_no_transfer_id(path, kind, after):
    gen = torch.Generator().manual_seed(6)
    layers = [Layer("kv_first", layer_shape("kv_first", 8, 2, 2, 8), torch.bfloat16)]
    kv = make_cache(layers, gen)
    engine = open_engine(kv, 8, 8, path)
    engine.mirror.copy_(torch.randint(0, 256, engine.mirror.shape, dtype=torch.uint8, generator=gen))
    mirror, cache = engine.mirror.clone(), cache_rows(kv, layers, 8)
    call = engine.store if kind == "store" else engine.load
    message = rf"OffloadEngine\.{kind}: after= orders GPU work; this engine's cache is on cpu"
    with pytest.raises(ValueError, match=message):
        call([0, 1, 2], [3, 4, 5], after=after)
    assert torch.equal(engine.mirror, mirror) and torch.equal(cache_rows(kv, layers, 8), cache)
    assert engine.poll() == kv_ops.Completed()
    assert engine.path_counts == dict.fromkeys(PATH_NAMES, 0)
    assert call([0, 1, 2], [3, 4, 5], after=None) == 0  # None is the default; the refused call used up no id
    assert engine.flush() == kv_ops.Completed(**{f"{kind}s": [0]})


# --- on the GPU -------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["auto", *PATH_NAMES])
def test_an_engine_makes_only_the_paths_it_may_pick(path):
    # A fixed path needs no other (on the GPU the staged one would hold its ring for nothing).
    kv = {"l": torch.randint(0, 256, (8, 64), dtype=torch.uint8)}
    engine = open_engine(kv, 8, 8, path)
    assert set(engine.paths) == (set(PATH_NAMES) if path == "auto" else {path})
    engine.close()


def gpu_engine(path, ring_rows=2, seed=0, num_blocks=64, host_blocks=64):
    """K/V-first attention (2 x 256 B), MLA (192 B) and a cross-layer tensor (384 B) on the GPU,
    random bytes everywhere, the mirror poisoned."""
    gen = torch.Generator().manual_seed(seed)
    layers = [
        Layer("kv_first", layer_shape("kv_first", num_blocks, 4, 2, 16), torch.bfloat16),
        Layer("mla", (num_blocks, 4, 24), torch.float16),
        Layer("cross_layer", layer_shape("cross_layer", num_blocks, 2, 2, 6, layers=2), torch.float32),
    ]
    kv = make_cache(layers, gen, "cuda")
    engine = open_engine(kv, num_blocks, host_blocks, path, ring_rows)
    engine.mirror.copy_(torch.randint(0, 256, engine.mirror.shape, dtype=torch.uint8, generator=gen))
    return engine, kv, layers, gen


@gpu
@pytest.mark.parametrize("ring_rows", [1, 3], ids=["ring-1-row", "ring-3-rows"])
def test_the_staged_ring_survives_100_back_to_back_stores_and_loads(ring_rows):
    engine, kv, layers, gen = gpu_engine("staged", ring_rows, seed=ring_rows)
    assert engine.paths["staged"].chunk == ring_rows
    # Stores read blocks 0..31 into rows 0..31; loads read rows 32..63 into blocks 32..63. The two
    # directions never touch the same bytes, so the result does not depend on how they overlap;
    # within a direction, calls apply in issue order.
    mirror, cache = engine.mirror.clone(), cache_rows(kv, layers, 64)
    stores, loads = [], []
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # calls queue up behind it before the first one can run
    for _ in range(100):
        n = int(torch.randint(1, 10, (1,), generator=gen))  # up to 9 chunks of 1 row: every slot, twice over
        gpu_ids, host_ids = torch.randint(0, 32, (n,), generator=gen), torch.randperm(32, generator=gen)[:n]
        stores.append(engine.store(gpu_ids, host_ids))
        mirror[host_ids] = cache[gpu_ids]
        host_ids, gpu_ids = 32 + torch.randint(0, 32, (n,), generator=gen), 32 + torch.randperm(32, generator=gen)[:n]
        loads.append(engine.load(host_ids, gpu_ids))
        cache[gpu_ids] = mirror[host_ids]
    assert engine.flush() == kv_ops.Completed(stores, loads)
    assert torch.equal(engine.mirror, mirror)
    assert torch.equal(cache_rows(kv, layers, 64), cache)
    assert engine.path_counts == {"kernel": 0, "staged": 200, "dma": 0}
    engine.close()


SLEEP_CYCLES = 500_000_000  # ~0.25 s on an H200: far longer than a few blocks take to move


def wait_for(engine, kind, tid, budget_s=30.0):
    """Poll until transfer ``tid`` is reported (at most ``budget_s``)."""
    deadline = time.monotonic() + budget_s
    while True:
        done = engine.poll()
        if tid in (done.stores if kind == "store" else done.loads):
            return
        assert time.monotonic() < deadline, f"{kind} {tid} not done after {budget_s} s"


@gpu
@PATHS
@pytest.mark.parametrize("kind", ["store", "load"])
def test_a_transfer_after_an_event_recorded_before_a_long_sleep_completes_during_the_sleep(path, kind):
    engine, kv, layers, gen = gpu_engine(path)
    # A warm-up of the same size: the kernels compile, the ring and the tables are made, pinned
    # memory for the ids is cached. Nothing below may wait for the device.
    warm = engine.store([0, 1, 2, 3], [0, 1, 2, 3]), engine.load([0, 1, 2, 3], [4, 5, 6, 7])
    assert engine.flush() == kv_ops.Completed([warm[0]], [warm[1]])
    gpu_ids, host_ids = [8, 9, 10, 11], [20, 21, 22, 23]
    engine.mirror[host_ids] = torch.randint(0, 256, (4, engine.block_bytes), dtype=torch.uint8, generator=gen)
    # The expected bytes, read before the sleep: a read after it would wait for it.
    want = engine.mirror[host_ids].clone() if kind == "load" else cache_rows(kv, layers, 64)[gpu_ids]
    torch.cuda.synchronize()
    ready = torch.cuda.Event()
    ready.record()  # the blocks' last writer (store) or reader (load) is done here
    torch.cuda._sleep(SLEEP_CYCLES)  # the rest of the step: it neither writes nor reads these blocks
    asleep = torch.cuda.Event()
    asleep.record()
    if kind == "store":
        tid = engine.store(gpu_ids, host_ids, after=ready)
    else:
        tid = engine.load(host_ids, gpu_ids, after=ready)
    wait_for(engine, kind, tid)
    assert not asleep.query(), "the transfer waited for the sleep: after= was not used"
    asleep.synchronize()
    got = engine.mirror[host_ids] if kind == "store" else cache_rows(kv, layers, 64)[gpu_ids]
    assert torch.equal(got, want)
    assert engine.path_counts[path] == 3
    engine.close()


@gpu
@PATHS
def test_a_store_after_a_stream_waits_for_that_streams_compute(path):
    engine, kv, layers, gen = gpu_engine(path)
    # A first store compiles the path's kernels; inside the loop that would outlast the sleep.
    warm = engine.store([4, 5, 6, 7], [10, 11, 12, 13])
    assert engine.flush().stores == [warm]
    side = torch.cuda.Stream()
    region = engine.regions["l1"]  # the MLA layer's 192-byte blocks
    for _ in range(3):
        fresh = torch.randint(0, 256, (4, 192), dtype=torch.uint8, generator=gen).cuda()
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # a forward pass on another stream...
            region[4:8].copy_(fresh)  # ...writes the blocks at its end
        tid = engine.store([4, 5, 6, 7], [10, 11, 12, 13], after=side)  # the caller's own stream is idle
        assert engine.poll().stores == []  # cannot be done: the copy waits for the side stream
        assert engine.flush().stores == [tid]
        assert torch.equal(engine.mirror_regions["l1"][10:14], fresh.cpu())


BAD_AFTER = "after must be a torch.cuda.Event, a torch.cuda.Stream or None,"


@gpu
@pytest.mark.parametrize(
    "make_after, message",
    [
        (lambda: torch.cuda.current_stream().cuda_stream, f"{BAD_AFTER} got int"),  # the raw handle
        (lambda: object(), f"{BAD_AFTER} got object"),
        pytest.param(
            lambda: torch.cuda.Stream(device=1),
            r"after is a stream of cuda:1, but the engine's cache is on cuda:0",
            marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
        ),
    ],
    ids=["stream-handle", "object", "stream-of-another-device"],
)
def test_a_bad_after_is_refused_before_anything_moves(make_after, message):
    torch.cuda.set_device(0)
    engine, kv, layers, _ = gpu_engine("kernel")
    mirror, cache = engine.mirror.clone(), cache_rows(kv, layers, 64)
    for call in (lambda a: engine.store([0, 1], [2, 3], after=a), lambda a: engine.load([0, 1], [2, 3], after=a)):
        with pytest.raises(ValueError, match=message):
            call(make_after())
    torch.cuda.synchronize()
    assert torch.equal(engine.mirror, mirror) and torch.equal(cache_rows(kv, layers, 64), cache)
    assert engine.poll() == kv_ops.Completed() and engine.store([0], [0]) == 0
    engine.close()


@gpu
@PATHS
def test_after_a_stream_being_captured_is_refused_before_anything_moves(path):
    # Its event would pull the engine's streams into the user's graph: the copy would happen at
    # the replays, not now. The current stream is not capturing, so only the after= check sees it.
    engine, kv, layers, _ = gpu_engine(path)
    torch.cuda.synchronize()
    mirror, cache = engine.mirror.clone(), cache_rows(kv, layers, 64)
    captured, other, graph = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.CUDAGraph()
    calls = (lambda a: engine.store([0, 1], [2, 3], after=a), lambda a: engine.load([0, 1], [2, 3], after=a))
    with torch.cuda.graph(graph, stream=captured):
        torch.cuda._sleep(1000)  # the captured work
        with torch.cuda.stream(other):
            for call in calls:
                with pytest.raises(RuntimeError, match="after is a stream being captured into a CUDA graph"):
                    call(captured)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(engine.mirror, mirror) and torch.equal(cache_rows(kv, layers, 64), cache)
    assert engine.poll() == kv_ops.Completed() and engine.store([0], [0]) == 0
    assert engine.flush().stores == [0]
    engine.close()


@gpu
@pytest.mark.parametrize("path", ["staged", "auto", "kernel"])
def test_the_staged_ring_is_allocated_with_the_engine_not_by_its_first_transfer(path):
    # A serving engine must run out of GPU memory at start if at all, never in the middle of serving.
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    engine, kv, layers, gen = gpu_engine(path, ring_rows=16)
    cache_bytes = sum(t.numel() * t.element_size() for t in kv.values())
    ring = RING_SLOTS * 16 * engine.block_bytes  # one direction's
    made = torch.cuda.memory_allocated() - start - cache_bytes
    if path == "kernel":
        assert made < ring, f"a kernel-path engine allocated {made} bytes, as much as a staged ring"
    else:
        assert made >= 2 * ring, f"{made} bytes allocated at construction, less than two rings of {ring}"
    engine.path = "staged" if path == "auto" else path  # the first transfer takes the staged path
    held = torch.cuda.memory_allocated()
    engine.store(list(range(16)), list(range(16)))
    engine.flush()  # the two directions are not ordered against each other
    engine.load(list(range(16)), list(range(16, 32)))
    engine.flush()
    grown = torch.cuda.memory_allocated() - held
    assert grown < ring, f"the first transfers allocated {grown} bytes: the ring was not made with the engine"
    rows = cache_rows(kv, layers, 64)
    assert torch.equal(rows[16:32], rows[:16])
    engine.close()


@settings(max_examples=200, deadline=None)
@given(
    ring_rows=st.integers(1, 8),
    host=st.lists(st.integers(0, 299), min_size=1, max_size=64, unique=True),
    sort=st.booleans(),
    first_slot=st.integers(0, RING_SLOTS - 1),
    direction=st.sampled_from(list(Direction)),
)
def test_the_staged_plan_of_a_few_pairs_in_python_equals_the_numpy_plan(ring_rows, host, sort, first_slot, direction):
    # Up to staged_mod.SMALL_PLAN pairs the descriptors are planned in plain Python: every chunk's
    # descriptors must be exactly the numpy plan's (runs within a chunk merged, none across).
    staged = staged_mod.StagedPath(
        [torch.empty(200, 64, dtype=torch.uint8)],
        torch.empty(300, 64, dtype=torch.uint8),
        None,
        RING_SLOTS * ring_rows * 64,
    )
    ring = staged.ring(direction)
    host = sorted(host) if sort else host
    blocks = Blocks(direction, np.arange(len(host), dtype=np.int64), np.array(host, dtype=np.int64))
    small = staged.small_plans(host, ring, first_slot, direction)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(staged_mod, "SMALL_PLAN", 0)
        vectorised = staged.plans(blocks, ring, first_slot)
    assert [(p.dsts.tolist(), p.srcs.tolist(), p.sizes.tolist()) for p in small] == [
        (p.dsts.tolist(), p.srcs.tolist(), p.sizes.tolist()) for p in vectorised
    ]


# --- the path contract ----------------------------------------------------------------------

PROTOCOL_DATA = tuple(paths.TransferPath.__annotations__)
PROTOCOL_METHODS = tuple(
    n for n, v in vars(paths.TransferPath).items() if inspect.isfunction(v) and not n.startswith("_")
)


def every_path_class():
    from kv_ops.transfer import layerwise
    from kv_ops.transfer.disk import DiskPath

    return [paths.KernelPath, staged_mod.StagedPath, paths.DirectDmaPath, DiskPath, layerwise._LayerPath]


def test_the_protocol_names_what_the_engine_calls_on_a_path():
    assert set(PROTOCOL_DATA) == {"name", "label", "copy_engines", "host_planned", "fresh_ready"}
    assert set(PROTOCOL_METHODS) == {"enqueue", "reported", "close"}


@pytest.mark.parametrize("cls", every_path_class(), ids=lambda c: c.__name__)
def test_every_path_class_defines_every_protocol_member_with_its_signature(cls):
    for member in PROTOCOL_DATA:
        assert hasattr(cls, member), f"{cls.__name__} lacks {member}"
    for member in PROTOCOL_METHODS:
        want = list(inspect.signature(getattr(paths.TransferPath, member)).parameters)
        got = list(inspect.signature(getattr(cls, member)).parameters)
        assert got == want, f"{cls.__name__}.{member}{got} is not {want}"


def test_real_paths_built_on_the_cpu_satisfy_the_protocol_and_a_partial_one_does_not(tmp_path):
    from layerwise_models import make_caches

    from kv_ops.transfer import layerwise

    caches = make_caches(2, 8, "cpu", seed=4)
    row = sum(c[0, 0].nbytes * 2 for c in caches.values())
    with kv_ops.OffloadEngine(caches, 8, capacity_bytes=16 * row, path="auto") as engine:
        assert sorted(engine.paths) == sorted(paths.PATH_NAMES)
        for path in engine.paths.values():
            assert isinstance(path, paths.TransferPath), type(path).__name__
        with kv_ops.LayerwiseLoads(engine, "protocol") as loads:
            assert isinstance(layerwise._LayerPath(loads, "kernel"), paths.TransferPath)
    with kv_ops.OffloadEngine(caches, 8, capacity_bytes=16 * 4096, disk_dir=str(tmp_path), page_cache=True) as disk:
        assert isinstance(disk.paths["disk"], paths.TransferPath)

    class NoFreshReady:
        name, label, copy_engines, host_planned = "x", "x", False, frozenset()

        def enqueue(self, blocks, ready): ...

        def reported(self, direction, done): ...

        def close(self): ...

    assert not isinstance(NoFreshReady(), paths.TransferPath)
    NoFreshReady.fresh_ready = False
    assert isinstance(NoFreshReady(), paths.TransferPath)
