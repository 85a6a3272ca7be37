"""SharedHostBuffer: a buffer that fails to come into being leaves no file in /dev/shm, a size the
file system cannot hold is a ValueError up front, and the creator's file goes with the creator."""

import os
import subprocess
import sys
import textwrap
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
