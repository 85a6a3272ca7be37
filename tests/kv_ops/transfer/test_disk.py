"""The disk tier's file: real files, round trips byte for byte, privacy, no name left behind, and
clear errors."""

import gc
import os
import stat
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import kv_ops
from kv_ops.transfer import block_file
from kv_ops.transfer.block_file import BlockFile, slot_runs


def staging(rows, stride, seed):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA: pinned_empty falls back to plain, page-aligned memory
        buf = kv_ops.pinned_empty((rows, stride))
    buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return buf


def test_runs_merge_consecutive_slots_only_when_rows_are_consecutive_too():
    assert slot_runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert slot_runs([]) == []


@pytest.mark.parametrize("page_cache", [False, True], ids=["o_direct", "page_cache"])
def test_round_trip_in_any_slot_order(tmp_path, page_cache):
    try:
        f = BlockFile(str(tmp_path), "rank0", slot_bytes=5000, num_slots=64, page_cache=page_cache)
    except OSError as e:  # a file system without O_DIRECT must say how to proceed
        assert not page_cache and "does not support O_DIRECT; pass page_cache=True" in str(e)
        f = BlockFile(str(tmp_path), "rank0", slot_bytes=5000, num_slots=64, page_cache=True)
    with f:
        assert f.slot_stride == 8192 and os.fstat(f.fd).st_size == 64 * 8192
        assert f.direct == bool(_fd_flags(f.fd) & os.O_DIRECT)  # O_DIRECT is on exactly when asked for
        src = staging(12, f.slot_stride, 1)
        slots = [7, 8, 9, 40, 2, 3, 63, 0, 11, 12, 13, 14]
        f.write(slots, src)
        back = staging(12, f.slot_stride, 2)  # random bytes: a slot not read back shows
        f.read(list(reversed(slots)), back)
        assert torch.equal(back, src.flip(0))
    assert f.fd is None and os.listdir(tmp_path) == []


def _fd_flags(fd):
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)


def _assert_private_and_unnamed(f, directory):
    st = os.fstat(f.fd)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_nlink == 0  # no name anywhere: no other process can open it by path
    assert os.listdir(directory) == []
    assert os.readlink(f"/proc/self/fd/{f.fd}").endswith("(deleted)")


def test_the_file_has_no_name_from_the_moment_it_is_open(tmp_path):
    with BlockFile(str(tmp_path), "cuda0", 4096, 4, page_cache=True) as f:
        _assert_private_and_unnamed(f, tmp_path)
        # Nothing to collide with: a second engine of the same tag in the same directory (a
        # restart whose predecessor has not exited yet) gets a file of its own.
        with BlockFile(str(tmp_path), "cuda0", 4096, 4, page_cache=True) as g:
            _assert_private_and_unnamed(g, tmp_path)
            src = staging(1, 4096, 3)
            f.write([0], src)
            back = staging(1, 4096, 4)
            g.read([0], back)
            assert torch.equal(back, torch.zeros_like(back))  # g's slot 0 is its own, still zero
            f.read([0], back)
            assert torch.equal(back, src)
    assert os.listdir(tmp_path) == []


def test_without_o_tmpfile_the_file_is_created_exclusively_and_unlinked_at_once(tmp_path, monkeypatch):
    # A file system without O_TMPFILE (what open_tmpfile answers there), on a real file system.
    monkeypatch.setattr(block_file, "open_tmpfile", lambda directory: None)
    # The first candidate name is taken by a symbolic link (planted, or a stale leftover): it is
    # neither followed, nor reused, nor removed; the next name is used and removed at once.
    names = iter(["kv_offload.rank0.planted.tmp", "kv_offload.rank0.fresh.tmp"])
    monkeypatch.setattr(block_file, "candidate_names", lambda tag: names)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep")
    os.symlink(target, tmp_path / "kv_offload.rank0.planted.tmp")
    with BlockFile(str(tmp_path), "rank0", 4096, 4, page_cache=True) as f:
        st = os.fstat(f.fd)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_nlink == 0
        assert sorted(os.listdir(tmp_path)) == ["elsewhere", "kv_offload.rank0.planted.tmp"]
        src = staging(2, 4096, 5)
        f.write([3, 1], src)
        back = staging(2, 4096, 6)
        f.read([3, 1], back)
        assert torch.equal(back, src)
    assert target.read_bytes() == b"keep" and os.readlink(tmp_path / "kv_offload.rank0.planted.tmp") == str(target)


def test_entering_a_closed_file_is_refused_as_its_reads_are(tmp_path):
    f = BlockFile(str(tmp_path), "rank0", 4096, 4, page_cache=True)
    f.close()
    with pytest.raises(ValueError, match=r"^BlockFile: .* is closed"):
        with f:
            pytest.fail("entered a closed BlockFile")


def test_a_dropped_file_closes_its_descriptor(tmp_path):
    f = BlockFile(str(tmp_path), "rank0", 4096, 4, page_cache=True)
    fd, ino = f.fd, os.fstat(f.fd).st_ino
    del f
    gc.collect()
    try:
        still = os.fstat(fd).st_ino == ino
    except OSError:
        still = False
    assert not still  # the descriptor, the only owner of the bytes, went with the object


def test_unwritable_path_is_a_clear_error(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"x")
    with pytest.raises(OSError, match=r"cannot create the disk tier file kv_offload.rank0 in .*/file: Not a directory"):
        BlockFile(str(not_a_dir), "rank0", 4096, 4, page_cache=True)
    with pytest.raises(OSError, match=r"cannot create the disk tier file kv_offload.rank0 in .*/missing: No such file"):
        BlockFile(str(tmp_path / "missing"), "rank0", 4096, 4, page_cache=True)


@pytest.mark.parametrize("tag", [5, "", "a\0b", "sub/dir", "../up"], ids=["int", "empty", "nul", "slash", "escape"])
def test_a_tag_that_cannot_stand_in_a_file_name_is_refused_before_any_file_is_made(tag, tmp_path, monkeypatch):
    monkeypatch.setattr(block_file, "open_tmpfile", lambda directory: None)  # the tag would go into the name
    with pytest.raises(ValueError, match=r"^BlockFile: tag (must be a non-empty string|goes into a file name)"):
        BlockFile(str(tmp_path), tag, 4096, 4, page_cache=True)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((None, "x", 4096, 4), {}, r"directory must be a path \(a non-empty str or os.PathLike\), got None"),
        ((b"/tmp", "x", 4096, 4), {}, r"directory must be a path \(a non-empty str or os.PathLike\), got b'/tmp'"),
        (("{tmp}", "x", 4096, 4), {"page_cache": "no"}, "page_cache must be True or False, got 'no'"),
        (("{tmp}", "x", 4096, 4), {"page_cache": 1}, "page_cache must be True or False, got 1"),
        (("{tmp}", "x", 4096, 4), {"page_cache": None}, "page_cache must be True or False, got None"),
    ],
    ids=["none-directory", "bytes-directory", "string-page-cache", "int-page-cache", "none-page-cache"],
)
def test_block_file_checks_its_arguments_by_the_engines_rules_before_any_file_is_made(
    args, kwargs, message, tmp_path, monkeypatch
):
    made = []
    monkeypatch.setattr(block_file, "open_tmpfile", lambda directory: made.append(directory))
    args = tuple(str(tmp_path) if a == "{tmp}" else a for a in args)
    with pytest.raises(ValueError, match=f"^BlockFile: {message}"):
        BlockFile(*args, **kwargs)
    assert made == [] and os.listdir(tmp_path) == []


def test_a_path_like_directory_is_taken(tmp_path):
    with BlockFile(tmp_path, "rank0", 4096, 2, page_cache=True) as f:
        src = staging(2, 4096, 7)
        f.write([1, 0], src)
        back = staging(2, 4096, 8)
        f.read([1, 0], back)
        assert torch.equal(back, src) and f.directory == str(tmp_path)


def test_slots_and_buffers_of_the_wrong_type_are_refused_naming_them_before_any_io(tmp_path):
    with BlockFile(str(tmp_path), "rank0", 4096, 4, page_cache=True) as f:
        src = staging(2, 4096, 9)
        f.write([0, 1], src)
        for slots in (None, "ab", 3, {0: 1}):
            with pytest.raises(ValueError, match=r"^BlockFile: slots must be a list, tensor or array of slot indices"):
                f.write(slots, staging(2, 4096, 10))
        with pytest.raises(ValueError, match=r"^BlockFile: src must be a CPU uint8 \[n, 4096\] tensor, got NoneType"):
            f.write([0], None)
        with pytest.raises(ValueError, match=r"^BlockFile: dst must be a CPU uint8 \[n, 4096\] tensor, got list"):
            f.read([0], [[0] * 4096])
        back = staging(2, 4096, 11)
        f.read([0, 1], back)
        assert torch.equal(back, src)  # nothing refused reached the file
        for slots in (torch.tensor([1, 0]), range(1, -1, -1), np.array([1, 0], dtype=np.int32)):  # still taken
            back = staging(2, 4096, 12)
            f.read(slots, back)
            assert torch.equal(back, src.flip(0))


def test_bad_slots_and_buffers_are_rejected_before_any_io(tmp_path):
    with BlockFile(str(tmp_path), "rank0", 4096, 8, page_cache=True) as f:
        with pytest.raises(ValueError, match=r"slots\[1\] = 8 is outside \[0, 8\)"):
            f.write([0, 8], staging(2, 4096, 0))
        with pytest.raises(ValueError, match=r"uint8 \[n, 4096\]"):
            f.write([0], torch.zeros(1, 4000, dtype=torch.uint8))
        with pytest.raises(ValueError, match="at least 3 rows"):
            f.read([0, 1, 2], staging(2, 4096, 0))
    with pytest.raises(ValueError, match=r"kv_offload.rank0 \(unlinked\) is closed"):
        f.write([0], staging(1, 4096, 0))


_FULL_DISK = """
import resource, signal, sys, warnings
sys.path[:0] = [{root!r}]
import torch, kv_ops
from kv_ops.transfer.block_file import BlockFile
warnings.simplefilter("ignore")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
f = BlockFile({directory!r}, "rank0", 4096, 64, page_cache=True)  # allocated before the limit
f.close()
resource.setrlimit(resource.RLIMIT_FSIZE, (8 * 4096, 8 * 4096))  # the disk "fills" at 32 KiB
try:
    BlockFile({directory!r}, "rank1", 4096, 64, page_cache=True)
except OSError as e:
    print("CREATE:", e)
"""


def test_a_disk_that_cannot_hold_the_tier_fails_at_creation_with_the_os_error(tmp_path):
    # A full disk and a file-size limit both make the allocation fail (ENOSPC / EFBIG); the
    # limit is what a test can impose without filling a real disk.
    root = os.path.dirname(os.path.dirname(kv_ops.__file__))
    code = _FULL_DISK.format(root=root, directory=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "CREATE:" in out.stdout and "cannot allocate 262144 bytes of disk tier in" in out.stdout, out.stdout
    assert "File too large" in out.stdout or "No space left" in out.stdout, out.stdout  # the OS error itself
    assert os.listdir(tmp_path) == []  # a failed creation leaves nothing
