"""The public ops: results against the reference, and bad input rejected before any byte moves.

These run the CPU implementation everywhere and, with a GPU, the CUDA one too (GPU regions and
page-locked host regions: the zero-copy path).
"""

import pytest
import torch
from byte_checks import assert_same_storages, clone_views, host_regions, make_regions, random_bytes

import kv_ops
from kv_ops import kernels, reference

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu


# Where the two sides live: "cpu" (CPU op), "gpu" (GPU regions), "host" (page-locked host
# regions driven by the GPU kernel). Ids live on the kernel's device.
PLACEMENTS = [
    pytest.param("cpu", "cpu", id="cpu-to-cpu"),
    pytest.param("gpu", "host", id="gpu-to-host", marks=gpu),
    pytest.param("host", "gpu", id="host-to-gpu", marks=gpu),
    pytest.param("gpu", "gpu", id="gpu-to-gpu", marks=gpu),
]


def regions_on(place, widths, num_blocks, gen):
    if place == "host":
        return host_regions(widths, num_blocks, gen)
    return make_regions(widths, num_blocks, "cuda" if place == "gpu" else "cpu", strided=True, generator=gen)


def ids_device(*places):
    return "cpu" if set(places) == {"cpu"} else "cuda"


@pytest.mark.parametrize("src_place, dst_place", PLACEMENTS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_copy_blocks_matches_reference(src_place, dst_place, seed):
    gen = torch.Generator().manual_seed(seed)
    widths = [4096, 1024, 80]
    src = regions_on(src_place, widths, 40, gen)
    dst = regions_on(dst_place, widths, 30, gen)
    src_ids = torch.randint(0, 40, (17,), generator=gen)
    dst_ids = torch.randperm(30, generator=gen)[:17]
    want = clone_views(dst)
    reference.copy_blocks(src, want, src_ids, dst_ids)

    dev = ids_device(src_place, dst_place)
    kv_ops.copy_blocks(src, dst, src_ids.to(dev), dst_ids.to(dev))

    if dev == "cuda":
        torch.cuda.synchronize()
    assert_same_storages(dst, want)


@pytest.mark.parametrize("region_place, packed_place", PLACEMENTS)
def test_gather_then_scatter_round_trips(region_place, packed_place):
    gen = torch.Generator().manual_seed(5)
    widths = [2048, 512, 12]
    regions = regions_on(region_place, widths, 24, gen)
    ids = torch.randperm(24, generator=gen)[:9]
    dev = ids_device(region_place, packed_place)
    packed = random_bytes((9, sum(widths)), generator=gen)
    if packed_place == "host":
        packed = kv_ops.pinned_empty(packed.shape).copy_(packed)
    elif packed_place == "gpu":
        packed = packed.cuda()
    (want,) = clone_views([packed])
    reference.gather_blocks(regions, ids, want)

    kv_ops.gather_blocks(regions, ids.to(dev), packed)
    if dev == "cuda":
        torch.cuda.synchronize()
    assert_same_storages([packed], [want])

    # Scatter the packed rows into other blocks, then compare with the reference's scatter.
    new_ids = torch.randperm(24, generator=gen)[:9]
    want_regions = clone_views(regions)
    reference.scatter_blocks(packed, new_ids, want_regions)
    kv_ops.scatter_blocks(packed, new_ids.to(dev), regions)
    if dev == "cuda":
        torch.cuda.synchronize()
    assert_same_storages(regions, want_regions)


def test_mappings_pair_by_name():
    gen = torch.Generator().manual_seed(3)
    src = dict(zip(["k", "v"], make_regions([64, 32], 8, generator=gen)))
    dst = dict(zip(["k", "v"], make_regions([64, 32], 8, generator=gen)))
    kv_ops.copy_blocks(src, dst, torch.tensor([1, 2]), torch.tensor([5, 6]))
    assert torch.equal(dst["k"][5], src["k"][1]) and torch.equal(dst["v"][6], src["v"][2])
    # Another key order pairs by name all the same (k with k), it does not pair by position.
    before = {name: r.clone() for name, r in dst.items()}
    kv_ops.copy_blocks(src, {"v": dst["v"], "k": dst["k"]}, torch.tensor([3]), torch.tensor([0]))
    assert torch.equal(dst["k"][0], src["k"][3]) and torch.equal(dst["v"][0], src["v"][3])
    assert all(torch.equal(dst[n][1:], before[n][1:]) for n in dst)
    with pytest.raises(ValueError, match=r"src and dst name different regions: \['k', 'v'\] vs \['k', 'w'\]"):
        kv_ops.copy_blocks(src, {"w": dst["v"], "k": dst["k"]}, torch.tensor([1]), torch.tensor([2]))


@pytest.mark.parametrize("mapped", ["src", "dst"])
def test_a_mapping_and_a_list_are_refused_as_they_cannot_pair_by_name(mapped):
    gen = torch.Generator().manual_seed(4)
    src = dict(zip(["k", "v"], make_regions([64, 64], 8, generator=gen)))
    dst = dict(zip(["k", "v"], make_regions([64, 64], 8, generator=gen)))
    # The mapping in the other order: by position the list's k would land in the mapping's v.
    dst = {"v": dst["v"], "k": dst["k"]}
    before = {name: r.clone() for name, r in dst.items()}
    listed = "dst" if mapped == "src" else "src"
    args = (src, list(dst.values())) if mapped == "src" else (list(src.values()), dst)
    with pytest.raises(
        ValueError, match=rf"^kv_ops.copy_blocks: {mapped} is a mapping of regions but {listed} is a list, which has no"
    ):
        kv_ops.copy_blocks(*args, torch.tensor([5]), torch.tensor([0]))
    assert all(torch.equal(dst[n], before[n]) for n in dst)  # refused before any byte moved


@pytest.mark.parametrize("mapped", ["src", "dst"])
@pytest.mark.parametrize("other", ["tensor", "none"])
def test_a_mapping_and_a_side_that_is_no_list_are_refused_as_any_mistyped_side(mapped, other):
    gen = torch.Generator().manual_seed(6)
    named = dict(zip(["k", "v"], make_regions([64, 64], 8, generator=gen)))
    single = random_bytes((8, 64), generator=gen) if other == "tensor" else None
    before = {name: r.clone() for name, r in named.items()}
    kept = None if single is None else single.clone()
    unnamed = "dst" if mapped == "src" else "src"
    args = (named, single) if mapped == "src" else (single, named)
    # Pairing by name took set() of the tensor's rows: "Boolean value of Tensor ... is ambiguous".
    shown = "Tensor" if other == "tensor" else "NoneType"
    with pytest.raises(
        TypeError, match=rf"^kv_ops.copy_blocks: {unnamed} must be a list or mapping of region tensors, got {shown}$"
    ):
        kv_ops.copy_blocks(*args, torch.tensor([5]), torch.tensor([0]))
    assert all(torch.equal(named[n], before[n]) for n in named)  # refused before any byte moved
    assert single is None or torch.equal(single, kept)


# --- bad input ------------------------------------------------------------------------------------


def bad_copy_cases():
    """(id, call(src, dst) -> None, message): each call is wrong in exactly one way."""
    t = torch.tensor
    return [
        (
            "src-id-too-large",
            lambda s, d: kv_ops.copy_blocks(s, d, t([0, 9]), t([0, 1])),
            r"src_ids\[1\] = 9 is outside \[0, 8\)",
        ),
        (
            "dst-id-negative",
            lambda s, d: kv_ops.copy_blocks(s, d, t([0, 1]), t([2, -1])),
            r"dst_ids\[1\] = -1 is outside \[0, 6\)",
        ),
        (
            "dst-id-repeated",
            lambda s, d: kv_ops.copy_blocks(s, d, t([0, 1, 2]), t([4, 3, 4])),
            r"dst_ids names block 4 more than once",
        ),
        ("ids-length", lambda s, d: kv_ops.copy_blocks(s, d, t([0, 1]), t([2])), r"dst_ids has 1 ids, expected 2"),
        ("ids-float", lambda s, d: kv_ops.copy_blocks(s, d, t([0.0]), t([1])), r"src_ids must be a 1-D int32 or int64"),
        ("ids-2d", lambda s, d: kv_ops.copy_blocks(s, d, t([[0]]), t([1])), r"src_ids must be a 1-D int32 or int64"),
        (
            "ids-list",
            lambda s, d: kv_ops.copy_blocks(s, d, t([0, 1]), [2, 3]),
            r"dst_ids must be a 1-D int32 or int64 tensor on the kernel's device, got list",
        ),
        (
            "width-mismatch",
            lambda s, d: kv_ops.copy_blocks(s, [d[0], d[1][:, :8]], t([0]), t([1])),
            r"region pair 1 has block sizes 16 \(src\) and 8 \(dst\)",
        ),
        (
            "region-count",
            lambda s, d: kv_ops.copy_blocks(s, d[:1], t([0]), t([1])),
            r"2 source regions but 1 destination",
        ),
        (
            "region-dtype",
            lambda s, d: kv_ops.copy_blocks(s, [d[0].view(torch.int16), d[1]], t([0]), t([1])),
            r"dst\[0\] must be a 2-D uint8 region",
        ),
        (
            "region-3d",
            lambda s, d: kv_ops.copy_blocks([s[0].view(8, 4, 8), s[1]], d, t([0]), t([1])),
            r"src\[0\] must be a 2-D uint8 region",
        ),
        (
            "same-region-overlap",
            lambda s, d: kv_ops.copy_blocks(s, s, t([0, 1]), t([1, 2])),
            r"block 1 is both a source and a destination",
        ),
    ]


@pytest.mark.parametrize("case", bad_copy_cases(), ids=lambda c: c[0])
def test_bad_copy_raises_before_any_byte_moves(case):
    _, call, message = case
    gen = torch.Generator().manual_seed(11)
    src = make_regions([32, 16], 8, generator=gen)
    dst = make_regions([32, 16], 6, generator=gen)
    before = clone_views(dst + src)
    with pytest.raises(ValueError, match=message):
        call(src, dst)
    assert_same_storages(dst + src, before)


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda r, ids: kv_ops.gather_blocks(r, ids, torch.empty(3, 40, dtype=torch.uint8)),
            r"out must be uint8 of shape \(3, 48\)",
        ),
        (lambda r, ids: kv_ops.gather_blocks(r, ids, torch.empty(3, 48)), r"out must be uint8"),
        (
            lambda r, ids: kv_ops.gather_blocks(r, torch.tensor([0, 8, 1]), torch.empty(3, 48, dtype=torch.uint8)),
            r"ids\[1\] = 8 is outside \[0, 8\)",
        ),
        (
            lambda r, ids: kv_ops.scatter_blocks(torch.empty(3, 48, dtype=torch.uint8), torch.tensor([1, 1, 2]), r),
            r"ids names block 1 more than once",
        ),
        (
            lambda r, ids: kv_ops.scatter_blocks(torch.empty(2, 48, dtype=torch.uint8), ids, r),
            r"packed must be uint8 of shape \(3, 48\)",
        ),
        (
            lambda r, ids: kv_ops.gather_blocks(r, ids.tolist(), torch.empty(3, 48, dtype=torch.uint8)),
            r"gather_blocks: ids must be a 1-D int32 or int64 tensor .*, got list",
        ),
        (
            lambda r, ids: kv_ops.scatter_blocks(torch.empty(3, 48, dtype=torch.uint8), (1, 2, 3), r),
            r"scatter_blocks: ids must be a 1-D int32 or int64 tensor .*, got tuple",
        ),
    ],
    ids=[
        "gather-out-width",
        "gather-out-dtype",
        "gather-id-range",
        "scatter-repeated-id",
        "scatter-packed-rows",
        "gather-ids-list",
        "scatter-ids-tuple",
    ],
)
def test_bad_gather_scatter_raise_before_any_byte_moves(call, message):
    regions = make_regions([32, 16], 8, generator=torch.Generator().manual_seed(2))
    before = clone_views(regions)
    with pytest.raises(ValueError, match=message):
        call(regions, torch.tensor([0, 1, 2]))
    assert_same_storages(regions, before)


def test_with_id_checks_off_invalid_pairs_are_skipped_and_counted():
    gen = torch.Generator().manual_seed(4)
    src = make_regions([32, 16], 8, generator=gen)
    dst = make_regions([32, 16], 6, generator=gen)
    src_ids, dst_ids = torch.tensor([1, 50, 2, 3]), torch.tensor([0, 1, -2, 5])
    want = clone_views(dst)
    reference.copy_blocks(src, want, src_ids, dst_ids)  # moves pairs 0 and 3 only
    kv_ops.reset_error_count("cpu")
    with kv_ops.id_checks(False):
        kv_ops.copy_blocks(src, dst, src_ids, dst_ids)
    assert_same_storages(dst, want)
    assert torch.equal(dst[0][0], src[0][1]) and torch.equal(dst[1][5], src[1][3])
    assert kv_ops.error_count("cpu") == 2
    kv_ops.reset_error_count("cpu")
    assert kv_ops.error_count("cpu") == 0


@pytest.mark.parametrize("value", ["no", "", None, 0, 1, 1.0])
def test_set_id_checks_refuses_anything_but_a_bool_and_keeps_the_setting(value):
    # "no" is truthy and None falsy: read by truthiness, one of them would do the opposite of
    # what was meant. The checks stay as they were: a bad id is still refused.
    regions = make_regions([32], 8, generator=torch.Generator().manual_seed(3))
    for setting in (True, False):
        previous = kv_ops.set_id_checks(setting)
        try:
            with pytest.raises(ValueError, match=f"set_id_checks: enabled must be True or False, got {value!r}"):
                kv_ops.set_id_checks(value)
            assert kv_ops.set_id_checks(setting) is setting
        finally:
            kv_ops.set_id_checks(previous)
    with pytest.raises(ValueError, match=r"ids\[0\] = 9 is outside \[0, 8\)"):
        kv_ops.gather_blocks(regions, torch.tensor([9]), torch.empty(1, 32, dtype=torch.uint8))


def test_set_id_checks_takes_numpy_bools():
    import numpy as np

    previous = kv_ops.set_id_checks(np.bool_(False))
    try:
        assert kv_ops.set_id_checks(np.bool_(True)) is False
    finally:
        kv_ops.set_id_checks(previous)


@gpu
def test_gpu_call_with_ids_on_the_host_names_the_device():
    src = make_regions([64], 8, "cuda")
    dst = make_regions([64], 8, "cuda")
    with pytest.raises(ValueError, match=r"src_ids is on cpu, but this call runs on cuda:0"):
        kv_ops.copy_blocks(src, dst, torch.tensor([0]), torch.tensor([1]).cuda())


@gpu
def test_gpu_rejects_pageable_host_region():
    src = make_regions([64], 8, "cuda")
    pageable = make_regions([64], 8, "cpu")
    ids = torch.tensor([0, 1], device="cuda")
    with pytest.raises(ValueError, match="not page-locked memory"):
        kv_ops.copy_blocks(src, pageable, ids, ids)


def _gpu_ids(values, dtype, strided):
    """The caller's device ids: contiguous, or every other element of a longer tensor."""
    t = torch.tensor(values, dtype=dtype)
    if strided:
        t = torch.stack([t, torch.full_like(t, 99)], dim=1).reshape(-1).cuda()[::2]
        assert not t.is_contiguous()
        return t
    return t.cuda()


@gpu
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_gpu_ids_are_checked_in_the_same_words_before_any_byte_moves(dtype, strided):
    # The eager checks copy CUDA ids to the host (page-locked, one wait on the stream): the same
    # refusals as for CPU ids, and a good call after them still lands.
    gen = torch.Generator().manual_seed(13)
    src = make_regions([32, 16], 8, "cuda", generator=gen)
    dst = make_regions([32, 16], 6, "cuda", generator=gen)
    packed = torch.randint(0, 256, (3, 48), dtype=torch.uint8, generator=gen).cuda()
    before = clone_views(dst + src + [packed])

    def ids(values):
        return _gpu_ids(values, dtype, strided)

    bad = [
        (lambda: kv_ops.copy_blocks(src, dst, ids([0, 9]), ids([0, 1])), r"src_ids\[1\] = 9 is outside \[0, 8\)"),
        (lambda: kv_ops.copy_blocks(src, dst, ids([0, 1]), ids([2, -1])), r"dst_ids\[1\] = -1 is outside \[0, 6\)"),
        (lambda: kv_ops.copy_blocks(src, dst, ids([0, 1, 2]), ids([4, 3, 4])), r"dst_ids names block 4 more than once"),
        (lambda: kv_ops.gather_blocks(src, ids([0, 8, 1]), packed), r"ids\[1\] = 8 is outside \[0, 8\)"),
        (lambda: kv_ops.scatter_blocks(packed, ids([1, 1, 2]), dst), r"ids names block 1 more than once"),
    ]

    for call, message in bad:
        with pytest.raises(ValueError, match=message):
            call()
    torch.cuda.synchronize()
    assert_same_storages(dst + src + [packed], before)
    src_ids, dst_ids = [5, 0, 7], [2, 4, 1]
    want = clone_views(dst)
    reference.copy_blocks(src, want, torch.tensor(src_ids), torch.tensor(dst_ids))
    kv_ops.copy_blocks(src, dst, ids(src_ids), ids(dst_ids))
    torch.cuda.synchronize()
    assert_same_storages(dst, want)


@gpu
def test_gpu_invalid_ids_with_checks_off_are_skipped_counted_and_write_nothing_outside():
    gen = torch.Generator().manual_seed(8)
    src = make_regions([4096, 100], 16, "cuda", strided=True, generator=gen)
    dst = host_regions([4096, 100], 12, gen)
    src_ids = torch.tensor([3, 16, 5, -1, 7])
    dst_ids = torch.tensor([0, 1, 12, 4, 11])
    want = clone_views(dst)
    reference.copy_blocks(src, want, src_ids, dst_ids)
    kv_ops.reset_error_count("cuda")
    with kv_ops.id_checks(False):
        kv_ops.copy_blocks(src, dst, src_ids.cuda(), dst_ids.cuda())
    torch.cuda.synchronize()
    assert_same_storages(dst, want)
    assert kv_ops.error_count("cuda") == 3


def _u8(*shape):
    return torch.zeros(*shape, dtype=torch.uint8)


@pytest.mark.parametrize(
    "op, args",
    [
        pytest.param(
            kv_ops.copy_blocks,
            ([_u8(4, 48)], [_u8(4, 32)], torch.tensor([0, 1]), torch.tensor([2, 3])),
            id="copy-widths",
        ),
        pytest.param(
            kv_ops.copy_blocks,
            ([_u8(4, 48)], [_u8(4, 48)], torch.tensor([0.0, 1.0]), torch.tensor([2, 3])),
            id="copy-float-ids",
        ),
        pytest.param(kv_ops.gather_blocks, ([_u8(4, 48)], torch.tensor([0, 1]), _u8(2, 40)), id="gather-out-width"),
        pytest.param(kv_ops.scatter_blocks, (_u8(3, 48), torch.tensor([0, 1]), [_u8(4, 48)]), id="scatter-packed-rows"),
    ],
)
def test_the_fakes_refuse_what_the_eager_checks_refuse_in_the_same_words(op, args):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with pytest.raises(ValueError) as eager:
        op(*args)
    with FakeTensorMode() as mode:
        fake_args = [[mode.from_tensor(t) for t in a] if isinstance(a, list) else mode.from_tensor(a) for a in args]
        with pytest.raises(RuntimeError) as fake:
            getattr(torch.ops.kv_ops, op.__name__)(*fake_args)
    assert str(eager.value) in str(fake.value)


@pytest.mark.gpu
def test_a_copy_used_again_takes_new_ids_of_every_form_on_any_stream():
    # After its first call a copy is launched through the compiled kernel's own launcher, keyed
    # by what Triton specialises on: new ids, sizes, int32 and int64 ids, ids at addresses that
    # are and are not 16-byte aligned (views into a larger tensor), and a switch of stream, all
    # interleaved so that each specialisation is used again after the others, must all land.
    gen = torch.Generator().manual_seed(21)
    src = make_regions([256, 48, 1024], 40, "cuda", generator=gen)
    dst = [kv_ops.pinned_empty((30, w)) for w in (256, 48, 1024)]
    for d in dst:
        d.copy_(torch.randint(0, 256, d.shape, dtype=torch.uint8, generator=gen))  # poison
    want = clone_views(dst)
    streams = [torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()]
    for call in range(24):
        n = int(torch.randint(1, 25, (1,), generator=gen))
        src_ids, dst_ids = torch.randint(0, 40, (n,), generator=gen), torch.randperm(30, generator=gen)[:n]
        dtype = torch.int32 if call % 2 else torch.int64
        offset = (call // 2) % 3  # 0: aligned; 1: 4 or 8 bytes in; 2: 8 or 16 bytes in
        padded_src = torch.cat([torch.randint(0, 40, (offset,), generator=gen), src_ids]).to("cuda", dtype)
        padded_dst = torch.cat([torch.randint(0, 30, (offset,), generator=gen), dst_ids]).to("cuda", dtype)
        stream = streams[call % 3]
        stream.wait_stream(streams[(call - 1) % 3])  # the test's own order between its calls
        with torch.cuda.stream(stream):
            kv_ops.copy_blocks(src, dst, padded_src[offset:], padded_dst[offset:])
        reference.copy_blocks([s.cpu() for s in src], want, src_ids, dst_ids)
    torch.cuda.synchronize()
    assert all(torch.equal(d, w) for d, w in zip(dst, want))


@pytest.mark.gpu
def test_an_eager_copy_used_again_launches_the_compiled_kernel_once_and_no_torch_operation(monkeypatch):
    # The regression guard of the eager op: with id checks off, a hot copy is one launch of the
    # compiled kernel, not through Triton's @jit binder, and no aten operation.
    gen = torch.Generator().manual_seed(22)
    src = make_regions([4096] * 16, 64, "cuda", generator=gen)
    dst = [kv_ops.pinned_empty((64, 4096)) for _ in range(16)]
    ids = torch.randperm(64, generator=gen)[:16].cuda()
    kv_ops.copy_blocks(src, dst, ids, ids)
    launches, binds = [], []
    launch, bind = kernels.BoundCopy.launch_kernel, kernels._block_copy_kernel.run
    monkeypatch.setattr(kernels.BoundCopy, "launch_kernel", lambda *a: launches.append(1) or launch(*a))
    monkeypatch.setattr(kernels._block_copy_kernel, "run", lambda *a, **k: binds.append(1) or bind(*a, **k))
    new = torch.randperm(64, generator=gen)[:16].cuda()
    with (
        kv_ops.validation.id_checks(False),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
    ):
        kv_ops.copy_blocks(src, dst, new, new)
    aten = [e.name for e in prof.events() if e.name.startswith("aten::")]
    assert (len(launches), len(binds), aten) == (1, 0, [])
    torch.cuda.synchronize()
    assert all(torch.equal(d[new.cpu()], s[new].cpu()) for d, s in zip(dst, src))


def test_a_region_list_freed_and_made_again_is_checked_again_whatever_ids_python_reuses():
    # The ops find region lists by their tensors' identity; an entry must go with its tensors, or
    # a new tensor at a reused id would skip the checks (here: a block-size mismatch).
    ids = torch.tensor([0, 1])
    for _ in range(50):
        good_src, good_dst = make_regions([64], 4), make_regions([64], 4)
        kv_ops.copy_blocks(good_src, good_dst, ids, ids)
        del good_src, good_dst
        bad_src, bad_dst = make_regions([64], 4), make_regions([48], 4)
        with pytest.raises(ValueError, match=r"region pair 0 has block sizes 64 \(src\) and 48 \(dst\)"):
            kv_ops.copy_blocks(bad_src, bad_dst, ids, ids)
        del bad_src, bad_dst
