"""Disk-tier faults on real files, no mocks: a write that hits the file size limit in the middle of
a run, and reads of a file truncated under the engine. Each fault fails exactly its own transfer
(reported in Completed.failed with the OS error); every other transfer, issued before or after it
in the same flush, moves its bytes, and the slots and GPU blocks of other transfers keep theirs.
"""

import errno
import os
import subprocess
import sys
import warnings

import pytest
import torch

import kv_ops

gpu = pytest.mark.gpu
DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
ROOT = os.path.dirname(os.path.dirname(kv_ops.__file__))
SLOT = 4096


def open_disk_engine(directory, device="cpu", staging_blocks=4, seed=0):
    """16 slots of 4 KiB; one layer, K/V-first: two regions of 256 B. Random bytes in the cache.
    O_DIRECT where the file system has it, buffered I/O where it does not."""
    gen = torch.Generator().manual_seed(seed)
    kv = {
        "attn0": torch.randint(0, 256, (2, 32, 4, 2, 32), dtype=torch.uint8, generator=gen)
        .to(device)
        .view(torch.bfloat16)
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for page_cache in (False, True):
            try:
                return kv_ops.OffloadEngine(
                    kv, 32, 16 * SLOT, disk_dir=str(directory), staging_blocks=staging_blocks, page_cache=page_cache
                )
            except OSError as e:
                if page_cache or "does not support O_DIRECT" not in str(e):
                    raise


def packed(engine, gpu_ids):
    return torch.cat([r[torch.as_tensor(gpu_ids, device=r.device)].cpu() for r in engine.regions.values()], dim=1)


def scramble(engine, gen):
    for r in engine.regions.values():
        r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8, generator=gen).to(r.device))


# The child runs the whole scenario (a resource limit applies to the whole process) and asserts
# as it goes; the parent checks that it got to the end.
_FILE_SIZE_LIMIT = """
import errno, resource, signal, sys
sys.path[:0] = [{root!r}, {tests!r}]
import torch
from test_engine_faults import open_disk_engine, packed, scramble, SLOT

gen = torch.Generator().manual_seed(1)
engine = open_disk_engine({directory!r})  # the whole file is allocated before the limit
s0 = engine.store([0, 1, 2, 3], [10, 11, 12, 13])  # slots above the coming limit
assert engine.flush().stores == [s0]
want = {{slot: packed(engine, [g])[0] for g, slot in zip([0, 1, 2, 3], [10, 11, 12, 13])}}

# Writes at or past 8 slots now fail in the kernel: a write that straddles the limit is cut
# short at it, and the write of the rest gets EFBIG (the error a full disk gives as ENOSPC).
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # otherwise the process is killed instead
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (8 * SLOT, hard))

a = engine.store([4, 5], [0, 1])
b = engine.store([6, 7, 8, 9], [6, 7, 8, 9])  # one run, one staging chunk: slots 6, 7 then EFBIG
c = engine.store([10, 11], [2, 3])
load = engine.load([10, 11, 12, 13], [20, 21, 22, 23])  # reads are not limited
done = engine.flush()
assert done.stores == [a, c] and done.loads == [load], done
assert list(done.failed) == [b], done.failed
error = done.failed[b]
assert isinstance(error, OSError) and error.errno == errno.EFBIG, repr(error)
assert "disk tier write of slots 6..9" in str(error) and "File too large" in str(error), str(error)
assert torch.equal(packed(engine, [20, 21, 22, 23]), torch.stack([want[s] for s in (10, 11, 12, 13)]))
for g, slot in [(4, 0), (5, 1), (10, 2), (11, 3)]:
    want[slot] = packed(engine, [g])[0]

# Still over the limit: fails again, alone. Under it: works.
b2 = engine.store([12], [9])
d = engine.store([13, 14], [4, 5])
done = engine.flush()
assert done.stores == [d] and list(done.failed) == [b2] and done.failed[b2].errno == errno.EFBIG, done
for g, slot in [(13, 4), (14, 5)]:
    want[slot] = packed(engine, [g])[0]

# The limit lifted (the disk has room again): the same slots take the same store.
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
e = engine.store([6, 7, 8, 9], [6, 7, 8, 9])
assert engine.flush().stores == [e]
for g, slot in zip([6, 7, 8, 9], [6, 7, 8, 9]):
    want[slot] = packed(engine, [g])[0]

# Every slot of every successful store holds its bytes, read back through loads.
scramble(engine, gen)
slots = sorted(want)
load = engine.load(slots, list(range(len(slots))))
assert engine.flush().loads == [load]
got = packed(engine, list(range(len(slots))))
for i, slot in enumerate(slots):
    assert torch.equal(got[i], want[slot]), f"slot {{slot}}"
engine.close()
print("OK", len(slots))
"""


def test_a_write_past_the_file_size_limit_fails_only_its_own_store(tmp_path):
    tests = os.path.dirname(os.path.abspath(__file__))
    code = _FILE_SIZE_LIMIT.format(root=ROOT, tests=tests, directory=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip() == "OK 14", out.stdout
    assert os.listdir(tmp_path) == []


@DEVICES
def test_reads_of_a_truncated_file_fail_only_their_own_loads(tmp_path, device):
    gen = torch.Generator().manual_seed(2)
    engine = open_disk_engine(tmp_path, device)
    a = engine.store([0, 1, 2, 3], [0, 1, 2, 3])
    b = engine.store([4, 5, 6, 7], [8, 9, 10, 11])
    c = engine.store([8, 9], [12, 13])
    assert engine.flush().stores == [a, b, c]
    want = {slot: packed(engine, [g])[0] for g, slot in zip(range(10), [0, 1, 2, 3, 8, 9, 10, 11, 12, 13])}

    # Someone else cuts the (nameless) file to 10 slots through /proc: slots 10..15 are gone.
    os.truncate(f"/proc/self/fd/{engine.disk.file.fd}", 10 * SLOT)
    scramble(engine, gen)
    cache = {n: r.clone() for n, r in engine.regions.items()}

    ok = engine.load([0, 1, 2, 3], [16, 17, 18, 19])
    short = engine.load([8, 9, 10, 11], [20, 21, 22, 23])  # one run: 2 slots read, then end of file
    gone = engine.load([12, 13], [24, 25])  # starts past the end
    ok2 = engine.load([9], [26])
    done = engine.flush()
    assert done.loads == [ok, ok2] and sorted(done.failed) == [short, gone], done
    for tid, slots in [(short, "8..11"), (gone, "12..13")]:
        error = done.failed[tid]
        assert isinstance(error, OSError) and error.errno == errno.EIO, repr(error)
        assert f"disk tier read of slots {slots}" in str(error) and "end of file" in str(error), str(error)
    assert torch.equal(packed(engine, [16, 17, 18, 19]), torch.stack([want[s] for s in (0, 1, 2, 3)]))
    assert torch.equal(packed(engine, [26])[0], want[9])
    # Blocks no load wrote keep their bytes (the failed loads' destinations are undefined).
    untouched = torch.tensor([i for i in range(32) if not 16 <= i <= 26], device=device)
    for n, r in engine.regions.items():
        assert torch.equal(r[untouched], cache[n][untouched]), n

    # Later transfers work: a store past the new end extends the file again, and reads it back.
    e = engine.store([0, 1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15])
    assert engine.flush().stores == [e]
    for g, slot in zip(range(6), range(10, 16)):
        want[slot] = packed(engine, [g])[0]
    scramble(engine, gen)
    slots = [0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15]
    load = engine.load(slots, list(range(20, 32)))
    assert engine.flush() == kv_ops.Completed(loads=[load])
    assert torch.equal(packed(engine, list(range(20, 32))), torch.stack([want[s] for s in slots]))
    engine.close()
    assert os.listdir(tmp_path) == []


@gpu
def test_a_disk_store_does_not_overwrite_a_staging_buffer_a_queued_load_still_reads(tmp_path):
    # The load's scatter waits behind the caller's compute; a store issued from another, idle
    # stream is the next job on the I/O thread and packs into the same staging buffer. It must
    # wait for the scatter, or the load would put the store's blocks into its destination.
    gen = torch.Generator().manual_seed(3)
    engine = open_disk_engine(tmp_path, "cuda")
    stored = engine.store([0, 1, 2, 3], [0, 1, 2, 3])
    assert engine.flush().stores == [stored]
    want = packed(engine, [0, 1, 2, 3])
    scramble(engine, gen)
    other = packed(engine, [8, 9, 10, 11])
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    for _ in range(3):
        torch.cuda._sleep(100_000_000)  # readers of blocks 16..19 still queued on the caller's stream
        load = engine.load([0, 1, 2, 3], [16, 17, 18, 19])
        with torch.cuda.stream(side):
            store = engine.store([8, 9, 10, 11], [4, 5, 6, 7])
        assert engine.flush() == kv_ops.Completed([store], [load])
        assert torch.equal(packed(engine, [16, 17, 18, 19]), want)
    back = engine.load([4, 5, 6, 7], [20, 21, 22, 23])
    assert engine.flush().loads == [back]
    assert torch.equal(packed(engine, [20, 21, 22, 23]), other)
    engine.close()
