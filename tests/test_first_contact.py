"""What a first user meets: each misuse of a public entry point is a clear error, raised before a
byte moves, naming the function, the argument and the value; and a program that ends without
closing its engine exits cleanly, whatever it left in flight.

Real objects throughout (CPU engines here; the exit cases on a GPU are marked ``gpu``), random
data, no mocks. The exit cases run in child processes: the crash they guard against happened at
interpreter teardown, which a test in this process cannot reach.
"""

import concurrent.futures
import json
import os
import re
import subprocess
import sys
import uuid
import warnings

import pytest
import torch

import kv_ops

gpu = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(kv_ops.__file__)))
NUM_BLOCKS = 16


def make_caches(seed, device="cpu", layers=2):
    """K/V-first bfloat16 caches of random bytes: [2, NUM_BLOCKS, 4, 2, 16] per layer."""
    gen = torch.Generator().manual_seed(seed)
    return {
        f"layer{i}": torch.randint(0, 256, (2, NUM_BLOCKS, 4, 2, 32), dtype=torch.uint8, generator=gen)
        .view(torch.bfloat16)
        .to(device)
        for i in range(layers)
    }


def make_engine(seed, caches=None, **kw):
    caches = make_caches(seed) if caches is None else caches
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # without CUDA, pinned_empty warns that its memory is pageable
        return kv_ops.OffloadEngine(caches, NUM_BLOCKS, capacity_bytes=1 << 20, path="kernel", **kw)


def unique(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


# --- block ops: ids (and regions) on the meta device hold no values --------------------------------


def _regions_and_host(seed):
    regions = kv_ops.infer_regions(make_caches(seed), NUM_BLOCKS)
    gen = torch.Generator().manual_seed(seed + 1)
    host = {n: torch.randint(0, 256, (8, r.shape[1]), dtype=torch.uint8, generator=gen) for n, r in regions.items()}
    return regions, host


def _meta(ids):
    return torch.tensor(ids, device="meta")


# (id, call, the function and the argument its error names): call(regions, host, packed, ids)
# makes one call with one side on the meta device.
META_CALLS = [
    ("copy-src_ids", lambda r, h, p, ids: kv_ops.copy_blocks(r, h, _meta(ids), torch.tensor([0, 1, 2])),
     "kv_ops.copy_blocks: src_ids"),
    ("copy-dst_ids", lambda r, h, p, ids: kv_ops.copy_blocks(r, h, torch.tensor(ids), _meta([0, 1, 2])),
     "kv_ops.copy_blocks: dst_ids"),
    ("copy-regions", lambda r, h, p, ids: kv_ops.copy_blocks({n: t.to("meta") for n, t in r.items()}, h,
                                                             torch.tensor(ids), torch.tensor([0, 1, 2])),
     "kv_ops.copy_blocks: src[0]"),
    ("gather-ids", lambda r, h, p, ids: kv_ops.gather_blocks(r, _meta(ids), p), "kv_ops.gather_blocks: ids"),
    ("gather-out", lambda r, h, p, ids: kv_ops.gather_blocks(r, torch.tensor(ids), p.to("meta")),
     "kv_ops.gather_blocks: out"),
    ("scatter-ids", lambda r, h, p, ids: kv_ops.scatter_blocks(p, _meta(ids), r), "kv_ops.scatter_blocks: ids"),
]  # fmt: skip


@pytest.mark.parametrize("call, named", [c[1:] for c in META_CALLS], ids=[c[0] for c in META_CALLS])
def test_a_meta_tensor_given_to_a_block_op_is_refused_and_nothing_moves(call, named):
    regions, host = _regions_and_host(seed=3)
    ids = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(4))[:3].tolist()
    gen = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (3, kv_ops.block_bytes(regions)), dtype=torch.uint8, generator=gen)
    before = [t.clone() for t in (*regions.values(), *host.values(), packed)]
    with pytest.raises(ValueError) as refused:
        call(regions, host, packed, ids)
    assert str(refused.value) == f"{named} is a meta tensor, which holds no values; pass a tensor on the CPU or a GPU"
    after = [*regions.values(), *host.values(), packed]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a refused call moved bytes"


def test_a_block_op_given_regions_that_are_not_tensors_names_them():
    regions, host = _regions_and_host(seed=6)
    ids = torch.tensor([1, 2])
    with pytest.raises(
        TypeError, match=r"^kv_ops\.copy_blocks: src must be a list or mapping of region tensors, got NoneType$"
    ):
        kv_ops.copy_blocks(None, host, ids, ids)
    with pytest.raises(TypeError, match=r"^kv_ops\.copy_blocks: dst\[1\] must be a torch\.Tensor, got ndarray$"):
        kv_ops.copy_blocks(list(regions.values())[:2], [host["layer0.0"], host["layer0.1"].numpy()], ids, ids)
    with pytest.raises(TypeError, match=r"^kv_ops\.scatter_blocks: packed must be a torch\.Tensor, got NoneType$"):
        kv_ops.scatter_blocks(None, ids, regions)


@pytest.mark.parametrize(
    "call, named",
    [
        (lambda r, h, p, ids: kv_ops.copy_blocks(None, None, ids, ids), "kv_ops.copy_blocks: src"),
        (lambda r, h, p, ids: kv_ops.copy_blocks(list(r.values()), 7, ids, ids), "kv_ops.copy_blocks: dst"),
        (lambda r, h, p, ids: kv_ops.gather_blocks(None, ids, p), "kv_ops.gather_blocks: regions"),
        (lambda r, h, p, ids: kv_ops.scatter_blocks(p, ids, 3.5), "kv_ops.scatter_blocks: regions"),
    ],
    ids=["copy-both", "copy-dst", "gather", "scatter"],
)
def test_a_block_op_given_regions_that_are_no_collection_names_them_and_nothing_moves(call, named):
    regions, host = _regions_and_host(seed=7)
    ids = torch.tensor([1, 2])
    gen = torch.Generator().manual_seed(8)
    packed = torch.randint(0, 256, (2, kv_ops.block_bytes(regions)), dtype=torch.uint8, generator=gen)
    before = [t.clone() for t in (*regions.values(), *host.values(), packed)]
    with pytest.raises(TypeError, match=rf"^{re.escape(named)} must be a list or mapping of region tensors, got \w+$"):
        call(regions, host, packed, ids)
    assert all(torch.equal(a, b) for a, b in zip(before, [*regions.values(), *host.values(), packed]))


# --- objects built on an engine: the engine must be one ---------------------------------------------


@pytest.mark.parametrize("make", [kv_ops.LayerwiseLoads, kv_ops.StepTransfers], ids=["LayerwiseLoads", "StepTransfers"])
@pytest.mark.parametrize("engine", [{}, None, "engine", [1, 2]], ids=["dict", "None", "str", "list"])
def test_something_else_where_the_engine_goes_is_a_type_error_naming_it(make, engine):
    name = unique("first-contact")
    with pytest.raises(TypeError) as refused:
        make(engine, name)
    assert str(refused.value) == f"{make.__name__}: engine must be a kv_ops.OffloadEngine, got {type(engine).__name__}"
    with make_engine(seed=7) as real:  # the refusal took nothing: the name is still free
        make(real, name).close()


# --- caches on the meta device, num_blocks of the wrong type ---------------------------------------


def _caches_with_one_meta_layer(seed):
    caches = make_caches(seed, layers=3)
    caches["layer1"] = caches["layer1"].to("meta")
    return caches


@pytest.mark.parametrize(
    "call, owner",
    [
        (lambda c: kv_ops.infer_regions(c, NUM_BLOCKS), "infer_regions"),
        (lambda c: kv_ops.OffloadEngine(c, NUM_BLOCKS, capacity_bytes=1 << 20), "OffloadEngine"),
        (lambda c: kv_ops.OffloadEngine(c, NUM_BLOCKS, capacity_bytes=1 << 20, disk_dir="/nowhere"), "OffloadEngine"),
        (
            lambda c: kv_ops.resolve_regions(c, [kv_ops.KVCacheTensorSpec(["layer0"], 4096, 2 * 4096 * 16)], 16),
            "resolve_regions",
        ),
    ],
    ids=["infer_regions", "OffloadEngine", "OffloadEngine-disk", "resolve_regions"],
)
def test_meta_caches_are_refused_naming_the_function_the_layer_and_the_device(call, owner):
    with pytest.raises(ValueError) as refused:
        call(_caches_with_one_meta_layer(seed=8))
    assert str(refused.value) == (
        f"{owner}: kv_caches['layer1'] is on meta, but the caches must be CUDA or CPU tensors "
        "(a meta tensor holds no bytes to move)"
    )


@pytest.mark.parametrize("value", ["64", 16.0, 0, None, True])
@pytest.mark.parametrize("specs", [False, True], ids=["inferred", "specs"])
def test_a_bad_num_blocks_names_offload_engine_not_a_helper(value, specs):
    caches = make_caches(seed=9)
    kw = {"specs": [kv_ops.KVCacheTensorSpec(["layer0"], 4096, 2 * 4096 * 16)]} if specs else {}
    with pytest.raises(ValueError) as refused:
        kv_ops.OffloadEngine(caches, value, capacity_bytes=1 << 20, **kw)
    assert str(refused.value) == f"OffloadEngine: num_blocks must be a positive integer, got {value!r}"


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(disk_dir=5), "OffloadEngine: disk_dir must be a path (a non-empty str or os.PathLike), got 5"),
        (
            dict(crossover_file=b"x"),
            "OffloadEngine: crossover_file must be a path (a non-empty str or os.PathLike), got b'x'",
        ),
        (
            dict(crossover_file=True),
            "OffloadEngine: crossover_file must be a path (a non-empty str or os.PathLike), got True",
        ),
        (dict(page_cache="no"), "OffloadEngine: page_cache must be True or False, got 'no'"),
    ],
    ids=["disk_dir", "crossover_file", "crossover_file_bool", "page_cache"],
)
def test_an_engine_argument_of_the_wrong_type_is_refused_naming_it(kw, message, tmp_path):
    if "page_cache" in kw:
        kw["disk_dir"] = str(tmp_path)
    with pytest.raises(ValueError) as refused:
        kv_ops.OffloadEngine(make_caches(seed=10), NUM_BLOCKS, capacity_bytes=1 << 20, **kw)
    assert str(refused.value) == message
    assert os.listdir(tmp_path) == []


# --- a closed object: one exception type, whatever the object ---------------------------------------


def test_closed_error_is_one_type_that_old_except_clauses_still_catch():
    assert kv_ops.EngineClosedError is kv_ops.ClosedError
    assert issubclass(kv_ops.ClosedError, ValueError) and issubclass(kv_ops.ClosedError, RuntimeError)


def _closed_engine(engine, objects):
    engine.close()
    return engine.store, "OffloadEngine.store: the engine is closed"


def _closed_loads(engine, objects):
    objects["loads"].close()
    return objects["loads"].start, f"LayerwiseLoads.start: {objects['loads'].name!r} was closed"


def _closed_transfers(engine, objects):
    objects["transfers"].close()
    return (
        lambda host, gpu: objects["transfers"].stage(load=(host, gpu)),
        f"StepTransfers.stage: {objects['transfers'].name!r} was closed",
    )


def _engine_under_loads(engine, objects):
    engine.close()
    return objects["loads"].start, "LayerwiseLoads.start: the engine is closed"


def _engine_under_transfers(engine, objects):
    engine.close()
    return lambda host, gpu: objects["transfers"].stage(load=(host, gpu)), "StepTransfers.stage: the engine is closed"


@pytest.mark.parametrize(
    "close",
    [_closed_engine, _closed_loads, _closed_transfers, _engine_under_loads, _engine_under_transfers],
    ids=["engine", "LayerwiseLoads", "StepTransfers", "engine-under-LayerwiseLoads", "engine-under-StepTransfers"],
)
def test_a_call_on_a_closed_object_raises_closed_error_naming_the_call(close):
    engine = make_engine(seed=11)
    objects = {
        "loads": kv_ops.LayerwiseLoads(engine, unique("closed-lw")),
        "transfers": kv_ops.StepTransfers(engine, unique("closed-st")),
    }
    try:
        caches = [c.clone() for c in engine.regions.values()]
        call, words = close(engine, objects)
        gen = torch.Generator().manual_seed(12)
        host, gpu = (
            torch.randperm(8, generator=gen)[:3].tolist(),
            torch.randperm(NUM_BLOCKS, generator=gen)[:3].tolist(),
        )
        with pytest.raises(kv_ops.ClosedError) as refused:
            call(host, gpu)
        assert str(refused.value).startswith(words), str(refused.value)
        assert all(torch.equal(a, b) for a, b in zip(caches, engine.regions.values())), "a refused call moved bytes"
        for expected in (ValueError, RuntimeError):  # what each object raised here before
            with pytest.raises(expected):
                call(host, gpu)
    finally:
        for o in objects.values():
            o.close()
        engine.close()


def test_building_on_a_closed_engine_names_what_is_being_built():
    engine = make_engine(seed=13)
    engine.close()
    for make in (kv_ops.LayerwiseLoads, kv_ops.StepTransfers):
        with pytest.raises(kv_ops.ClosedError, match=rf"^{make.__name__}: the engine is closed"):
            make(engine, unique("on-closed"))


# --- StepTransfers.stage twice with no step between -------------------------------------------------


def test_staging_twice_without_a_step_says_so_and_keeps_the_first_stage():
    caches = make_caches(seed=14)
    engine = make_engine(seed=14, caches=caches)
    name = unique("twice")
    transfers = kv_ops.StepTransfers(engine, name)
    try:
        gen = torch.Generator().manual_seed(15)
        gpu, host = (
            torch.randperm(NUM_BLOCKS, generator=gen)[:4].tolist(),
            torch.randperm(8, generator=gen)[:4].tolist(),
        )
        mirror = engine.mirror.clone()
        transfers.stage(store=(gpu[:2], host[:2]))
        with pytest.raises(RuntimeError) as refused:
            transfers.stage(store=(gpu[2:], host[2:]))
        assert str(refused.value) == (
            "StepTransfers.stage: the transfers staged last were not read by a step yet; a stage is read by the "
            f"next step, so run the step, which calls kv_ops.step_transfers({name!r}, ...), before staging again"
        )
        kv_ops.step_transfers(name, list(caches.values()))
        rows = torch.cat([r[gpu] for r in engine.regions.values()], dim=1)
        assert torch.equal(engine.mirror[host[:2]], rows[:2]), "the first stage was lost"
        assert torch.equal(engine.mirror[host[2:]], mirror[host[2:]]), "the refused stage was written"
    finally:
        transfers.close()
        engine.close()


# --- the end of a program that never closed its engine ----------------------------------------------

# One run: an engine on `device` over random caches, blocks stored and settled, then transfers left
# in flight (loads from the settled host blocks, stores to others) and no close(). A check
# registered before kv_ops is imported runs after kv_ops' own exit hook (atexit runs last in, first
# out) and fails the run unless what was in flight landed and the engine is closed. On the CPU the
# parent imports once and forks the runs (an import costs more than a run): each child ends as any
# program does, by falling off its end, and the parent prints the children's exit statuses. On a
# GPU each run is a process of its own.
EXIT_SCRIPT = r"""
import atexit, json, os, random, sys, warnings

checks = []
atexit.register(lambda: [check() for check in checks])
warnings.simplefilter("ignore")  # without CUDA, pinned_empty warns that its memory is pageable

import torch
import kv_ops

BLOCKS, HOST = 64, 48


def fail(message):
    sys.stderr.write(f"FAILED: {message}\n")
    sys.stderr.flush()
    os._exit(3)


def run(device, tier, seed, disk_dir):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    caches = {
        f"layer{i}": torch.randint(0, 256, (2, BLOCKS, 16, 8, 64), dtype=torch.uint8, generator=gen)
        .view(torch.bfloat16)
        .to(device)
        for i in range(2)
    }
    kw = dict(disk_dir=disk_dir, staging_blocks=1) if tier == "disk" else dict(path=tier)
    engine = kv_ops.OffloadEngine(caches, BLOCKS, capacity_bytes=HOST * (32 << 10), **kw)
    regions = list(engine.regions.values())
    rows = lambda blocks: torch.cat([r[blocks].cpu() for r in regions], dim=1)  # as mirror rows
    source = rows(list(range(BLOCKS // 2)))  # GPU blocks [0, BLOCKS/2) are read, never written
    settled = rng.sample(range(HOST // 2), rng.randint(1, HOST // 2))
    sources = rng.sample(range(BLOCKS // 2), len(settled))
    engine.store(sources, settled)
    engine.flush()
    held = {h: source[s] for h, s in zip(settled, sources)}  # what the settled host blocks hold
    plan, landed, stored = [], {}, {}  # the transfers to leave in flight, and what they must leave
    for _ in range(rng.randint(0, 12)):
        n = rng.randint(1, HOST // 2)
        if rng.random() < 0.5:
            host, gpu = rng.choices(settled, k=n), rng.sample(range(BLOCKS // 2, BLOCKS), n)
            plan.append((engine.load, host, gpu))
            landed.update({g: held[h] for g, h in zip(gpu, host)})
        else:
            gpu, host = rng.choices(range(BLOCKS // 2), k=n), rng.sample(range(HOST // 2, HOST), n)
            plan.append((engine.store, gpu, host))
            stored.update({h: source[g] for g, h in zip(gpu, host)})
    for transfer, a, b in plan:  # back to back, so that they are still in flight when the program ends
        transfer(a, b)
    mirror = engine.mirror  # None on the disk tier; kept here to be read after the engine let go of it

    def check():
        try:
            engine.poll()
        except kv_ops.ClosedError:
            pass
        else:
            fail(f"{tier}: the engine is still open after kv_ops' exit hook")
        for g, want in landed.items():
            if not torch.equal(rows([g])[0], want):
                fail(f"{tier}: a load in flight at exit did not land in GPU block {g}")
        for h, want in stored.items():
            if mirror is not None and not torch.equal(mirror[h].cpu(), want):
                fail(f"{tier}: a store in flight at exit did not land in host block {h}")

    checks.append(check)


device, tier, runs, first_seed, base = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
if device == "cuda":  # one run in this process: CUDA cannot be forked once it is initialised
    run(device, tier, first_seed, os.path.join(base, "run0"))
else:  # the runs side by side: contention only varies where each exit finds the I/O thread
    children, child = [], False
    for i in range(runs):
        disk_dir = os.path.join(base, f"run{i}")
        os.makedirs(disk_dir)
        pid = os.fork()
        if pid == 0:
            child = True
            run(device, tier, first_seed + i, disk_dir)
            break
        children.append(pid)
    if not child:
        print(json.dumps([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]))
"""

ALARMS = re.compile(r"terminate|traceback|error|abort|exception|failed|leaked", re.I)
CPU_TIERS = ["kernel", "staged", "dma", "auto", "disk"]


def _shm():
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


# CUDA's own IPC files carry their process's id in hex ("cuda.shm.0.2fa.1"): one whose process
# is alive is another program's (the runs checked have all exited by then).
CUDA_SHM = re.compile(r"cuda\.shm\.\d+\.([0-9a-f]+)\.")


def _left_in_shm(before: set[str]) -> set[str]:
    """What appeared in /dev/shm since ``before``, less CUDA's files of processes still alive."""
    new = _shm() - before
    return {n for n in new if not ((m := CUDA_SHM.match(n)) and os.path.exists(f"/proc/{int(m[1], 16)}"))}


def _run_exit_script(tmp_path, device, tier, runs, seed, shm=True):
    script = tmp_path / "exit_without_close.py"
    script.write_text(EXIT_SCRIPT)
    base = tmp_path / tier
    base.mkdir()
    if device == "cuda":
        os.makedirs(base / "run0")
    before = _shm() if shm else None
    out = subprocess.run(
        [sys.executable, str(script), device, tier, str(runs), str(seed), str(base)],
        capture_output=True,
        text=True,
        timeout=300,  # a hang fails here rather than holding the suite
        cwd=ROOT,
    )
    output = out.stdout + out.stderr
    assert out.returncode == 0, output[-4000:]
    assert not ALARMS.search(output), output[-4000:]
    left = {d.name: os.listdir(d) for d in base.iterdir() if os.listdir(d)}
    assert left == {}, f"the disk tier left files behind: {left}"
    if shm:
        assert _left_in_shm(before) == set(), "an engine left something in /dev/shm"
    return out.stdout


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_the_shm_check_leaves_out_only_cuda_files_of_processes_still_alive():
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    tag = uuid.uuid4().hex[:8]
    live = f"cuda.shm.0.{os.getpid():x}.{tag}"
    dead = f"cuda.shm.0.{int(gone.stdout):x}.{tag}"
    ours = f"kv-ops-test-{tag}"
    before = _shm()
    try:
        for name in (live, dead, ours):
            open(os.path.join("/dev/shm", name), "w").close()
        left = _left_in_shm(before)
        assert {dead, ours} <= left and live not in left, left
    finally:
        for name in (live, dead, ours):
            if os.path.exists(os.path.join("/dev/shm", name)):
                os.unlink(os.path.join("/dev/shm", name))


@pytest.mark.parametrize("tier", CPU_TIERS)
def test_a_cpu_program_that_never_closes_its_engine_exits_cleanly(tier, tmp_path):
    # 20 runs a tier: the abort this guards against (the disk tier's I/O thread racing the exit)
    # hit only some runs.
    runs = 20
    stdout = _run_exit_script(tmp_path, "cpu", tier, runs, seed=100 * CPU_TIERS.index(tier))
    assert json.loads(stdout) == [0] * runs, stdout


@gpu
@pytest.mark.parametrize("tier", ["kernel", "staged", "dma", "disk"])
def test_a_gpu_program_that_never_closes_its_engine_exits_cleanly(tier, tmp_path):
    # 20 runs, a process each (CUDA is not forked), five at a time; /dev/shm is checked around all.
    before = _shm()
    for run in range(20):
        (tmp_path / str(run)).mkdir()
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        runs = [pool.submit(_run_exit_script, tmp_path / str(r), "cuda", tier, 1, r, False) for r in range(20)]
        for run in runs:
            run.result()
    assert _left_in_shm(before) == set(), "an engine left something in /dev/shm"
