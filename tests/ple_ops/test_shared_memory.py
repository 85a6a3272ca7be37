"""SharedHostBuffer: a buffer that fails to come into being leaves no file in /dev/shm, a size the
file system cannot hold is a ValueError up front, and the creator's file goes with the creator."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import ple_ops
from ple_ops.runtime import shared_memory

ROOT = Path(__file__).resolve().parents[2]
SHM = "/dev/shm"
needs_shm = pytest.mark.skipif(not os.path.isdir(SHM), reason="no /dev/shm here")


@needs_shm
@pytest.mark.skipif(torch.cuda.is_available(), reason="registration works where CUDA is")
def test_a_buffer_whose_registration_fails_leaves_no_file():
    # Page-locking needs CUDA: here it fails after the file was created, as a failed start of an
    # OffloadRuntime on a GPU device can, and the file must go with the failure.
    before = set(os.listdir(SHM))
    with pytest.raises((ValueError, RuntimeError)):
        ple_ops.SharedHostBuffer(4096, register=True)
    assert set(os.listdir(SHM)) == before


@needs_shm
def test_a_size_the_file_system_cannot_hold_is_a_value_error_naming_it_and_leaves_no_file():
    # Past the whole file system, not just its free space: tmpfs refuses that at once, without
    # filling itself first. Only truncated to size, the file would be made, and the first touch
    # of a page past the free space would kill the process with SIGBUS.
    stat = os.statvfs(SHM)
    if stat.f_blocks == 0:
        pytest.skip("/dev/shm has no size limit here")
    gen = torch.Generator().manual_seed(7)
    nbytes = stat.f_blocks * stat.f_frsize + int(torch.randint(1, 1 << 20, (1,), generator=gen))
    before = set(os.listdir(SHM))
    with pytest.raises(ValueError, match=rf"SharedHostBuffer: nbytes {nbytes} does not fit in {SHM} \(\d+ bytes free"):
        ple_ops.SharedHostBuffer(nbytes, register=False)
    assert set(os.listdir(SHM)) == before


@needs_shm
def test_the_bytes_of_a_new_buffer_are_reserved_not_just_sized():
    gen = torch.Generator().manual_seed(8)
    nbytes = int(torch.randint(1, 64, (1,), generator=gen)) * 4096
    buf = ple_ops.SharedHostBuffer(nbytes, register=False)
    try:
        # A sparse (only truncated) file has no blocks; a reserved one has them all.
        assert os.stat(buf.handle.path).st_blocks * 512 >= nbytes
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        buf.bytes.copy_(data)
        assert torch.equal(ple_ops.SharedHostBuffer.attach(buf.handle).bytes, data)
    finally:
        buf.unlink()


@pytest.mark.parametrize("nbytes", [True, 2.5, "8", None, 0, -4096], ids=["bool", "float", "str", "none", "0", "neg"])
def test_a_bad_size_is_a_value_error_naming_it_before_any_file_is_made(nbytes):
    before = set(os.listdir(shared_memory._shm_dir()))
    with pytest.raises(ValueError, match=rf"SharedHostBuffer: nbytes must be a positive integer, got {nbytes!r}"):
        ple_ops.SharedHostBuffer(nbytes, register=False)
    assert set(os.listdir(shared_memory._shm_dir())) == before


def _run(code: str) -> list[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.split()


def test_a_creator_that_exits_without_unlink_leaves_no_file():
    path, other = _run(
        """
        import ple_ops
        kept = ple_ops.SharedHostBuffer(4096, register=False)
        dropped = ple_ops.SharedHostBuffer(4096, register=False)
        print(kept.handle.path, dropped.handle.path)
        """
    )
    assert not os.path.exists(path) and not os.path.exists(other)


@needs_shm
def test_an_untagged_buffer_of_a_killed_creator_is_removed_and_a_tagged_one_is_left_to_its_runtime():
    # SIGKILL runs no finalizer: multiprocessing's resource tracker, a process of its own, removes
    # the untagged file once the creator is gone. A tagged file is an offload runtime's, which
    # removes it itself (remove_files_of); the tracker must leave it alone.
    code = textwrap.dedent(
        """
        import os, signal, ple_ops
        untagged = ple_ops.SharedHostBuffer(4096, register=False)
        tagged = ple_ops.SharedHostBuffer(4096, register=False, tag="t0")
        print(untagged.handle.path, tagged.handle.path, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    untagged, tagged = result.stdout.split()
    try:
        deadline = time.monotonic() + 60
        while os.path.exists(untagged) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = os.path.exists(untagged)
        assert os.path.exists(tagged)
    finally:  # nothing left behind, whatever failed
        shared_memory.remove_files_of(int(os.path.basename(tagged).split(".")[1]), "t0")
        if os.path.exists(untagged):
            os.unlink(untagged)
    assert not left, "the killed creator's untagged file was still there"
    assert not os.path.exists(tagged)


def test_a_collected_buffer_takes_its_name_and_an_attached_one_or_a_forked_child_does_not():
    # The name lives while the creator's object does: a process attaches by it meanwhile, and a
    # forked child that exits normally (running the finalizers it inherited) leaves it alone.
    out = _run(
        """
        import gc, os, sys, torch
        import ple_ops
        buf = ple_ops.SharedHostBuffer(4096, register=False)
        data = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
        buf.bytes.copy_(data)
        other = ple_ops.SharedHostBuffer.attach(buf.handle)
        del other
        gc.collect()
        pid = os.fork()
        if pid == 0:
            sys.exit(0)
        os.waitpid(pid, 0)
        again = ple_ops.SharedHostBuffer.attach(buf.handle)
        print(os.path.exists(buf.handle.path), torch.equal(again.bytes, data))
        path = buf.handle.path
        del buf
        gc.collect()
        print(os.path.exists(path))
        """
    )
    assert out == ["True", "True", "False"]


def test_a_dead_runtimes_files_are_found_by_its_tag_and_no_others():
    # Another runtime of the same pid (another PID namespace sharing /dev/shm) tags its own files.
    ours = [ple_ops.SharedHostBuffer(4096, register=False, tag="a1b2") for _ in range(2)]
    theirs = ple_ops.SharedHostBuffer(4096, register=False, tag="c3d4")
    untagged = ple_ops.SharedHostBuffer(4096, register=False)
    try:
        removed = shared_memory.remove_files_of(os.getpid(), "a1b2")
        assert sorted(removed) == sorted(b.handle.path for b in ours)
        assert not any(os.path.exists(b.handle.path) for b in ours)
        assert os.path.exists(theirs.handle.path) and os.path.exists(untagged.handle.path)
    finally:
        for b in (*ours, theirs, untagged):
            b.unlink()


@pytest.mark.parametrize("tag", ["", "a/b", "a\0b", 5])
def test_a_tag_that_cannot_stand_in_a_file_name_is_refused(tag):
    with pytest.raises(ValueError, match="SharedHostBuffer: tag"):
        ple_ops.SharedHostBuffer(4096, register=False, tag=tag)


@pytest.mark.parametrize("nbytes", [2**70, sys.maxsize + 1], ids=["2**70", "maxsize+1"])
def test_a_size_past_any_file_is_a_value_error_and_leaves_no_file(nbytes):
    before = set(os.listdir(shared_memory._shm_dir()))
    with pytest.raises(ValueError, match=rf"SharedHostBuffer: nbytes {nbytes} is past the largest file size"):
        ple_ops.SharedHostBuffer(nbytes, register=False)
    assert set(os.listdir(shared_memory._shm_dir())) == before


@pytest.mark.parametrize(
    "offset, shape, dtype, message",
    [
        (0, (2,), "float32", r"dtype must be a torch.dtype \(e.g. torch.uint8\), got 'float32'"),
        (None, (2,), torch.int32, r"offset must be an integer >= 0, got None"),
        (True, (2,), torch.uint8, r"offset must be an integer >= 0, got True"),
        (4.0, (2,), torch.int32, r"offset must be an integer >= 0, got 4.0"),
        (-4, (2,), torch.int32, r"offset must be an integer >= 0, got -4"),
        (0, "ab", torch.uint8, r"shape must be an integer or a sequence of integers, got 'ab'"),
        (0, (-1,), torch.uint8, r"negative dimension in shape \(-1,\)"),
    ],
    ids=["dtype-str", "offset-none", "offset-bool", "offset-float", "offset-neg", "shape-str", "shape-neg"],
)
def test_a_view_argument_that_is_not_one_is_a_value_error_naming_it(offset, shape, dtype, message):
    buf = ple_ops.SharedHostBuffer(64, register=False)
    try:
        with pytest.raises(ValueError, match=rf"^SharedHostBuffer\.view: {message}"):
            buf.view(offset, shape, dtype)
        # A good view still reads the bytes where they are.
        data = torch.randint(0, 256, (64,), dtype=torch.uint8, generator=torch.Generator().manual_seed(len(message)))
        buf.bytes.copy_(data)
        assert torch.equal(buf.view(8, [2, 3], torch.int32).view(torch.uint8).flatten(), data[8:32])
    finally:
        buf.unlink()


def test_attach_maps_only_files_this_package_makes(tmp_path):
    # attach maps read-write: any other file would be open to the offload process's stores.
    gen = torch.Generator().manual_seed(10)
    buf = ple_ops.SharedHostBuffer(4096, register=False)
    handle = buf.handle
    elsewhere = tmp_path / os.path.basename(handle.path)  # our name, another directory
    elsewhere.write_bytes(bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=gen).tolist()))
    foreign = os.path.join(shared_memory._shm_dir(), f"other-{os.getpid()}-{int(torch.randint(1 << 30, (1,)))}")
    with open(foreign, "wb") as f:
        f.write(bytes(4096))
    passwd = Path("/etc/passwd").read_bytes() if os.path.exists("/etc/passwd") else None
    try:
        for path in ("/etc/passwd", str(elsewhere), foreign, handle.path + "/..", ""):
            with pytest.raises(ValueError, match=r"^SharedHostBuffer\.attach: handle\.path must be"):
                ple_ops.SharedHostBuffer.attach(shared_memory.SharedHandle(path, 10))
        with pytest.raises(
            ValueError,
            match=r"^SharedHostBuffer\.attach: handle must be a SharedHandle \(SharedHostBuffer.handle\), got \(",
        ):
            ple_ops.SharedHostBuffer.attach((handle.path, 4096))
        for nbytes in (0, True, "4096"):
            with pytest.raises(ValueError, match=rf"handle\.nbytes must be a positive integer, got {nbytes!r}"):
                ple_ops.SharedHostBuffer.attach(shared_memory.SharedHandle(handle.path, nbytes))
        with pytest.raises(ValueError, match=r"holds 4096 bytes, not a buffer of handle\.nbytes 8192"):
            ple_ops.SharedHostBuffer.attach(shared_memory.SharedHandle(handle.path, 8192))
        assert ple_ops.SharedHostBuffer.attach(handle).handle == handle  # ours still attaches
        assert passwd is None or Path("/etc/passwd").read_bytes() == passwd
    finally:
        os.unlink(foreign)
        buf.unlink()
