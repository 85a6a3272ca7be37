"""The engine's per-call host work: ids taken in numpy, pooled id blocks, GPU ids never read by
the host, and exactly what one call issues (the regression guard: counts, not timings).

The CPU tests cover the intake (every id form, every refusal) and the pool's reuse rule; the tests
marked gpu queue a long ``torch.cuda._sleep`` before a call to prove it returns at once, and count
the graph replays, copies, descriptor batches, event records, torch operations and host syncs
one ``store`` of 16 blocks issues on each path.
"""

import collections
import functools
import time
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kv_ops
from kv_ops import kernels
from kv_ops.transfer import blocks, dma, ordering, staged
from kv_ops.transfer import ids as ids_mod
from kv_ops.transfer.paths import RING_SLOTS
from kv_ops.validation import SMALL_IDS

gpu = pytest.mark.gpu
LAYERS = 4
BLOCK = 2 * 16 * 2 * 16 * 2  # per K/V-first layer: 2 x 1 KiB regions


def make_engine(device, path, num_blocks=64, host_blocks=96, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv = {
        f"layer{i}": torch.randint(-99, 99, (2, num_blocks, 16, 2, 16), generator=gen).to(device, torch.bfloat16)
        for i in range(LAYERS)
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pinned_empty warns once on the CPU
        ring = {} if path == "auto" else {"ring_bytes": RING_SLOTS * 32 * LAYERS * BLOCK}
        engine = kv_ops.OffloadEngine(kv, num_blocks, capacity_bytes=host_blocks * LAYERS * BLOCK, path=path, **ring)
    engine.mirror.copy_(torch.randint(0, 256, engine.mirror.shape, dtype=torch.uint8, generator=gen))  # poison
    return engine, kv


def rows(engine) -> torch.Tensor:
    """Every GPU block's bytes in mirror-row order (region by region), on the host."""
    return torch.cat([r.cpu() for r in engine.regions.values()], dim=1)


# --- the intake (CPU) ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ids",
    [
        [3, 1, 2],
        (3, 1, 2),
        range(3, 0, -1),
        np.array([3, 1, 2], dtype=np.int32),
        np.array([3, 1, 2], dtype=np.int64)[::1],
        torch.tensor([3, 1, 2], dtype=torch.int32),
        torch.tensor([9, 3, 9, 1, 9, 2])[1::2],  # strided, 1-D
    ],
    ids=["list", "tuple", "range", "int32-array", "int64-array", "int32-tensor", "strided-tensor"],
)
def test_ids_of_every_host_form_come_out_as_int64_arrays(ids):
    got = ids_mod.take("op", "ids", ids, 4, unique=True, device=torch.device("cpu"))
    assert isinstance(got, np.ndarray) and got.dtype == np.int64
    assert got.tolist() == np.asarray(ids).tolist()


def test_an_empty_list_is_no_ids_not_a_float_tensor():
    got = ids_mod.take("op", "ids", [], 4, unique=True, device=torch.device("cpu"))
    assert got.dtype == np.int64 and got.size == 0


@pytest.mark.parametrize(
    "ids, message",
    [
        ([0, 4], r"op: ids\[1\] = 4 is outside \[0, 4\)"),
        (np.array([-1]), r"op: ids\[0\] = -1 is outside \[0, 4\)"),
        ([1, 2, 1], r"op: ids names block 1 more than once \(positions \[0, 2\]\)"),
        ([0.5], r"op: ids must be integer block ids, got a list of float64: \[0\.5\]"),
        (np.array([1.0]), r"op: ids must be a 1-D int32 or int64 array, got a numpy float64 array of shape \(1,\)"),
        ([True], r"op: ids must be integer block ids, got a list of bool: \[True\]"),
        ([3, True], r"op: ids\[1\] is True, a bool, not a block id"),
        ((np.int64(2), np.True_), r"op: ids\[1\] is np.True_, a bool, not a block id"),
        (collections.deque([3, True]), r"op: ids\[1\] is True, a bool, not a block id"),
        ([2**63], r"op: ids must be integer block ids, got a list of uint64: \[9223372036854775808\]"),
        (np.array([1], dtype=np.uint64), r"op: ids must be a 1-D int32 or int64 array, got a numpy uint64 array"),
        (np.array([1, 2], dtype=np.uint8), r"op: ids must be a 1-D int32 or int64 array, got a numpy uint8 array"),
        (np.array([1], dtype=np.int16), r"op: ids must be a 1-D int32 or int64 array, got a numpy int16 array"),
        (
            np.array([[3], [1]]),
            r"op: ids must be a 1-D int32 or int64 array, got a numpy int64 array of shape \(2, 1\)",
        ),
        (np.array(3), r"op: ids must be a 1-D int32 or int64 array, got a numpy int64 array of shape \(\)"),
        ([[3], [1]], r"op: ids must be a flat sequence of ids, got list of shape \(2, 1\)"),
        (torch.tensor([[3, 1]]), r"op: ids must be a 1-D int32 or int64 tensor, got torch.int64 \(1, 2\)"),
        (torch.tensor(3), r"op: ids must be a 1-D int32 or int64 tensor, got torch.int64 \(\)"),
        ([2**70], "op: ids must be integer block ids, got a list of object"),
        (["a"], "op: ids must be integer block ids, got a list of <U1"),
        (torch.tensor([1], dtype=torch.int16), r"op: ids must be a 1-D int32 or int64 tensor, got torch.int16"),
        (torch.tensor([1], device="meta"), "op: ids is a meta tensor"),
    ],
    ids=[
        "too-large",
        "negative",
        "repeat",
        "float-list",
        "float-array",
        "bool",
        "bool-among-ints",
        "numpy-bool-among-ints",
        "bool-in-a-deque",
        "past-int64",
        "uint64",
        "uint8-array",
        "int16-array",
        "2-d-array",
        "0-d-array",
        "nested-list",
        "2-d-tensor",
        "0-d-tensor",
        "huge",
        "string",
        "int16-tensor",
        "meta",
    ],
)
def test_bad_ids_are_refused_with_the_ops_words(ids, message):
    with pytest.raises(ValueError, match=message):
        ids_mod.take("op", "ids", ids, 4, unique=True, device=torch.device("cpu"))


@settings(max_examples=150, deadline=None)
@given(
    values=st.lists(st.integers(-3, 2 * SMALL_IDS + 3), max_size=2 * SMALL_IDS + 8),
    unique=st.booleans(),
)
def test_every_form_of_the_same_ids_is_taken_or_refused_alike_below_and_above_small_ids(values, unique):
    # Up to SMALL_IDS ids the rule runs on a Python list, above it in numpy: one rule, one answer
    # (the array, or the same message), whatever the form or the size.
    limit = 2 * SMALL_IDS
    forms = [values, tuple(values), np.array(values, dtype=np.int64), torch.tensor(values, dtype=torch.int64)]
    answers = []
    for ids in forms:
        try:
            answers.append(ids_mod.take("op", "ids", ids, limit, unique, torch.device("cpu")).tolist())
        except ValueError as e:
            answers.append(str(e))
    assert all(a == answers[0] for a in answers), answers
    bad = any(v < 0 or v >= limit for v in values) or (unique and len(set(values)) < len(values))
    assert isinstance(answers[0], str) == bad
    if not bad:
        assert answers[0] == values


def test_the_intake_reads_no_torch_operation_for_list_ids():
    # The point of the numpy intake: a scheduler's list never becomes a torch tensor.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            ids_mod.take("op", "ids", [5, 3, 9, 1], 16, unique=True, device=torch.device("cpu"))
    assert [e.name for e in prof.events() if e.name.startswith("aten::")] == []


class FakeEvent:  # what Pool asks of an event
    def __init__(self, done=False):
        self.done = done

    def query(self):
        return self.done


@pytest.mark.filterwarnings("ignore:kv_ops.pinned_empty")
def test_an_id_block_is_reused_only_after_its_event_fired_and_the_pool_grows_meanwhile():
    pool = ids_mod.Pool(functools.partial(ids_mod.IdBlock, 8), initial=1)
    first = pool.take()
    pending = FakeEvent()
    pool.give(first, pending)
    second = pool.take()  # the first is still being read: a new block
    assert second is not first and pool.made == 2
    pool.give(second, FakeEvent(done=True))
    pending.done = True  # now both have been read: the oldest comes back first
    assert pool.take() is first and pool.take() is second
    assert pool.made == 2


@pytest.mark.filterwarnings("ignore:kv_ops.pinned_empty")
def test_a_recycled_completion_event_frees_its_block_and_does_not_grow_the_pool():
    # The engine records a reported event again for a later transfer (Events): it then looks
    # busy, but the record the block waited for has run. Growing there synchronizes the device.
    pool = ids_mod.Pool(functools.partial(ids_mod.IdBlock, 8), initial=1)
    first = pool.take()
    event = FakeEvent()
    event.records = 1
    pool.give(first, event)
    event.records = 2  # reported, then recorded again for a transfer still in flight
    assert pool.take() is first and pool.made == 1
    pool.give(first, event)  # given with count 2, and that record is pending
    assert pool.take() is not first and pool.made == 2


def test_back_to_back_cpu_transfers_land_byte_for_byte_on_every_path():
    for path in ("kernel", "staged", "dma"):
        engine, _ = make_engine("cpu", path)
        gen = torch.Generator().manual_seed(1)
        want = engine.mirror.clone()
        for _ in range(20):
            n = int(torch.randint(0, 40, (1,), generator=gen))
            gpu_ids = torch.randint(0, 64, (n,), generator=gen).tolist()
            host_ids = torch.randperm(96, generator=gen)[:n].tolist()
            engine.store(gpu_ids, host_ids)
            want[host_ids] = rows(engine)[gpu_ids]
        engine.flush()
        assert torch.equal(engine.mirror, want), path
        engine.close()


# --- on the GPU ----------------------------------------------------------------------------------

SLEEP_CYCLES = 1_000_000_000  # ~0.5 s on an H200
# A call "returns at once" when it returns before this share of the GPU sleep queued ahead of it
# has run, as the host saw it in the same run: a call that waited for the GPU takes all of it, and
# a loaded host stretches the call, never the sleep.
AT_ONCE = 0.1


def sleep_seen_from(start: float, slept: torch.cuda.Event) -> float:
    """Seconds from ``start`` until the host sees ``slept`` (recorded right after a GPU sleep)."""
    slept.synchronize()
    return time.perf_counter() - start


@gpu
@pytest.mark.parametrize(
    "path, sides",
    [
        ("kernel", "both"),
        ("auto", "both"),
        ("auto", "gpu_ids"),
        ("staged", "gpu_ids"),
    ],
)
@pytest.mark.parametrize("kind", ["store", "load"])
def test_gpu_ids_are_never_read_by_the_host_the_call_returns_at_once(path, sides, kind):
    kv_ops.reset_error_count("cuda")  # other tests skip bad ids on purpose
    engine, kv = make_engine("cuda", path)
    engine.store([0], [0]), engine.load([0], [1])
    engine.flush()  # warm: nothing below compiles or allocates
    gen = torch.Generator().manual_seed(2)
    gpu_ids = torch.randperm(64, generator=gen)[:16]
    host_ids = torch.randperm(96, generator=gen)[:16]
    before = rows(engine)
    mirror = engine.mirror.clone()
    g, h = gpu_ids.cuda(), (host_ids.cuda() if sides == "both" else host_ids)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # the caller's stream is busy for half a second
    slept = torch.cuda.Event()
    slept.record()  # before the call: it marks the sleep's end alone
    start = time.perf_counter()
    tid = engine.store(g, h) if kind == "store" else engine.load(h, g)
    took = time.perf_counter() - start
    sleep = sleep_seen_from(start, slept)
    del g, h  # the engine keeps what it reads alive
    assert took < AT_ONCE * sleep, (
        f"{kind} took {took * 1e3:.1f} ms of a {sleep * 1e3:.1f} ms sleep: it waited for the GPU"
    )
    done = engine.flush()
    assert (done.stores if kind == "store" else done.loads) == [tid]
    if kind == "store":
        mirror[host_ids] = before[gpu_ids]
        assert torch.equal(engine.mirror, mirror)
    else:
        before[gpu_ids] = mirror[host_ids]
        assert torch.equal(rows(engine), before)
    assert kv_ops.error_count("cuda") == 0
    engine.close()


@gpu
def test_invalid_gpu_ids_are_skipped_and_counted_never_read_by_the_host():
    engine, _ = make_engine("cuda", "kernel")
    kv_ops.reset_error_count("cuda")
    before = engine.mirror.clone()
    engine.store(torch.tensor([0, 64, 1], device="cuda"), torch.tensor([5, 6, 200], device="cuda"))
    engine.flush()
    assert kv_ops.error_count("cuda") == 2  # gpu id 64 and host id 200: their pairs are skipped
    assert torch.equal(engine.mirror[6], before[6])
    assert torch.equal(engine.mirror[5], rows(engine)[0])
    kv_ops.reset_error_count("cuda")
    engine.close()


@gpu
@pytest.mark.parametrize(
    "path, which",
    [("dma", "gpu_ids"), ("dma", "host_ids"), ("staged", "host_ids")],
    ids=["dma-gpu", "dma-host", "staged-host"],
)
def test_a_path_that_plans_on_the_host_refuses_gpu_ids_before_anything_moves(path, which):
    engine, _ = make_engine("cuda", path)
    mirror, cache = engine.mirror.clone(), rows(engine)
    g = torch.tensor([1, 2], device="cuda") if which == "gpu_ids" else [1, 2]
    h = torch.tensor([3, 4], device="cuda") if which == "host_ids" else [3, 4]
    with pytest.raises(ValueError, match=rf"OffloadEngine.store: {which} is a cuda:0 tensor, but path='{path}'"):
        engine.store(g, h)
    torch.cuda.synchronize()
    assert torch.equal(engine.mirror, mirror) and torch.equal(rows(engine), cache)
    assert engine.store([0], [0]) == 0  # no transfer id was used
    engine.close()


@gpu
def test_the_disk_tier_refuses_gpu_ids(tmp_path):
    kv = {"l": torch.zeros(2, 8, 16, 2, 16, dtype=torch.bfloat16, device="cuda")}
    with kv_ops.OffloadEngine(kv, 8, capacity_bytes=1 << 20, disk_dir=str(tmp_path)) as engine:
        with pytest.raises(ValueError, match="gpu_ids is a cuda:0 tensor, but the disk tier plans"):
            engine.store(torch.tensor([1], device="cuda"), [0])


class Counts:
    """Counts what the hot path hands to the GPU, by wrapping the seams it goes through."""

    def __init__(self, monkeypatch):
        self.n = dict.fromkeys(["replay", "copy", "batch", "triton", "record", "pinned", "graphs"], 0)
        for name, owner, attr in [
            ("replay", kernels.GraphedCopy, "replay"),
            ("copy", dma.Launcher, "copy"),
            ("batch", dma.Launcher, "__call__"),
            ("triton", kernels.BoundCopy, "launch_kernel"),
            ("record", torch.cuda.Event, "record"),
            ("pinned", ids_mod.IdBlock, "__init__"),
            ("graphs", kernels.GraphedCopy, "__init__"),
            ("record", blocks, "record_event"),  # the raw records of events made before
            ("record", staged, "record_event"),
            ("record", ordering, "record_event"),
        ]:
            monkeypatch.setattr(owner, attr, self._counting(name, getattr(owner, attr)))

    def _counting(self, name, fn):
        def counted(*args, **kwargs):
            self.n[name] += 1
            return fn(*args, **kwargs)

        return counted


@gpu
@pytest.mark.parametrize(
    "path, want",
    [
        ("kernel", {"replay": 1, "copy": 0, "batch": 0, "triton": 0, "record": 2, "pinned": 0, "graphs": 0}),
        ("staged", {"replay": 1, "copy": 0, "batch": 1, "triton": 0, "record": 4, "pinned": 0, "graphs": 0}),
        ("dma", {"replay": 0, "copy": 0, "batch": 1, "triton": 0, "record": 2, "pinned": 0, "graphs": 0}),
    ],
)
def test_one_store_of_16_blocks_issues_exactly_this_and_never_syncs(monkeypatch, path, want):
    # The regression guard: a change that adds a launch, a copy, an event or a torch operation
    # to the hot path fails here (the timings are benchmarks/host_cost.py's).
    engine, _ = make_engine("cuda", path)
    for _ in range(3):  # warm: the pools hold enough blocks for the calls below
        engine.store(list(range(16)), list(range(16)))
    engine.flush()
    counts = Counts(monkeypatch)
    gpu_ids, host_ids = list(range(20, 36)), list(range(40, 72, 2))  # a run on one side only
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing torch call raises
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            engine.store(gpu_ids, host_ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert counts.n == want
    assert [e.name for e in prof.events() if e.name.startswith("aten::")] == []
    engine.flush()
    assert torch.equal(engine.mirror[host_ids], rows(engine)[gpu_ids])
    engine.close()


@gpu
def test_one_store_with_gpu_ids_is_one_direct_launch_and_never_syncs(monkeypatch):
    # GPU ids go to the kernel as they are: one launch of the compiled kernel (none through
    # Triton's @jit binder: it was compiled when the engine was made), no id block, no copy.
    engine, _ = make_engine("cuda", "kernel")
    engine.store([0], [0])
    engine.flush()
    counts = Counts(monkeypatch)
    binds = []
    bind = kernels._block_copy_kernel.run
    monkeypatch.setattr(kernels._block_copy_kernel, "run", lambda *a, **k: binds.append(1) or bind(*a, **k))
    gen = torch.Generator().manual_seed(12)
    gpu_ids, host_ids = torch.randperm(64, generator=gen)[:16], torch.randperm(96, generator=gen)[:16]
    g, h = gpu_ids.cuda(), host_ids.cuda()
    before = rows(engine)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            engine.store(g, h)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = {"replay": 0, "copy": 0, "batch": 0, "triton": 1, "record": 2, "pinned": 0, "graphs": 0}
    assert (counts.n, binds) == (want, [])
    assert [e.name for e in prof.events() if e.name.startswith("aten::")] == []
    engine.flush()
    assert torch.equal(engine.mirror[host_ids], before[gpu_ids])
    engine.close()


@gpu
@pytest.mark.parametrize("path", ["kernel", "staged"])
def test_pooled_graphs_are_never_rewritten_before_their_replay_ran_under_a_queue_of_calls(path):
    # 60 stores queue up behind a sleep: each takes a graph whose page-locked ids the GPU has not
    # read yet, so the pools must grow instead of overwriting; every store's bytes must land.
    engine, _ = make_engine("cuda", path, num_blocks=64, host_blocks=96)
    engine.store([0], [0]), engine.load([0], [1])
    engine.flush()
    gen = torch.Generator().manual_seed(5)
    cache = rows(engine)
    want = engine.mirror.clone()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    for _ in range(60):
        n = int(torch.randint(1, 80, (1,), generator=gen))  # across the 64-pair bucket's edge
        gpu_ids = torch.randint(0, 64, (n,), generator=gen).tolist()
        host_ids = torch.randperm(96, generator=gen)[:n].tolist()
        engine.store(gpu_ids, host_ids)
        want[host_ids] = cache[gpu_ids]
    engine.flush()
    assert torch.equal(engine.mirror, want)
    pools = engine.paths[path].host_fed[kv_ops.transfer.paths.Direction.STORE]
    assert max(p.made for p in pools) > 2  # they grew while the calls were queued
    engine.close()


def pool_sizes(engine, path):
    return [p.made for d in blocks.Direction for p in engine.paths[path].host_fed[d]]


@gpu
@pytest.mark.parametrize("path", ["kernel", "staged"])
def test_a_sustained_stream_of_calls_beside_a_busy_model_grows_no_pool_and_each_returns_at_once(path):
    # A serving loop: the model's work queued on the default stream, the transfers ordered after
    # an event recorded before it, a few calls in flight, polled as they land. Each completion
    # event goes back to the engine and is recorded again for a later call; a pool that took that
    # for "still busy" grew, and growing (a graph capture, page-locked memory) waited for the
    # whole queue: 22-25 ms per stall beside 20 matmuls on the H200.
    engine, _ = make_engine("cuda", path, num_blocks=64, host_blocks=96)
    gen = torch.Generator().manual_seed(11)
    calls = [(torch.randperm(64, generator=gen)[:16].tolist(), torch.randperm(96, generator=gen)[:16].tolist())]
    calls += [(torch.randperm(64, generator=gen)[:16].tolist(), torch.randperm(96, generator=gen)[:16].tolist())]

    def stream_of_calls(total, after=None):
        issued = reported = 0
        worst = 0.0
        while reported < total:
            if issued < total and issued - reported < 3:
                g, h = calls[issued % 2]
                start = time.perf_counter()
                engine.store(g, h, after=after)
                worst = max(worst, time.perf_counter() - start)
                issued += 1
            else:
                reported += len(engine.poll().stores)
        return worst

    torch.cuda._sleep(SLEEP_CYCLES // 10)
    stream_of_calls(40)  # warm: the first three calls wait behind the sleep, so the pools reach that depth
    grown = pool_sizes(engine, path)
    cache = rows(engine)
    go = torch.cuda.Event()
    go.record()
    torch.cuda._sleep(SLEEP_CYCLES)  # the model's queue: half a second
    slept = torch.cuda.Event()
    slept.record()
    start = time.perf_counter()
    worst = stream_of_calls(60, after=go)
    sleep = sleep_seen_from(start, slept)
    assert pool_sizes(engine, path) == grown, "a pool grew under a steady stream of calls"
    # A call that waited for the default stream waited until the sleep's end: most of the sleep,
    # since the calls start at its beginning and take a small part of it between them.
    assert worst < AT_ONCE * sleep, (
        f"a call took {worst * 1e3:.1f} ms of a {sleep * 1e3:.1f} ms sleep on the default stream: it waited for it"
    )
    engine.flush()
    g, h = calls[1]
    assert torch.equal(engine.mirror[h], cache[g])
    engine.close()


@gpu
@pytest.mark.parametrize("path", ["kernel", "staged"])
def test_strided_gpu_ids_move_the_blocks_they_name(path):
    # The engine copies GPU ids device to device as one span: a strided view must be made
    # contiguous first, or the copy would read the ids in between.
    engine, _ = make_engine("cuda", path)
    gen = torch.Generator().manual_seed(9)
    every = torch.randperm(64, generator=gen)[:32].cuda()
    gpu_ids = every[::2]  # 16 ids, stride 2
    host_ids = torch.randperm(96, generator=gen)[:16]
    before, want = rows(engine), engine.mirror.clone()
    engine.store(gpu_ids, host_ids.tolist())
    engine.flush()
    want[host_ids] = before[gpu_ids.cpu()]
    assert torch.equal(engine.mirror, want)
    engine.close()
