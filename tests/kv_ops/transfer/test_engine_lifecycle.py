"""OffloadEngine's lifecycle: close() waits for every transfer and then frees, every call after it
is refused, the engine is a context manager, and a killed process leaves nothing in disk_dir.

The GPU tests hold the transfer behind torch.cuda._sleep on the caller's stream and read the
result without any device synchronisation of their own: only close() can have waited for it.
"""

import gc
import os
import select
import signal
import subprocess
import sys
import threading
import warnings
import weakref

import pytest
import torch

import kv_ops
from kv_ops.transfer.engine import EngineClosedError
from kv_ops.transfer.paths import RING_SLOTS

gpu = pytest.mark.gpu
PATHS = pytest.mark.parametrize("path", ["kernel", "staged", "dma"])
ROOT = os.path.dirname(os.path.dirname(kv_ops.__file__))


def random_bytes(shape, gen, device="cpu"):
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to(device)


def make_engine(device="cpu", path="kernel", disk_dir=None, seed=0, **disk):
    """Two regions of 256 B (K/V of one layer) and one of 192 B, filled with random bytes; the
    staged path's ring holds 2 rows per slot, so a 4-block transfer is two chunks."""
    gen = torch.Generator().manual_seed(seed)
    kv = {
        "attn0": random_bytes((2, 32, 4, 2, 32), gen, device).view(torch.bfloat16),
        "mla1": random_bytes((32, 4, 48), gen, device).view(torch.float16),
    }
    capacity = 40 * 4096 if disk_dir is not None else 40 * 704
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA: pinned_empty warns that it returns plain memory
        ring = RING_SLOTS * 2 * 704
        engine = kv_ops.OffloadEngine(kv, 32, capacity, disk_dir=disk_dir, path=path, ring_bytes=ring, **disk)
    if engine.mirror is not None:
        engine.mirror.copy_(random_bytes(engine.mirror.shape, gen))  # poison: a block never written shows
    return engine


def packed(engine, gpu_ids):
    """The bytes the engine stores for GPU blocks ``gpu_ids``: every region's block, in order."""
    return torch.cat([r[gpu_ids].cpu() for r in engine.regions.values()], dim=1)


def read_slots(fd, first, count, stride, width):
    """Slots ``first..first+count-1`` of a disk tier file, straight from the file, as [count, width]."""
    raw = os.pread(fd, count * stride, first * stride)
    assert len(raw) == count * stride
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(count, stride)[:, :width]


# --- close: flush, then free ---------------------------------------------------------------------


@pytest.mark.parametrize("tier", ["mirror", "disk"])
def test_close_reports_what_is_left_frees_everything_and_is_idempotent(tmp_path, tier):
    engine = make_engine(
        disk_dir=str(tmp_path) if tier == "disk" else None, page_cache=tier == "disk", staging_blocks=2
    )
    first = engine.store([0, 1, 2], [0, 1, 2])
    assert engine.flush().stores == [first]
    rest = [engine.store([3, 4, 5], [3, 4, 5]), engine.load([0, 1], [10, 11]), engine.store([6], [6])]
    thread = engine.disk.thread if tier == "disk" else None
    done = engine.close()
    # Everything not reported before, exactly once, in issue order per direction.
    assert done == kv_ops.Completed(stores=[rest[0], rest[2]], loads=[rest[1]])
    assert engine.mirror is None and engine.mirror_regions is None and engine.disk is None
    if tier == "disk":
        assert not thread.is_alive() and os.listdir(tmp_path) == []
    assert engine.close() == kv_ops.Completed()  # a second close does nothing
    assert torch.equal(engine.regions["mla1"][10:12], engine.regions["mla1"][0:2])  # the load landed


@pytest.mark.parametrize("tier", ["mirror", "disk"])
@pytest.mark.parametrize(
    "name, call",
    [
        ("store", lambda e: e.store([0], [0])),
        ("load", lambda e: e.load([0], [0])),
        ("poll", lambda e: e.poll()),
        ("flush", lambda e: e.flush()),
        ("store", lambda e: e.store([0.5], [99])),  # bad ids too: the closed engine is what is reported
    ],
    ids=["store", "load", "poll", "flush", "store-bad-ids"],
)
def test_every_call_after_close_raises_a_clear_error(tmp_path, tier, name, call):
    engine = make_engine(disk_dir=str(tmp_path) if tier == "disk" else None, page_cache=tier == "disk")
    engine.close()
    with pytest.raises(EngineClosedError, match=rf"OffloadEngine\.{name}: the engine is closed"):
        call(engine)
    assert issubclass(EngineClosedError, RuntimeError)


@pytest.mark.parametrize("tier", ["mirror", "disk"])
def test_entering_a_closed_engine_raises_as_every_call_does(tmp_path, tier):
    engine = make_engine(disk_dir=str(tmp_path) if tier == "disk" else None, page_cache=tier == "disk", seed=7)
    engine.close()
    entered = []
    with pytest.raises(EngineClosedError, match=r"^OffloadEngine\.__enter__: the engine is closed"):
        with engine:
            entered.append(True)
    assert entered == []


def test_the_engine_is_a_context_manager_that_closes_even_on_an_error(tmp_path):
    with make_engine(disk_dir=str(tmp_path), page_cache=True) as engine:
        tid = engine.store([1, 2], [3, 4])
        thread = engine.disk.thread
    assert not thread.is_alive() and os.listdir(tmp_path) == []
    with pytest.raises(EngineClosedError):
        engine.poll()
    with pytest.raises(KeyError, match="boom"):
        with make_engine(disk_dir=str(tmp_path), page_cache=True) as engine:
            engine.store([1, 2], [3, 4])
            thread = engine.disk.thread
            raise KeyError("boom")
    assert not thread.is_alive() and os.listdir(tmp_path) == []
    with pytest.raises(EngineClosedError, match="OffloadEngine.load"):
        engine.load([0], [0])
    assert tid == 0


def test_close_runs_every_queued_disk_job_before_the_file_closes(tmp_path):
    # Many small jobs through one-block staging buffers: the I/O thread is still busy when close()
    # is called. Their bytes must all be in the file, read through a duplicate descriptor.
    engine = make_engine(disk_dir=str(tmp_path), page_cache=True, staging_blocks=1)
    gen = torch.Generator().manual_seed(4)
    file = engine.disk.file
    dup = os.dup(file.fd)
    try:
        pairs = [(torch.randperm(32, generator=gen)[:3], torch.randperm(40, generator=gen)[:3]) for _ in range(30)]
        want = {}
        tids = []
        for gpu_ids, slots in pairs:
            tids.append(engine.store(gpu_ids, slots))
            for g, s in zip(gpu_ids.tolist(), slots.tolist()):
                want[s] = g  # later stores overwrite earlier ones, in issue order
        done = engine.close()
        assert done.stores == tids and not done.failed
        for s, g in want.items():
            assert torch.equal(
                read_slots(dup, s, 1, file.slot_stride, engine.block_bytes)[0], packed(engine, [g])[0]
            ), s
    finally:
        os.close(dup)
    assert os.listdir(tmp_path) == []


# --- dropped without close() ----------------------------------------------------------------------


def open_fds_under(directory):
    """This process's descriptors whose target lies in ``directory`` (an unlinked file included)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself used, closed by now
            continue
        if target.startswith(str(directory) + os.sep):
            found.append(fd)
    return found


@pytest.mark.parametrize("in_flight", [False, True], ids=["idle", "in-flight"])
def test_a_disk_engine_dropped_without_close_releases_its_thread_and_file_once_collected(tmp_path, in_flight):
    fds = len(os.listdir("/proc/self/fd"))
    engine = make_engine(disk_dir=str(tmp_path), page_cache=True, staging_blocks=2)
    thread = engine.disk.thread
    assert thread.is_alive() and len(open_fds_under(tmp_path)) == 1
    engine.store([0, 1, 2, 3, 4], [0, 1, 2, 3, 4])
    if not in_flight:
        engine.flush()
    alive = weakref.ref(engine)
    del engine
    gc.collect()
    assert alive() is None  # nothing (the finalizer least of all) keeps the engine alive
    thread.join(10)  # the finalizer has asked it to stop; joining only waits for that
    assert not thread.is_alive() and thread not in threading.enumerate()
    assert open_fds_under(tmp_path) == [] and len(os.listdir("/proc/self/fd")) == fds
    assert os.listdir(tmp_path) == []


def test_close_then_collection_closes_the_disk_tier_once(tmp_path):
    engine = make_engine(disk_dir=str(tmp_path), page_cache=True)
    thread = engine.disk.thread
    engine.close()
    assert not thread.is_alive() and open_fds_under(tmp_path) == []
    other = os.open(os.devnull, os.O_RDONLY)  # likely the number the file had: a second close would hit it
    try:
        del engine
        gc.collect()
        os.fstat(other)  # still open
    finally:
        os.close(other)


# --- the store rule: write a block again only after its store is reported ---------------------------


@pytest.mark.parametrize("tier", ["mirror", "disk"])
def test_after_flush_the_stored_copy_is_the_block_as_it_was_at_store(tmp_path, tier):
    # The documented guarantee (OffloadEngine.store): a block the caller leaves alone until the
    # store is reported is stored as it was at the call, while other blocks change meanwhile; a
    # write after the report does not reach the stored copy. Both tiers, the same rule.
    gen = torch.Generator().manual_seed(21)
    engine = make_engine(
        disk_dir=str(tmp_path) if tier == "disk" else None, page_cache=tier == "disk", staging_blocks=2
    )
    stored = [3, 8, 9, 14, 30]
    want = packed(engine, stored)
    tid = engine.store(stored, [7, 0, 1, 2, 39])
    for region in engine.regions.values():  # the caller goes on writing blocks it did not store
        region[[0, 1, 2, 20]] = random_bytes((4, region.shape[1]), gen)
    assert engine.flush().stores == [tid]
    for region in engine.regions.values():  # reported: the stored blocks may be reused now
        region[stored] = random_bytes((len(stored), region.shape[1]), gen)
    load = engine.load([7, 0, 1, 2, 39], [25, 26, 27, 28, 29])
    assert engine.flush().loads == [load]
    assert torch.equal(packed(engine, [25, 26, 27, 28, 29]), want)
    engine.close()


# --- nothing left behind -------------------------------------------------------------------------

_KILLED_CHILD = """
import sys, warnings
sys.path[:0] = [{root!r}]
warnings.simplefilter("ignore")
import torch, kv_ops

kv = {{"attn0": torch.randint(0, 256, (2, 32, 4, 2, 32), dtype=torch.uint8).view(torch.bfloat16)}}
def open_engine(page_cache):
    return kv_ops.OffloadEngine(kv, 32, 64 * 4096, disk_dir={directory!r}, page_cache=page_cache, staging_blocks=4)
try:
    engine = open_engine(False)  # O_DIRECT, the default
except OSError as e:
    if "does not support O_DIRECT" not in str(e):
        raise
    engine = open_engine(True)
tid = engine.store(list(range(16)), list(range(16)))
assert engine.flush().stores == [tid]
print("stored", engine.disk.file.fd, flush=True)
i = 0
while True:  # keep the I/O thread writing: the kill lands in the middle of transfers
    engine.store([i % 32, (i + 1) % 32], [i % 64, (i + 7) % 64])
    i += 1
    if i % 32 == 0:
        engine.flush()
"""


def test_a_killed_engine_leaves_nothing_and_a_restart_in_the_same_directory_works(tmp_path):
    code = _KILLED_CHILD.format(root=ROOT, directory=str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([child.stdout], [], [], 120)
        line = child.stdout.readline() if ready else ""
        if not line.startswith("stored"):
            child.kill()
            raise AssertionError(f"the child did not store: {line!r} {child.stderr.read()}")
        fd = int(line.split()[1])
        # While it runs, its file is already nameless: only its descriptor reaches it.
        assert os.readlink(f"/proc/{child.pid}/fd/{fd}").endswith("(deleted)")
        assert os.listdir(tmp_path) == []
        child.send_signal(signal.SIGKILL)  # no handler, no atexit, no close(): only the kernel cleans up
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
        child.stderr.close()
    assert child.returncode == -signal.SIGKILL
    assert os.listdir(tmp_path) == []
    # A restart with the same tag in the same directory: nothing to clean up, nothing in the way.
    with make_engine(disk_dir=str(tmp_path), page_cache=True, staging_blocks=4, seed=1) as engine:
        want = packed(engine, [5, 6, 7])
        store = engine.store([5, 6, 7], [20, 21, 22])
        load = engine.load([20, 21, 22], [0, 1, 2])
        assert engine.flush() == kv_ops.Completed([store], [load])
        assert torch.equal(packed(engine, [0, 1, 2]), want)
    assert os.listdir(tmp_path) == []


# --- GPU: close waits for copies still queued behind the caller's compute -------------------------


@gpu
@PATHS
def test_close_waits_for_a_store_queued_behind_the_callers_compute(path):
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        engine = make_engine("cuda", path=path)
        mirror = engine.mirror_regions  # close() drops the engine's references; the memory lives on with these views
        fresh = random_bytes((4, 192), gen)
        fresh_dev = fresh.cuda()
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # the "forward pass" is still running...
        engine.regions["mla1"][:4].copy_(fresh_dev)  # ...and writes the blocks at its end
        tid = engine.store([0, 1, 2, 3], [10, 11, 12, 13])
        assert engine.close() == kv_ops.Completed(stores=[tid])
        # Host memory, read by the CPU with no synchronisation here: close() must have waited.
        assert torch.equal(mirror["mla1"][10:14], fresh)


@gpu
@PATHS
def test_close_waits_for_a_load_queued_behind_the_callers_compute(path):
    side = torch.cuda.Stream()
    for seed in range(3):
        engine = make_engine("cuda", path=path, seed=seed)
        want = engine.mirror_regions["mla1"][20:24].clone()  # random poison from make_engine
        region = engine.regions["mla1"]
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # readers of blocks 4..7 are still queued
        tid = engine.load([20, 21, 22, 23], [4, 5, 6, 7])
        assert engine.close() == kv_ops.Completed(loads=[tid])
        # Read on a stream that does not wait for the sleep: had close() not waited, the load
        # would still be queued behind it and this would see the old blocks.
        with torch.cuda.stream(side):
            got = region[4:8].to("cpu")
        assert torch.equal(got, want)


@gpu
def test_close_waits_for_a_disk_store_queued_behind_the_callers_compute(tmp_path):
    gen = torch.Generator().manual_seed(9)
    engine = make_engine("cuda", disk_dir=str(tmp_path), page_cache=True, staging_blocks=2)
    file = engine.disk.file
    dup = os.dup(file.fd)
    try:
        # A first store compiles the gather; inside the timed part it could outlast the sleep.
        warm = engine.store([0, 1, 2, 3], [0, 1, 2, 3])
        assert engine.flush().stores == [warm]
        fresh = {n: random_bytes((4, r.shape[1]), gen) for n, r in engine.regions.items()}
        fresh_dev = {n: t.cuda() for n, t in fresh.items()}
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)
        for n, r in engine.regions.items():
            r[:4].copy_(fresh_dev[n])
        tid = engine.store([0, 1, 2, 3], [5, 6, 7, 8])
        assert engine.close() == kv_ops.Completed(stores=[tid])
        want = torch.cat([fresh[n] for n in engine.regions], dim=1)
        assert torch.equal(read_slots(dup, 5, 4, file.slot_stride, engine.block_bytes), want)
    finally:
        os.close(dup)
    assert os.listdir(tmp_path) == []
