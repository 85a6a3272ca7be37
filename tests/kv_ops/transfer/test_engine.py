"""OffloadEngine: exact sizing, round trips byte for byte, completion never early, ordering.

The CPU tests run the engine's CPU path everywhere; the tests marked gpu force the two races
with torch.cuda._sleep on the caller's stream, on each of the three paths (kernel, staged, dma),
and must come out right every time. The staged path gets a ring of 3 rows per slot, so that a
transfer of 4 or more blocks crosses chunk boundaries and its slots are reused across calls.
"""

import errno
import os
import re
import stat
import threading
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kv_ops
from kv_ops.transfer import block_file
from kv_ops.transfer import crossover as crossover_mod
from kv_ops.transfer.crossover import Cell, Crossover
from kv_ops.transfer.disk import DiskPath
from kv_ops.transfer.paths import (
    PATH_NAMES,
    RING_SLOTS,
    Blocks,
    DirectDmaPath,
    Direction,
    KernelPath,
    StagedPath,
    TransferPath,
)

gpu = pytest.mark.gpu
PATHS = pytest.mark.parametrize("path", ["kernel", "staged", "dma"])
PER_BLOCK = 2 * 256 + 192
COPY_ENGINES = {p.name: p.copy_engines for p in (KernelPath, StagedPath, DirectDmaPath)}


def make_engine(device="cpu", capacity_blocks=40, seed=0, path="kernel"):
    """K/V-first attention (2 regions of 256 B) and MLA (192 B); the staged path's ring holds 3
    rows per slot (an auto engine keeps the default ring it measured with)."""
    gen = torch.Generator().manual_seed(seed)
    kv = {
        "attn0": torch.randint(-99, 99, (2, 32, 4, 2, 16), generator=gen).to(device, torch.bfloat16),  # 2 x 256 B
        "mla1": torch.randint(-99, 99, (32, 4, 24), generator=gen).to(device, torch.float16),  # 192 B
    }
    ring = {} if path == "auto" else {"ring_bytes": RING_SLOTS * 3 * PER_BLOCK}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = kv_ops.OffloadEngine(
            kv, 32, capacity_bytes=capacity_blocks * PER_BLOCK + PER_BLOCK - 1, path=path, **ring
        )
    return engine, kv


def test_mirror_is_sized_exactly_from_the_capacity():
    engine, _ = make_engine(capacity_blocks=40)
    assert engine.block_bytes == PER_BLOCK
    assert engine.num_host_blocks == 40  # floor(capacity / block_bytes), no power-of-two rounding
    assert engine.mirror.dtype == torch.uint8 and tuple(engine.mirror.shape) == (40, PER_BLOCK)
    assert engine.mirror.is_contiguous()
    # Each region's columns of the one mirror, side by side in region order: views, not copies.
    base = engine.mirror.data_ptr()
    assert {n: (tuple(m.shape), m.stride(), m.data_ptr() - base) for n, m in engine.mirror_regions.items()} == {
        "attn0.0": ((40, 256), (PER_BLOCK, 1), 0),
        "attn0.1": ((40, 256), (PER_BLOCK, 1), 256),
        "mla1": ((40, 192), (PER_BLOCK, 1), 512),
    }
    with pytest.raises(ValueError, match="holds no block of 704 bytes"):
        kv_ops.OffloadEngine({"l": torch.zeros(32, 352, dtype=torch.float16)}, 32, capacity_bytes=703)


BAD_SIZES = [
    *[("staging_blocks", v) for v in (0, -1, 2.5, True, "4", None)],
    *[("staging_slots", v) for v in (0, -2, 1.5, False, "2")],
    *[("capacity_bytes", v) for v in (0, 2.5, float(1 << 20), "65536", True, None)],
    *[("ring_bytes", v) for v in (0, 1.0, True)],
]


@pytest.mark.parametrize("tier", ["mirror", "disk"])
@pytest.mark.parametrize("what, value", BAD_SIZES, ids=[f"{w}={v!r}" for w, v in BAD_SIZES])
def test_a_bad_size_is_refused_at_construction_naming_it(tmp_path, tier, what, value):
    # staging_blocks=0 used to be accepted, and then every disk transfer failed later with
    # "range() arg 3 must not be zero"; a str or None capacity gave a raw TypeError.
    kv = {"l": torch.randn(32, 352, generator=torch.Generator().manual_seed(5)).to(torch.float16)}
    sizes = {"capacity_bytes": 1 << 20, what: value}
    disk = {"disk_dir": str(tmp_path), "page_cache": True} if tier == "disk" else {}
    threads = set(threading.enumerate())
    with pytest.raises(ValueError, match=re.escape(f"OffloadEngine: {what} must be a positive integer, got {value!r}")):
        kv_ops.OffloadEngine(kv, 32, **sizes, **disk)
    assert set(threading.enumerate()) == threads and os.listdir(tmp_path) == []  # nothing was started


@pytest.mark.parametrize("value", [0, -3, 2.5, "32", None, True])
def test_a_bad_num_blocks_is_refused_naming_it(value):
    kv = {"l": torch.randn(32, 352, generator=torch.Generator().manual_seed(6)).to(torch.float16)}
    with pytest.raises(ValueError, match=re.escape(f"num_blocks must be a positive integer, got {value!r}")):
        kv_ops.OffloadEngine(kv, value, capacity_bytes=1 << 20)


def test_numpy_integer_sizes_are_sizes(tmp_path):
    kv = {"l": torch.randn(32, 352, generator=torch.Generator().manual_seed(7)).to(torch.float16)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = kv_ops.OffloadEngine(kv, 32, capacity_bytes=np.int64(40 * PER_BLOCK))
    assert engine.num_host_blocks == 40 and type(engine.num_host_blocks) is int
    engine.close()
    with kv_ops.OffloadEngine(
        kv, 32, capacity_bytes=8 * 4096, disk_dir=str(tmp_path), page_cache=True, staging_blocks=np.int32(3)
    ) as engine:
        want = torch.cat([r[[4, 5, 6, 7]] for r in engine.regions.values()], dim=1)
        tid = engine.store([4, 5, 6, 7], [0, 1, 2, 3])  # two chunks of the 3-block staging buffer
        assert engine.flush().stores == [tid]
        load = engine.load([0, 1, 2, 3], [20, 21, 22, 23])
        assert engine.flush().loads == [load]
        assert torch.equal(torch.cat([r[[20, 21, 22, 23]] for r in engine.regions.values()], dim=1), want)


def test_a_stored_block_is_one_mirror_row_of_every_region_side_by_side():
    engine, _ = make_engine()
    gen = torch.Generator().manual_seed(8)
    engine.mirror.copy_(torch.randint(0, 256, engine.mirror.shape, dtype=torch.uint8, generator=gen))
    poison = engine.mirror.clone()
    engine.store([7, 3], [0, 39])
    engine.flush()
    for h, g in [(0, 7), (39, 3)]:
        assert torch.equal(engine.mirror[h], torch.cat([r[g] for r in engine.regions.values()]))
    assert torch.equal(engine.mirror[1:39], poison[1:39])  # no other row touched


def round_trip(engine, device):
    gen = torch.Generator().manual_seed(5)
    gpu_ids = torch.randperm(32, generator=gen)[:12]
    host_ids = torch.randperm(engine.num_host_blocks, generator=gen)[:12]
    before = {n: r[gpu_ids.to(device)].clone() for n, r in engine.regions.items()}
    t_store = engine.store(gpu_ids, host_ids)
    # As a scheduler does: the GPU blocks are reused, and the host blocks read back, only once the
    # store is reported done (a store reads its blocks some time after the call returns; the two
    # directions are not ordered with each other).
    assert engine.flush().stores == [t_store]
    for r in engine.regions.values():  # the GPU blocks get reused for something else
        r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8, generator=gen).to(device))
    new_ids = torch.randperm(32, generator=gen)[:12]
    t_load = engine.load(host_ids, new_ids)
    assert engine.flush().loads == [t_load]
    for n, r in engine.regions.items():
        assert torch.equal(r[new_ids.to(device)], before[n])


@PATHS
def test_store_then_load_round_trips_on_cpu(path):
    engine, _ = make_engine(path=path)
    round_trip(engine, "cpu")
    assert engine.path_counts == {p: 2 * (p == path) for p in ("kernel", "staged", "dma")}


def test_an_auto_engine_on_the_cpu_measures_nothing_and_takes_the_kernel_paths_reference_copy():
    engine, _ = make_engine(path="auto")
    assert engine.crossover is None
    round_trip(engine, "cpu")
    assert engine.path_counts == {"kernel": 2, "staged": 0, "dma": 0}


def random_cache(gen, device, num_blocks):
    """1-3 layers of random layouts (K/V-first, blocks-first with K and V inside the block, MLA),
    dtypes and block shapes, filled with random values; each with the axis that holds blocks."""

    def pick(options):
        return options[int(torch.randint(0, len(options), (1,), generator=gen))]

    layers = {}
    for i in range(int(torch.randint(1, 4, (1,), generator=gen))):
        kind = pick(["kv_first", "blocks_first", "mla"])
        t, h, d = (
            int(torch.randint(1, 5, (1,), generator=gen)),
            int(torch.randint(1, 4, (1,), generator=gen)),
            pick([8, 16, 24]),
        )
        shape = {
            "kv_first": (2, num_blocks, t, h, d),
            "blocks_first": (num_blocks, 2, t, h, d),
            "mla": (num_blocks, t, d),
        }[kind]
        values = torch.randn(shape, generator=gen).to(pick([torch.float16, torch.bfloat16, torch.float32]))
        layers[f"l{i}"] = (values.to(device), 1 if kind == "kv_first" else 0)
    return layers


def random_layout_round_trip(seed, device, path="kernel"):
    """Store random blocks, scramble the GPU cache, load them into other blocks: every layer's
    blocks, read by plain indexing of the typed cache tensors, must come back bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 12
    layers = random_cache(gen, device, num_blocks)
    kv = {name: t for name, (t, _) in layers.items()}
    per_block = sum(t.numel() // num_blocks * t.element_size() for t in kv.values())
    host_blocks = int(torch.randint(6, 20, (1,), generator=gen))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = kv_ops.OffloadEngine(kv, num_blocks, capacity_bytes=host_blocks * per_block, path=path)
    assert engine.num_host_blocks == host_blocks and engine.block_bytes == per_block
    n = int(torch.randint(1, 7, (1,), generator=gen))
    gpu_ids = torch.randperm(num_blocks, generator=gen)[:n]
    host_ids = torch.randperm(host_blocks, generator=gen)[:n]
    before = {name: t.index_select(axis, gpu_ids.to(device)).clone() for name, (t, axis) in layers.items()}
    engine.store(gpu_ids, host_ids)
    engine.flush()
    for t, _ in layers.values():  # the GPU blocks are reused for something else
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    new_ids = torch.randperm(num_blocks, generator=gen)[:n]
    engine.load(host_ids, new_ids)
    engine.flush()
    for name, (t, axis) in layers.items():
        got = t.index_select(axis, new_ids.to(device))
        assert torch.equal(got.view(torch.uint8), before[name].view(torch.uint8)), f"layer {name}"


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_round_trips_over_random_layouts_on_cpu(seed):
    random_layout_round_trip(seed, "cpu")


@gpu
@PATHS
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_round_trips_over_random_layouts_on_gpu(path, seed):
    random_layout_round_trip(seed, "cuda", path)


def test_poll_reports_each_transfer_once_in_issue_order():
    engine, _ = make_engine()
    ids = [engine.store([i], [i]) for i in range(5)] + [engine.load([7], [3])]
    done = engine.poll()
    assert done.stores == ids[:5] and done.loads == ids[5:]
    assert engine.poll() == kv_ops.Completed()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda e: e.store([0, 32], [0, 1]), r"OffloadEngine.store: gpu_ids\[1\] = 32 is outside \[0, 32\)"),
        (lambda e: e.store([0, 1], [0, 40]), r"OffloadEngine.store: host_ids\[1\] = 40 is outside \[0, 40\)"),
        (lambda e: e.load([-1], [0]), r"OffloadEngine.load: host_ids\[0\] = -1 is outside \[0, 40\)"),
        (lambda e: e.store([0, 1], [5, 5]), r"OffloadEngine.store: host_ids names block 5 more than once"),
        (lambda e: e.load([0, 1], [3, 3]), r"OffloadEngine.load: gpu_ids names block 3 more than once"),
        (lambda e: e.load([0, 1], [3]), "OffloadEngine.load: 1 gpu_ids but 2 host_ids"),
        # 0.7 would have been truncated to block 0: floats are refused, whatever their values.
        (
            lambda e: e.store([0.7, 1], [0, 1]),
            r"OffloadEngine.store: gpu_ids must be integer block ids, got a list of float64",
        ),
        (
            lambda e: e.load(torch.tensor([2.0, 3.0], dtype=torch.float64), [0, 1]),
            r"host_ids must be .* got torch.float64",
        ),
        (lambda e: e.store([True, False], [0, 1]), r"gpu_ids must be integer block ids, got a list of bool"),
        (
            lambda e: e.store(torch.tensor([0, 1], device="meta"), [0, 1]),
            "OffloadEngine.store: gpu_ids is a meta tensor",
        ),
        (lambda e: e.load([0], torch.tensor([1], device="meta")), "OffloadEngine.load: gpu_ids is a meta tensor"),
        (lambda e: e.load([2**70], [0]), "OffloadEngine.load: host_ids must be integer block ids"),
        (lambda e: e.store(["a"], [0]), "OffloadEngine.store: gpu_ids must be integer block ids"),
        (
            lambda e: e.store(np.array([1, 2], dtype=np.uint8), [0, 1]),
            r"OffloadEngine.store: gpu_ids must be a 1-D int32 or int64 array, got a numpy uint8 array",
        ),
        (
            lambda e: e.load(np.array([1, 2], dtype=np.uint8), [0, 1]),
            r"OffloadEngine.load: host_ids must be a 1-D int32 or int64 array, got a numpy uint8 array",
        ),
        (
            lambda e: e.store(torch.tensor([[1, 2]]), [0, 1]),
            r"OffloadEngine.store: gpu_ids must be a 1-D int32 or int64 tensor, got torch.int64 \(1, 2\)",
        ),
        (
            lambda e: e.load(np.array([[0], [1]]), [0, 1]),
            r"OffloadEngine.load: host_ids must be a 1-D int32 or int64 array, got a numpy int64 array of shape \(2, 1\)",
        ),
        (
            lambda e: e.store([0, 1], [[0, 1]]),
            r"OffloadEngine.store: host_ids must be a flat sequence of ids, got list of shape \(1, 2\)",
        ),
    ],
    ids=[
        "gpu-id-range",
        "host-id-range",
        "negative",
        "store-repeats-host",
        "load-repeats-gpu",
        "lengths",
        "float-list",
        "float-tensor",
        "bool",
        "meta-store",
        "meta-load",
        "huge-int",
        "string",
        "uint8-gpu-ids",
        "uint8-host-ids",
        "2-d-tensor",
        "2-d-array",
        "nested-list",
    ],
)
def test_bad_ids_are_rejected_before_any_byte_moves(call, message):
    engine, kv = make_engine()
    gen = torch.Generator().manual_seed(3)
    engine.mirror.copy_(torch.randint(0, 256, engine.mirror.shape, dtype=torch.uint8, generator=gen))  # poison
    before = engine.mirror.clone()
    cache = {n: t.clone() for n, t in kv.items()}
    with pytest.raises(ValueError, match=message):
        call(engine)
    assert torch.equal(engine.mirror, before)
    assert all(torch.equal(t.view(torch.uint8), cache[n].view(torch.uint8)) for n, t in kv.items())
    assert engine.poll() == kv_ops.Completed()
    assert engine.store([0], [0]) == 0  # the refused call used up no transfer id


@pytest.mark.parametrize(
    "kv_caches, message",
    [
        (
            [torch.zeros(32, 352, dtype=torch.float16)],
            "kv_caches must be a mapping of layer name to torch.Tensor, got list",
        ),
        (
            np.zeros((32, 352), dtype=np.float16),
            "kv_caches must be a mapping of layer name to torch.Tensor, got ndarray",
        ),
        ({}, "kv_caches must hold at least one layer, got an empty dict"),
        ({"l": np.zeros((32, 352), dtype=np.float16)}, r"kv_caches\['l'\] must be a torch.Tensor, got ndarray"),
    ],
    ids=["list", "ndarray", "empty", "numpy-cache"],
)
def test_kv_caches_that_are_not_a_mapping_of_tensors_are_refused_naming_them(kv_caches, message):
    # A list or an array used to fail at kv_caches.values() with an AttributeError naming nothing.
    with pytest.raises(ValueError, match=f"^OffloadEngine: {message}"):
        kv_ops.OffloadEngine(kv_caches, 32, capacity_bytes=1 << 20)


def test_a_mirror_larger_than_the_machine_is_refused_naming_capacity_bytes_and_the_bytes(monkeypatch):
    from kv_ops.cuda import host_memory

    kv = {"l": torch.zeros(32, 352, dtype=torch.float16)}  # 704-byte blocks
    available = 10 * 704 * 1024
    monkeypatch.setattr(host_memory, "host_memory_bytes", lambda: (available, 2 * available))
    allocated = []
    monkeypatch.setattr(
        "kv_ops.transfer.routes.pinned_empty", lambda *a, **k: allocated.append(a) or torch.empty(*a, dtype=torch.uint8)
    )
    capacity = 64 << 30
    asked = (capacity // 704) * 704  # the mirror's bytes: whole blocks of the capacity
    with pytest.raises(
        ValueError, match=rf"^OffloadEngine: capacity_bytes asks for {asked} bytes .* {available} bytes"
    ):
        kv_ops.OffloadEngine(kv, 32, capacity_bytes=capacity)
    assert allocated == []  # refused before the mirror was allocated
    # Within what the machine has, the same call makes its mirror.
    with kv_ops.OffloadEngine(kv, 32, capacity_bytes=available // 2) as engine:
        assert allocated == [((engine.num_host_blocks, 704),)]


def test_disk_staging_larger_than_the_machine_is_refused_before_the_file_is_made(monkeypatch, tmp_path):
    from kv_ops.cuda import host_memory

    monkeypatch.setattr(host_memory, "host_memory_bytes", lambda: (1 << 20, 1 << 21))
    made = []
    monkeypatch.setattr("kv_ops.transfer.routes.DiskPath", lambda *a: made.append(a))
    kv = {"l": torch.zeros(32, 352, dtype=torch.float16)}  # 704-byte blocks, 4 KiB slots
    asked = 2 * 1024 * 4096
    with pytest.raises(ValueError, match=rf"^OffloadEngine: staging_slots x staging_blocks .* asks for {asked} bytes"):
        kv_ops.OffloadEngine(
            kv, 32, capacity_bytes=1 << 20, disk_dir=str(tmp_path), page_cache=True, staging_blocks=1024
        )
    assert made == []  # neither the file nor its staging buffers were made


@pytest.mark.parametrize(
    "where, message",
    [
        (lambda tmp: str(tmp / "missing"), r"disk_dir '.*/missing' does not exist; create the directory first"),
        (lambda tmp: str(tmp / "file"), r"disk_dir '.*/file' is not a directory"),
        (lambda tmp: "", r"disk_dir must be a path \(a non-empty str or os.PathLike\), got ''"),
    ],
    ids=["missing", "file", "empty"],
)
def test_a_disk_dir_that_is_no_directory_is_refused_naming_it(where, message, tmp_path, monkeypatch):
    (tmp_path / "file").write_bytes(os.urandom(16))
    made = []
    monkeypatch.setattr("kv_ops.transfer.routes.DiskPath", lambda *a: made.append(a))
    kv = {"l": torch.randn(32, 352).half()}
    with pytest.raises(ValueError, match=f"^OffloadEngine: {message}"):
        kv_ops.OffloadEngine(kv, 32, capacity_bytes=1 << 16, disk_dir=where(tmp_path), page_cache=True)
    assert made == [] and sorted(os.listdir(tmp_path)) == ["file"]  # nothing made, nothing left


@pytest.mark.parametrize(
    "tag, message",
    [
        (5, "disk_tag must be a non-empty string, got 5"),
        ("", "disk_tag must be a non-empty string, got ''"),
        ("a\0b", r"disk_tag goes into a file name and must not contain '\\x00'"),
        ("sub/dir", "disk_tag goes into a file name and must not contain '/', got 'sub/dir'"),
        ("../../escape", "disk_tag goes into a file name and must not contain '/', got '../../escape'"),
    ],
    ids=["int", "empty", "nul", "slash", "escape"],
)
def test_a_disk_tag_that_cannot_name_a_file_is_refused_before_any_file_is_made(tag, message, tmp_path, monkeypatch):
    # Without O_TMPFILE the tag goes into the file's short-lived name, so it must stay one name in disk_dir.
    monkeypatch.setattr(block_file, "open_tmpfile", lambda directory: None)
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(path) or real_open(path, *a, **k))
    kv = {"l": torch.randn(32, 352).half()}
    with pytest.raises(ValueError, match=f"^OffloadEngine: {message}"):
        kv_ops.OffloadEngine(kv, 32, capacity_bytes=1 << 16, disk_dir=str(tmp_path), disk_tag=tag, page_cache=True)
    assert [p for p in opened if "kv_offload" in str(p)] == [] and os.listdir(tmp_path) == []
    # A good tag goes into the name, and the file is gone as soon as it is open.
    with kv_ops.OffloadEngine(kv, 32, 1 << 16, disk_dir=str(tmp_path), disk_tag="rank3", page_cache=True):
        assert any("kv_offload.rank3." in str(p) for p in opened) and os.listdir(tmp_path) == []


def test_a_disk_tag_without_disk_dir_is_refused_as_it_names_no_file(monkeypatch):
    made = []
    monkeypatch.setattr(kv_ops.transfer.engine, "host_blocks", lambda *a: made.append(a))
    kv = {f"layer{i}": torch.randn(2, 16, 4, 2, 8).bfloat16() for i in range(2)}
    with pytest.raises(
        ValueError, match=r"^OffloadEngine: disk_tag 'x' names the disk tier's file, but no disk_dir was given"
    ):
        kv_ops.OffloadEngine(kv, 16, capacity_bytes=64 << 10, disk_tag="x")
    assert made == []  # refused before the mirror was sized, let alone allocated


def test_page_cache_without_disk_dir_is_refused_as_there_is_no_file_to_buffer(monkeypatch):
    made = []
    monkeypatch.setattr(kv_ops.transfer.engine, "host_blocks", lambda *a: made.append(a))
    kv = {f"layer{i}": torch.randn(2, 16, 4, 2, 8).bfloat16() for i in range(2)}
    with pytest.raises(ValueError, match=r"^OffloadEngine: page_cache=True asks for buffered I/O on the disk tier's"):
        kv_ops.OffloadEngine(kv, 16, capacity_bytes=64 << 10, page_cache=True)
    assert made == []  # refused before the mirror was sized
    monkeypatch.undo()
    with kv_ops.OffloadEngine(kv, 16, capacity_bytes=64 << 10, page_cache=False) as engine:  # the default, said
        engine.store([3], [0])
        engine.flush()
        engine.load([0], [10])
        engine.flush()
    assert all(torch.equal(t[:, 10], t[:, 3]) for t in kv.values())


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG, errno.EDQUOT], ids=["ENOSPC", "EFBIG", "EDQUOT"])
@pytest.mark.parametrize("tmpfile", [True, False], ids=["o_tmpfile", "create-then-unlink"])
def test_a_capacity_the_disk_cannot_hold_is_refused_naming_capacity_bytes_and_disk_dir(
    code, tmpfile, tmp_path, monkeypatch
):
    # What the file system answers for a file too large for it (a real 1 << 50 gives EFBIG or ENOSPC).
    def refuse(fd, offset, length):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "posix_fallocate", refuse)
    if not tmpfile:
        monkeypatch.setattr(block_file, "open_tmpfile", lambda directory: None)
    kv = {"l": torch.randn(32, 352).half()}
    capacity = 1 << 50
    with pytest.raises(
        ValueError,
        match=rf"^OffloadEngine: capacity_bytes {capacity} does not fit on the file system of disk_dir "
        rf"'{re.escape(str(tmp_path))}' \({re.escape(os.strerror(code))}\)",
    ):
        kv_ops.OffloadEngine(kv, 32, capacity_bytes=capacity, disk_dir=str(tmp_path), page_cache=True)
    assert os.listdir(tmp_path) == []  # the file, unnamed from the start, went with its descriptor


def test_empty_specs_are_refused_rather_than_inferring_the_layout():
    kv = {"l0": torch.randn(2, 8, 4, 2, 8)}
    with pytest.raises(ValueError, match=r"^OffloadEngine: specs is empty; pass one KVCacheTensorSpec per allocation"):
        kv_ops.OffloadEngine(kv, 8, capacity_bytes=1 << 16, specs=[])
    with kv_ops.OffloadEngine(kv, 8, capacity_bytes=1 << 16, specs=None) as engine:  # None infers it
        assert list(engine.regions) == ["l0.0", "l0.1"]


def test_ids_may_be_lists_int32_or_int64_tensors_or_numpy_arrays():
    engine, _ = make_engine()
    host = torch.arange(engine.num_host_blocks)
    for i, (gpu_ids, host_ids) in enumerate(
        [
            ([4, 5], [0, 1]),
            (torch.tensor([6, 7], dtype=torch.int32), torch.tensor([2, 3])),
            (np.array([8, 9], dtype=np.int64), np.array([4, 5], dtype=np.int32)),
            ([], []),  # an empty list has torch's float dtype but no value: accepted
        ]
    ):
        assert engine.store(gpu_ids, host_ids) == i
    assert engine.flush().stores == [0, 1, 2, 3]
    for n, r in engine.regions.items():
        assert torch.equal(engine.mirror_regions[n][host[:6]], r[4:10])


@gpu
@PATHS
def test_store_then_load_round_trips_on_gpu(path):
    engine, _ = make_engine("cuda", path=path)
    round_trip(engine, "cuda")
    assert engine.path_counts == {p: 2 * (p == path) for p in ("kernel", "staged", "dma")}


@gpu
@PATHS
def test_store_waits_for_the_compute_that_writes_the_blocks_and_poll_is_never_early(path):
    engine, kv = make_engine("cuda", path=path)
    # A first store compiles the path's kernels; inside the loop that would outlast the sleep.
    warm = engine.store([0, 1, 2, 3], [0, 1, 2, 3])
    assert engine.flush().stores == [warm]
    region = engine.regions["mla1"]
    for _ in range(5):
        fresh = torch.randint(0, 256, (4, 192), dtype=torch.uint8, device="cuda")
        torch.cuda._sleep(50_000_000)  # the "forward pass" is still running...
        region[:4].copy_(fresh)  # ...and writes the blocks only at its end
        tid = engine.store([0, 1, 2, 3], [10, 11, 12, 13])
        assert engine.poll().stores == []  # cannot be done: the copy waits behind the compute
        done = engine.flush()
        assert done.stores == [tid]
        assert torch.equal(engine.mirror_regions["mla1"][10:14], fresh.cpu())


@gpu
@PATHS
def test_load_waits_for_readers_of_the_destination_blocks(path):
    engine, _ = make_engine("cuda", path=path)
    region = engine.regions["mla1"]
    for _ in range(5):
        engine.mirror_regions["mla1"][20:24] = torch.randint(0, 256, (4, 192), dtype=torch.uint8)
        old = region[4:8].clone()
        torch.cuda._sleep(50_000_000)  # a reader of blocks 4..7 is still queued...
        seen = region[4:8].clone()  # ...and reads them only after the sleep
        engine.load([20, 21, 22, 23], [4, 5, 6, 7])
        engine.flush()
        torch.cuda.synchronize()
        assert torch.equal(seen, old)  # the reader saw the old blocks, not the loaded ones
        assert torch.equal(region[4:8].cpu(), engine.mirror_regions["mla1"][20:24])


@gpu
@PATHS
def test_flush_under_load_returns_everything_in_flight(path):
    engine, _ = make_engine("cuda", capacity_blocks=32, path=path)
    torch.cuda._sleep(20_000_000)
    tids = []
    for i in range(50):
        tids.append(engine.store([i % 32], [(i * 7) % 32]))
        tids.append(engine.load([(i * 3) % 32], [(i * 5) % 32]))
    done = engine.flush()
    assert done.stores + done.loads == sorted(tids[0::2]) + sorted(tids[1::2])
    assert engine.poll() == kv_ops.Completed()


@gpu
@pytest.mark.parametrize("in_flight", [False, True])
def test_a_transfer_during_capture_is_refused_before_anything_moves(monkeypatch, in_flight):
    # An auto engine, with cells standing in for the measurement (the refusal, not the rates, is
    # under test; measuring under a sanitizer takes minutes). With a transfer still in flight
    # its pick would query that transfer's event, which a capture forbids: refused first.
    monkeypatch.setattr(
        crossover_mod,
        "measured_once",
        lambda device, widths, ring: Crossover(
            crossover_mod.shape_key(device, list(widths), ring),
            [Cell(p, d, 4, 4, 10.0, 10.0, 5.0) for p in PATH_NAMES for d in ("store", "load")],
        ),
    )
    engine, _ = make_engine("cuda", path="auto")
    tids = []
    if in_flight:
        torch.cuda._sleep(100_000_000)  # the store below waits behind it, unreported
        tids.append(engine.store([2, 3], [2, 3]))
    before = engine.mirror[:2].clone()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with pytest.raises(RuntimeError, match="OffloadEngine.store: a transfer cannot be captured"):
        with torch.cuda.graph(graph, stream=stream):
            engine.store([0, 1], [0, 1])
    torch.cuda.synchronize()
    assert engine.flush() == kv_ops.Completed(stores=tids)
    assert torch.equal(engine.mirror[:2], before)


@gpu
def test_an_auto_engine_measures_the_crossover_and_follows_it_per_call():
    engine, _ = make_engine("cuda", path="auto")
    measured = engine.crossover
    assert measured.key["widths"] == [256, 256, 192]  # its own shape, region by region
    assert {(c.path, c.direction) for c in measured.cells} == {(p, d) for p in COPY_ENGINES for d in ("store", "load")}
    expected = dict.fromkeys(COPY_ENGINES, 0)
    gen = torch.Generator().manual_seed(11)
    calls = [
        (Direction.STORE, torch.randperm(32, generator=gen)[:16], torch.randperm(40, generator=gen)[:16]),  # random
        (Direction.STORE, torch.arange(0, 32), torch.arange(4, 36)),  # one run
        (Direction.STORE, torch.tensor([5, 9]), torch.tensor([30, 2])),  # small
        (Direction.LOAD, torch.randperm(32, generator=gen)[:16], torch.randperm(40, generator=gen)[:16]),
        (Direction.LOAD, torch.arange(0, 32), torch.arange(8, 40)),
        (Direction.LOAD, torch.tensor([31]), torch.tensor([0])),
    ]
    for direction, gpu_ids, host_ids in calls:
        blocks = Blocks.of(direction, gpu_ids, host_ids)
        # Each call follows a flush: nothing is in flight, so the engine picks by the single-call rule.
        pick = measured.choose(direction, blocks.count, blocks.num_runs, COPY_ENGINES, alone=True)
        assert pick in COPY_ENGINES
        expected[pick] += 1
        if direction is Direction.STORE:
            want = torch.cat([r[gpu_ids.cuda()].cpu() for r in engine.regions.values()], dim=1)
            engine.store(gpu_ids, host_ids)
            engine.flush()
            assert torch.equal(engine.mirror[host_ids], want), pick
        else:
            fresh = torch.randint(0, 256, (host_ids.numel(), PER_BLOCK), dtype=torch.uint8, generator=gen)
            engine.mirror[host_ids] = fresh
            engine.load(host_ids, gpu_ids)
            engine.flush()
            got = torch.cat([r[gpu_ids.cuda()].cpu() for r in engine.regions.values()], dim=1)
            assert torch.equal(got, engine.mirror[host_ids]), pick
        assert engine.path_counts == expected, (direction, blocks.count, blocks.num_runs)
    assert engine.crossover is measured  # measured once, at construction


def test_an_unknown_path_is_refused():
    with pytest.raises(ValueError, match="path must be one of 'auto', 'kernel', 'staged', 'dma', got 'fast'"):
        kv_ops.OffloadEngine({"l": torch.zeros(4, 32)}, 4, capacity_bytes=1024, path="fast")


@pytest.mark.parametrize("ring_bytes", [0, -4096, 1.5, True, "1M"], ids=["zero", "negative", "float", "bool", "string"])
def test_a_ring_size_that_is_not_a_positive_integer_is_refused(ring_bytes):
    with pytest.raises(ValueError, match=f"ring_bytes must be a positive integer, got {ring_bytes!r}"):
        kv_ops.OffloadEngine({"l": torch.zeros(4, 32)}, 4, capacity_bytes=1024, path="staged", ring_bytes=ring_bytes)


def test_all_ranks_reports_a_transfer_once_every_rank_has_finished_it():
    combined = kv_ops.AllRanks(3)
    C = kv_ops.Completed
    assert combined.add([C([0, 1], [5]), C([0], []), C([], [5])]) == C([], [])
    assert combined.add([C([], []), C([1], [5]), C([0], [])]) == C([0], [5])
    assert combined.add([C([], []), C([], []), C([1], [])]) == C([1], [])
    assert combined.add([C([2], [2]), C([2], [2]), C([2], [])]) == C([2], [])  # load 2: one rank short


@pytest.mark.parametrize(
    "reports, got",
    [
        (None, "NoneType"),
        ([None, None], r"list of 2 \(NoneType\)"),
        ("C", "Completed"),  # one report, not in a list
        (["C", "C", "C"], r"list of 3 \(Completed\)"),  # three reports for two ranks
        (["C"], r"list of 1 \(Completed\)"),
        ([], "an empty list"),
        (["C", {"stores": [1]}], r"list of 2 \(Completed, dict\)"),
    ],
    ids=["none", "nones", "one-completed", "one-too-many", "one-too-few", "empty", "a-dict"],
)
def test_all_ranks_refuses_what_is_not_one_report_per_rank_before_counting_any(reports, got):
    combined = kv_ops.AllRanks(2)
    C = kv_ops.Completed
    assert combined.add([C([7], [3]), C([], [])]) == C([], [])  # store 7 and load 3 wait for rank 1
    made = lambda r: C([7], [3]) if r == "C" else r  # noqa: E731
    reports = [made(r) for r in reports] if isinstance(reports, list) else made(reports)
    with pytest.raises(
        ValueError, match=rf"^AllRanks.add: reports must be a list of one kv_ops.Completed per rank \(2\), got {got}$"
    ):
        combined.add(reports)
    # Nothing of the refused call was counted: rank 1 still completes both, and only once.
    assert combined.add([C([], []), C([7], [3])]) == C([7], [3])
    assert combined.add([C([], []), C([7], [3])]) == C([], [])


def _rank_main(rank, world, init_file, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    combined = kv_ops.AllRanks(world)
    # Rank 0 finishes stores 0 and 1 at step 0; rank 1 finishes 0 at step 0 and 1 at step 1.
    steps = (
        [kv_ops.Completed([0, 1], []), kv_ops.Completed([], [])]
        if rank == 0
        else [
            kv_ops.Completed([0], []),
            kv_ops.Completed([1], []),
        ]
    )
    results.put((rank, [combined.gather(report).stores for report in steps]))
    dist.destroy_process_group()


def test_all_ranks_over_torch_distributed_gives_every_rank_the_same_answer(tmp_path):
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, str(tmp_path / "init"), results)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        got = dict(results.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(60)
    finally:
        # A failed rank must not leave the other one (and pytest's exit) waiting for it.
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    assert [p.exitcode for p in procs] == [0, 0]
    assert got == {0: [[0], [1]], 1: [[0], [1]]}


def make_disk_engine(tmp_path, device="cpu", staging_blocks=3):
    gen = torch.Generator().manual_seed(9)
    kv = {"attn0": torch.randint(-99, 99, (2, 32, 4, 2, 16), generator=gen).to(device, torch.bfloat16)}
    return kv_ops.OffloadEngine(
        kv, 32, capacity_bytes=20 * 4096 + 100, disk_dir=str(tmp_path), page_cache=True, staging_blocks=staging_blocks
    )


def disk_round_trip(engine, device):
    gen = torch.Generator().manual_seed(2)
    gpu_ids = torch.randperm(32, generator=gen)[:11]  # 4 chunks of 3 over 2 staging slots
    disk_ids = torch.randperm(engine.num_host_blocks, generator=gen)[:11]
    before = {n: r[gpu_ids.to(device)].clone() for n, r in engine.regions.items()}
    t_store = engine.store(gpu_ids, disk_ids)
    assert engine.flush().stores == [t_store]  # written to the file before the blocks are reused
    for r in engine.regions.values():
        r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8, generator=gen).to(device))
    new_ids = torch.randperm(32, generator=gen)[:11]
    t_load = engine.load(disk_ids, new_ids)
    assert engine.flush() == kv_ops.Completed([], [t_load])
    for n, r in engine.regions.items():
        assert torch.equal(r[new_ids.to(device)], before[n])


def test_disk_tier_round_trips_through_a_real_file(tmp_path):
    engine = make_disk_engine(tmp_path)
    st = os.fstat(engine.disk.file.fd)
    assert engine.num_host_blocks == 20  # 512-byte blocks take a 4 KiB slot each
    assert st.st_size == 20 * 4096 and stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_nlink == 0 and os.listdir(tmp_path) == []  # unnamed from the start
    disk_round_trip(engine, "cpu")
    assert engine.path == "disk" and engine.path_counts == {"kernel": 0, "staged": 0, "dma": 0, "disk": 2}
    thread = engine.disk.thread
    engine.close()
    assert engine.disk is None and not thread.is_alive() and os.listdir(tmp_path) == []


def test_the_disk_tier_is_a_path_of_the_same_interface(tmp_path):
    # The engine has one way to submit, order, collect, flush and close a transfer: the disk tier
    # answers every member a path does, and counts its transfers as one.
    engine = make_disk_engine(tmp_path)
    assert list(engine.paths) == ["disk"] and isinstance(engine.paths["disk"], DiskPath)
    assert isinstance(engine.paths["disk"], TransferPath)  # the contract, member by member: test_paths.py
    tids = [engine.store([0, 1], [0, 1]), engine.load([0], [5]), engine.store([], [])]
    assert engine.path_counts["disk"] == 3  # counted at the call, before the I/O thread ran them
    assert engine.close() == kv_ops.Completed(stores=[tids[0], tids[2]], loads=[tids[1]])
    assert engine.paths == {} and engine.path_counts["disk"] == 3


def test_an_io_error_fails_the_transfer_with_the_os_error_and_never_reports_it_done(tmp_path):
    engine = make_disk_engine(tmp_path)
    ok = engine.store([0, 1], [0, 1])
    assert engine.flush().stores == [ok]
    # The engine's descriptor turns read-only under it (dup2 keeps the number, so nothing else
    # can be written by mistake): the next write fails in the kernel with EBADF. The file has no
    # name; /proc/self/fd reaches it.
    read_only = os.open(f"/proc/self/fd/{engine.disk.file.fd}", os.O_RDONLY)
    os.dup2(read_only, engine.disk.file.fd)
    os.close(read_only)
    bad = engine.store([2, 3], [2, 3])
    done = engine.flush()
    assert done.stores == [] and list(done.failed) == [bad]
    assert isinstance(done.failed[bad], OSError) and "disk tier write of slots 2..3" in str(done.failed[bad])
    assert "Bad file descriptor" in str(done.failed[bad])
    assert engine.path_counts["disk"] == 2  # a failed transfer was still one of the path's
    engine.close()


@gpu
def test_disk_tier_round_trips_on_gpu(tmp_path):
    engine = make_disk_engine(tmp_path, "cuda")
    disk_round_trip(engine, "cuda")
    engine.close()


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@PATHS
def test_one_engine_per_device_in_one_process(path, tmp_path):
    # cuda:1's engine is driven while cuda:0 is the current device, and the other way round.
    engines = [make_engine(f"cuda:{d}", path=path, seed=d)[0] for d in (0, 1)]
    disks = [make_disk_engine(tmp_path, f"cuda:{d}") for d in (0, 1)]
    assert len({os.fstat(e.disk.file.fd).st_ino for e in disks}) == 2  # one private file per device
    for current in (0, 1):
        torch.cuda.set_device(current)
        for d, engine in enumerate(engines):
            round_trip(engine, f"cuda:{d}")
        for d, engine in enumerate(disks):
            disk_round_trip(engine, f"cuda:{d}")
    torch.cuda.set_device(0)
    for engine in disks:
        engine.close()
