"""OffloadEngine(groups=...): a group's transfer moves its own regions' bytes and nothing else.

Every test poisons the whole mirror and every cache with fresh random bytes first, then checks
byte for byte that the group's columns of the named rows (and, on a load, the group's bytes of
the named GPU blocks) changed to what they must hold, and that every other byte on both sides,
other groups' regions and the bytes past a group's share of a padded block included, is what
it was. The staged path gets a ring of 3 rows per slot, so that its transfers cross chunks and
reuse slots. The tests marked gpu run the same on CUDA, GPU ids included.
"""

import warnings

import numpy as np
import pytest
import torch

import kv_ops
from kv_ops.transfer.paths import RING_SLOTS

gpu = pytest.mark.gpu
NUM_BLOCKS = 48
# Four regions: K/V-first attention (two regions of 256 B), MLA (192 B), a padded page (320 B).
GROUPS = {
    "attn": ["attn0"],  # a layer name: both of its regions
    "mla": ["mla1"],
    "padded": [("pad2", 200), "mla1"],  # the first 200 B of the padded page, out of mirror order
    "all": ["attn0", "mla1", "pad2"],
}
PATH_CASES = ["kernel", "staged", "dma", "auto"]


def make(device="cpu", path="kernel", seed=0, groups=GROUPS, capacity_blocks=40):
    gen = torch.Generator().manual_seed(seed)
    kv = {
        "attn0": torch.randint(0, 256, (2, NUM_BLOCKS, 4, 64), dtype=torch.uint8, generator=gen),
        "mla1": torch.randint(0, 256, (NUM_BLOCKS, 192), dtype=torch.uint8, generator=gen),
        "pad2": torch.randint(0, 256, (NUM_BLOCKS, 320), dtype=torch.uint8, generator=gen),
    }
    kv = {name: t.to(device) for name, t in kv.items()}
    row = 2 * 256 + 192 + 320
    ring = {} if path == "auto" else {"ring_bytes": RING_SLOTS * 3 * row}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA: pinned_empty warns that it returns plain memory
        engine = kv_ops.OffloadEngine(
            kv, NUM_BLOCKS, capacity_bytes=capacity_blocks * row, path=path, groups=groups, **ring
        )
    return engine, gen


def poison(engine, gen):
    """Fresh random bytes in the mirror and every region; returns copies of both."""
    engine.mirror.copy_(torch.randint(0, 256, engine.mirror.shape, dtype=torch.uint8, generator=gen))
    for region in engine.regions.values():
        region.copy_(torch.randint(0, 256, region.shape, dtype=torch.uint8, generator=gen).to(region.device))
    return engine.mirror.clone(), {name: r.clone() for name, r in engine.regions.items()}


def columns(engine, group):
    """The mirror columns, and per region the block bytes, that ``group`` moves."""
    mirror_cols = np.zeros(engine.block_bytes, dtype=bool)
    region_cols = {name: np.zeros(r.shape[1], dtype=bool) for name, r in engine.regions.items()}
    start = 0
    for name, region in engine.regions.items():
        for entry, width in engine.groups[group]:
            if entry == name:
                mirror_cols[start : start + width] = True
                region_cols[name][:width] = True
        start += region.shape[1]
    return torch.from_numpy(mirror_cols), {n: torch.from_numpy(c) for n, c in region_cols.items()}


def check_store(engine, group, gpu_ids, host_ids, mirror0, regions0):
    mirror_cols, region_cols = columns(engine, group)
    expected = mirror0.clone()
    packed = torch.cat([regions0[n][gpu_ids].cpu() for n in engine.regions], dim=1)
    rows = torch.as_tensor(host_ids)
    expected[rows[:, None], mirror_cols.nonzero().flatten()[None, :]] = packed[:, mirror_cols]
    assert torch.equal(engine.mirror, expected), f"group {group!r}: the mirror holds other bytes than its own"
    for name, region in engine.regions.items():
        assert torch.equal(region, regions0[name]), f"a store wrote region {name!r}"
    moved = int(mirror_cols.sum()) * len(host_ids)
    assert moved == engine.group_bytes[group] * len(host_ids)


def check_load(engine, group, host_ids, gpu_ids, mirror0, regions0):
    _, region_cols = columns(engine, group)
    assert torch.equal(engine.mirror, mirror0), "a load wrote the mirror"
    ids = torch.as_tensor(gpu_ids).to(next(iter(regions0.values())).device)
    rows = torch.as_tensor(host_ids)
    for name, region in engine.regions.items():
        expected = regions0[name].clone()
        cols = region_cols[name].nonzero().flatten().to(region.device)
        if cols.numel():
            source = engine.mirror_regions[name][rows][:, region_cols[name]].to(region.device)
            expected[ids[:, None], cols[None, :]] = source
        assert torch.equal(region, expected), f"group {group!r}: region {name!r} holds other bytes than its own"


def round_trips(device, path, id_device="cpu"):
    engine, gen = make(device, path)
    rng = np.random.default_rng(1)
    with engine:
        assert engine.group_bytes == {"attn": 512, "mla": 192, "padded": 392, "all": 1024}
        for group in (*GROUPS, "padded", "attn"):
            for count in (1, 7, 20):  # 7 and 20 cross the ring's chunks of 3 rows
                gpu_ids = rng.permutation(NUM_BLOCKS)[:count]
                host_ids = rng.permutation(40)[:count]
                mirror0, regions0 = poison(engine, gen)
                ids = torch.as_tensor(gpu_ids).to(id_device) if path == "kernel" else gpu_ids
                engine.store(ids, host_ids, group=group)
                engine.flush()
                check_store(engine, group, gpu_ids, host_ids, mirror0, regions0)
                mirror0, regions0 = poison(engine, gen)
                engine.load(host_ids, ids, group=group)
                engine.flush()
                check_load(engine, group, host_ids, gpu_ids, mirror0, regions0)
        counts = {name: n for name, n in engine.path_counts.items() if n}
        assert sum(counts.values()) == 2 * 3 * (len(GROUPS) + 2)
        if path != "auto":
            assert set(counts) == {path}


@pytest.mark.parametrize("path", PATH_CASES)
def test_a_group_moves_only_its_own_bytes_on_the_cpu(path):
    round_trips("cpu", path)


@gpu
@pytest.mark.parametrize("path", PATH_CASES)
def test_a_group_moves_only_its_own_bytes_on_the_gpu(path):
    round_trips("cuda", path)


@gpu
def test_a_group_with_gpu_ids_moves_only_its_own_bytes_on_the_kernel_path():
    round_trips("cuda", "kernel", id_device="cuda")


def test_groups_of_equal_entries_share_their_paths_and_every_staged_path_one_ring():
    groups = {"a": ["mla1", "pad2"], "b": ["mla1", "pad2"], "c": ["attn0"]}
    engine, _ = make(path="staged", groups=groups)
    with engine:
        routes = engine._routes
        assert routes["a"][0] is routes["b"][0] and routes["a"][0] is not routes["c"][0]
        assert routes["a"][0]["staged"].staging is routes["c"][0]["staged"].staging


def test_an_engine_without_groups_refuses_a_group_and_one_with_groups_needs_one():
    plain, gen = make(groups=None)
    for engine, group, message in (
        (plain, "attn", "made without groups: leave group out"),
        (make()[0], None, r"group=None is not one of this engine's groups \('attn', 'mla', 'padded', 'all'\)"),
        (make()[0], "nope", "group='nope' is not one of"),
        (make()[0], ["attn"], r"group=\['attn'\] is not one of"),
    ):
        with engine:
            mirror0, regions0 = poison(engine, gen)
            for call, ids in ((engine.store, ([1], [2])), (engine.load, ([2], [1]))):
                with pytest.raises(ValueError, match=message):
                    call(*ids, group=group)
            assert torch.equal(engine.mirror, mirror0)
            assert all(torch.equal(r, regions0[n]) for n, r in engine.regions.items())
            # No transfer id was used up by the refused calls.
            assert engine.store([1], [2], **({} if engine is plain else {"group": "mla"})) == 0


@pytest.mark.parametrize(
    "groups,message",
    [
        ([["mla1"]], r"groups must be a non-empty mapping of group to region names, got \[\['mla1'\]\]"),
        ({}, r"groups must be a non-empty mapping of group to region names, got \{\}"),
        ({None: ["mla1"]}, "groups has the key None"),
        ({"g": []}, r"groups\['g'\] must be a non-empty list of region names, got \[\]"),
        ({"g": "mla1"}, r"groups\['g'\] must be a non-empty list of region names, got 'mla1'"),
        ({"g": ["mla9"]}, r"groups\['g'\] entry 'mla9' is no region .*'attn0.0', 'attn0.1', 'mla1', 'pad2'"),
        ({"g": [("pad2", 321)]}, r"groups\['g'\] entry \('pad2', 321\): the bytes must be an integer in \[1, 320\]"),
        ({"g": [("pad2", 0)]}, r"entry \('pad2', 0\): the bytes must be an integer in \[1, 320\]"),
        ({"g": [("pad2", True)]}, r"entry \('pad2', True\): the bytes must be an integer"),
        ({"g": ["mla1", ("mla1", 8)]}, r"groups\['g'\] names a region twice"),
    ],
)
def test_bad_groups_are_refused_naming_them(groups, message):
    with pytest.raises(ValueError, match=message):
        make(groups=groups)


def test_groups_need_the_mirror_not_the_disk_tier(tmp_path):
    kv = {"mla1": torch.zeros(NUM_BLOCKS, 192, dtype=torch.uint8)}
    with pytest.raises(ValueError, match="groups needs the host mirror, but disk_dir was given"):
        kv_ops.OffloadEngine(kv, NUM_BLOCKS, 1 << 20, disk_dir=str(tmp_path), groups={"g": ["mla1"]})
    assert list(tmp_path.iterdir()) == []
