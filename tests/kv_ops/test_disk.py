"""The disk tier's file: real files, round trips byte for byte, privacy, and clear errors."""

import os
import stat
import subprocess
import sys
import warnings

import pytest
import torch

import kv_ops
from kv_ops.disk import BlockFile, _runs


def staging(rows, stride, seed):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA: pinned_empty falls back to plain, page-aligned memory
        buf = kv_ops.pinned_empty((rows, stride))
    buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return buf


def test_runs_merge_consecutive_slots_only_when_rows_are_consecutive_too():
    assert _runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert _runs([]) == []


@pytest.mark.parametrize("page_cache", [False, True], ids=["o_direct", "page_cache"])
def test_round_trip_in_any_slot_order(tmp_path, page_cache):
    try:
        f = BlockFile(str(tmp_path), "rank0", slot_bytes=5000, num_slots=64, page_cache=page_cache)
    except OSError as e:  # a file system without O_DIRECT must say how to proceed
        assert not page_cache and "does not support O_DIRECT; pass page_cache=True" in str(e)
        f = BlockFile(str(tmp_path), "rank0", slot_bytes=5000, num_slots=64, page_cache=True)
    with f:
        assert f.slot_stride == 8192 and os.path.getsize(f.path) == 64 * 8192
        src = staging(12, f.slot_stride, 1)
        slots = [7, 8, 9, 40, 2, 3, 63, 0, 11, 12, 13, 14]
        f.write(slots, src)
        back = staging(12, f.slot_stride, 2)  # random bytes: a slot not read back shows
        f.read(list(reversed(slots)), back)
        assert torch.equal(back, src.flip(0))
    assert not os.path.exists(f.path)


def test_file_is_private_and_never_reused_or_followed(tmp_path):
    with BlockFile(str(tmp_path), "cuda0", 4096, 4, page_cache=True) as f:
        assert stat.S_IMODE(os.stat(f.path).st_mode) == 0o600
        with pytest.raises(FileExistsError, match="already exists"):
            BlockFile(str(tmp_path), "cuda0", 4096, 4, page_cache=True)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep")
    os.symlink(target, tmp_path / "kv_offload.cuda1.bin")
    with pytest.raises(FileExistsError, match="kv_offload.cuda1.bin"):
        BlockFile(str(tmp_path), "cuda1", 4096, 4, page_cache=True)
    assert target.read_bytes() == b"keep"


def test_unwritable_path_is_a_clear_error(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"x")
    with pytest.raises(OSError, match=r"cannot create the disk tier file .*file/kv_offload.rank0.bin"):
        BlockFile(str(not_a_dir), "rank0", 4096, 4, page_cache=True)


def test_bad_slots_and_buffers_are_rejected_before_any_io(tmp_path):
    with BlockFile(str(tmp_path), "rank0", 4096, 8, page_cache=True) as f:
        with pytest.raises(ValueError, match=r"slots\[1\] = 8 is outside \[0, 8\)"):
            f.write([0, 8], staging(2, 4096, 0))
        with pytest.raises(ValueError, match=r"uint8 \[n, 4096\]"):
            f.write([0], torch.zeros(1, 4000, dtype=torch.uint8))
        with pytest.raises(ValueError, match="at least 3 rows"):
            f.read([0, 1, 2], staging(2, 4096, 0))


_FULL_DISK = """
import resource, signal, sys, warnings
sys.path[:0] = [{root!r}]
import torch, kv_ops
from kv_ops.disk import BlockFile
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
    assert not os.path.exists(tmp_path / "kv_offload.rank1.bin")  # a failed creation leaves nothing
