"""Property tests: regions resolved from specs or inferred from shapes hold exactly the bytes the
layout places in each block. The oracle is plain indexing of a typed tensor laid over the same
storage; random bytes make every misplaced byte show."""

import re

import numpy as np
import pytest
import torch
from byte_checks import as_bytes, assert_inside_and_disjoint, storage_range
from hypothesis import given, settings
from hypothesis import strategies as st

import kv_ops
from kv_ops import KVCacheTensorSpec, infer_regions, resolve_regions
from kv_ops.geometry import check_kv_caches

DTYPES = [torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.float64]
SETTINGS = settings(max_examples=60, deadline=None)


def random_storage(nbytes: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8)


def typed_view(raw: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    size = n * dtype.itemsize
    return raw[offset : offset + size].view(dtype).view(shape)


@st.composite
def block_shape(draw):
    """Per-block element shape (page, heads, head_dim) and dtype."""
    return (
        (draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 8))),
        draw(st.sampled_from(DTYPES)),
    )


# --- resolve_regions -----------------------------------------------------------------------------


@SETTINGS
@given(
    layers=st.integers(1, 3),
    groups=st.integers(1, 3),
    num_blocks=st.integers(1, 6),
    block=block_shape(),
    offset_elems=st.integers(0, 5),
    tail=st.integers(0, 9),
)
def test_layer_outermost_regions_hold_each_layer_group_block(layers, groups, num_blocks, block, offset_elems, tail):
    inner, dtype = block
    es = dtype.itemsize
    offset = offset_elems * es
    block_stride = es * inner[0] * inner[1] * inner[2]
    raw = random_storage(offset + layers * groups * num_blocks * block_stride + tail)
    typed = typed_view(raw, offset, dtype, (layers, groups, num_blocks, *inner))
    names = [f"model.layers.{k}.attn" for k in range(layers)]
    kv = {name: typed[k] for k, name in enumerate(names)}
    spec = KVCacheTensorSpec(names, block_stride, groups * num_blocks * block_stride, offset)

    regions = resolve_regions(kv, [spec], num_blocks)

    expected = {n if groups == 1 else f"{n}.{g}" for n in names for g in range(groups)}
    assert set(regions) == expected
    for k, name in enumerate(names):
        for g in range(groups):
            region = regions[name if groups == 1 else f"{name}.{g}"]
            assert region.dtype == torch.uint8 and tuple(region.shape) == (num_blocks, block_stride)
            for b in range(num_blocks):
                assert torch.equal(region[b], as_bytes(typed[k, g, b]))
    assert_inside_and_disjoint(regions, [storage_range(raw)])


@SETTINGS
@given(
    layers=st.integers(1, 4),
    num_blocks=st.integers(1, 6),
    block=block_shape(),
    offset_elems=st.integers(0, 5),
    tail=st.integers(0, 9),
)
def test_cross_layer_region_block_spans_all_layers(layers, num_blocks, block, offset_elems, tail):
    inner, dtype = block
    es = dtype.itemsize
    offset = offset_elems * es
    layer_bytes = es * inner[0] * inner[1] * inner[2]
    raw = random_storage(offset + num_blocks * layers * layer_bytes + tail)
    typed = typed_view(raw, offset, dtype, (num_blocks, layers, *inner))
    names = [f"l{k}" for k in range(layers)]
    kv = {name: typed[:, k] for k, name in enumerate(names)}
    spec = KVCacheTensorSpec(names, block_stride=layers * layer_bytes, layer_stride=layer_bytes, offset=offset)

    regions = resolve_regions(kv, [spec], num_blocks)

    assert list(regions) == ["l0"]
    for b in range(num_blocks):
        assert torch.equal(regions["l0"][b], as_bytes(typed[b]))
    assert_inside_and_disjoint(regions, [storage_range(raw)])


@SETTINGS
@given(
    num_blocks=st.integers(1, 5),
    a=block_shape(),
    b=block_shape(),
    gap_elems=st.integers(0, 4),
)
def test_specs_sharing_one_storage_with_different_block_sizes(num_blocks, a, b, gap_elems):
    (inner_a, dtype_a), (inner_b, dtype_b) = a, b
    bytes_a = dtype_a.itemsize * inner_a[0] * inner_a[1] * inner_a[2]
    bytes_b = dtype_b.itemsize * inner_b[0] * inner_b[1] * inner_b[2]
    # Two layers of each kind, K/V-first, placed one after the other in one allocation.
    size_a = 2 * 2 * num_blocks * bytes_a
    offset_b = -(-size_a // 8) * 8 + gap_elems * 8  # multiples of 8 keep every dtype aligned
    raw = random_storage(offset_b + 2 * 2 * num_blocks * bytes_b)
    ta = typed_view(raw, 0, dtype_a, (2, 2, num_blocks, *inner_a))
    tb = typed_view(raw, offset_b, dtype_b, (2, 2, num_blocks, *inner_b))
    kv = {"a0": ta[0], "a1": ta[1], "b0": tb[0], "b1": tb[1]}
    specs = [
        KVCacheTensorSpec(["a0", "a1"], bytes_a, 2 * num_blocks * bytes_a, 0),
        KVCacheTensorSpec(["b0", "b1"], bytes_b, 2 * num_blocks * bytes_b, offset_b),
    ]

    regions = resolve_regions(kv, specs, num_blocks)

    assert sorted(regions) == ["a0.0", "a0.1", "a1.0", "a1.1", "b0.0", "b0.1", "b1.0", "b1.1"]
    for prefix, typed, width in (("a", ta, bytes_a), ("b", tb, bytes_b)):
        for k in range(2):
            for g in range(2):
                region = regions[f"{prefix}{k}.{g}"]
                assert region.shape[1] == width
                for blk in range(num_blocks):
                    assert torch.equal(region[blk], as_bytes(typed[k, g, blk]))
    assert kv_ops.block_bytes(regions) == 4 * (bytes_a + bytes_b)
    assert_inside_and_disjoint(regions, [storage_range(raw)])


@SETTINGS
@given(num_blocks=st.integers(1, 6), block=block_shape())
def test_same_spec_on_aliased_tensors_yields_one_region(num_blocks, block):
    inner, dtype = block
    block_stride = dtype.itemsize * inner[0] * inner[1] * inner[2]
    raw = random_storage(num_blocks * block_stride)
    t = typed_view(raw, 0, dtype, (num_blocks, *inner))
    kv = {"shared_a": t, "shared_b": t.view(num_blocks, -1)}  # two layers, one cache (KV sharing)
    specs = [KVCacheTensorSpec([name], block_stride, num_blocks * block_stride) for name in kv]

    regions = resolve_regions(kv, specs, num_blocks)

    assert list(regions) == ["shared_a"]
    for b in range(num_blocks):
        assert torch.equal(regions["shared_a"][b], as_bytes(t[b]))


def test_spec_past_the_end_of_its_storage_names_layer_and_numbers():
    raw = random_storage(1000)
    with pytest.raises(ValueError, match=r"layer 'l0'.*places 1024 bytes at offset 8.*1000 bytes"):
        resolve_regions({"l0": raw}, [KVCacheTensorSpec(["l0"], 128, 1024, offset=8)], 8)


def test_layer_stride_that_is_not_whole_regions_is_rejected():
    raw = random_storage(4096)
    with pytest.raises(ValueError, match=r"layer 'l0': layer_stride 1100 is not a whole number.*1024 bytes"):
        resolve_regions({"l0": raw}, [KVCacheTensorSpec(["l0", "l1"], 128, 1100)], 8)


def test_cross_layer_layers_that_overflow_the_block_are_rejected():
    raw = random_storage(4096)
    with pytest.raises(ValueError, match=r"layer 'l2'.*3 layers x layer_stride 48 = 144 bytes.*block of 128"):
        resolve_regions({"l0": raw}, [KVCacheTensorSpec(["l0", "l1", "l2"], 128, 48)], 8)


def test_overlapping_specs_are_rejected():
    raw = random_storage(4096)
    specs = [KVCacheTensorSpec(["a"], 128, 1024, 0), KVCacheTensorSpec(["b"], 64, 512, 512)]
    with pytest.raises(ValueError, match=r"regions 'a' and 'b' overlap"):
        resolve_regions({"a": raw, "b": raw}, specs, 8)


def test_spec_without_any_known_layer_lists_the_keys():
    with pytest.raises(ValueError, match=r"names no tensor in kv_caches \(keys: \['x'\]\)"):
        resolve_regions({"x": random_storage(64)}, [KVCacheTensorSpec(["y"], 8, 64)], 8)


def test_spec_layers_on_different_storages_are_rejected():
    kv = {"a": random_storage(1024), "b": random_storage(1024)}
    with pytest.raises(ValueError, match="do not share one storage"):
        resolve_regions(kv, [KVCacheTensorSpec(["a", "b"], 64, 512)], 8)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(layers=[], block_stride=8, layer_stride=8), "non-empty"),
        (dict(layers=["a", "a"], block_stride=8, layer_stride=8), "distinct"),
        (dict(layers=["a"], block_stride=0, layer_stride=8), "block_stride must be a positive integer, got 0"),
        (dict(layers=["a", "b"], block_stride=8, layer_stride=0), "layer_stride 0"),
        (dict(layers=["a"], block_stride=8, layer_stride=-8), "layer_stride must be an integer >= 0, got -8"),
        (dict(layers=["a"], block_stride=8, layer_stride=8, offset=-1), "offset must be an integer >= 0, got -1"),
    ],
    ids=[
        "no-layers",
        "repeated-layer",
        "zero-block-stride",
        "zero-layer-stride",
        "negative-layer-stride",
        "negative-offset",
    ],
)
def test_spec_rejects_bad_numbers(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVCacheTensorSpec(**kwargs)


@pytest.mark.parametrize(
    "args, message",
    [
        ((["a"], None, 0), "block_stride must be a positive integer, got None"),
        ((None, 4096, 0), "layers must be a list of layer names \\(str\\), got None"),
        ((["a"], True, 0), "block_stride must be a positive integer, got True"),
        ((["a"], 4096.5, 0), "block_stride must be a positive integer, got 4096.5"),
        (("abc", 4096, 0), "layers must be a list of layer names \\(str\\), got 'abc'"),
        ((["a", 7], 64, 8), "layers\\[1\\] must be a non-empty string, got 7"),
        ((["a"], 4096, 2.0), "layer_stride must be an integer >= 0, got 2.0"),
        ((["a"], 4096, 0, False), "offset must be an integer >= 0, got False"),
    ],
    ids=[
        "none-stride",
        "none-layers",
        "bool-stride",
        "float-stride",
        "str-layers",
        "int-layer",
        "float-layer-stride",
        "bool-offset",
    ],
)
def test_spec_refuses_wrong_types_at_construction_naming_the_argument(args, message):
    # Each was a TypeError, or accepted and failed later (True bytes, half a byte, three layers "a", "b", "c").
    with pytest.raises(ValueError, match=f"^KVCacheTensorSpec: {message}"):
        KVCacheTensorSpec(*args)


def test_spec_takes_numpy_integers_as_plain_ints_and_resolves_by_them():
    num_blocks, block_stride = 8, 64
    raw = random_storage(2 * num_blocks * block_stride)
    spec = KVCacheTensorSpec(("l0", "l1"), np.int64(block_stride), np.int32(num_blocks * block_stride), np.int64(0))
    assert (spec.block_stride, spec.layer_stride, spec.offset) == (block_stride, num_blocks * block_stride, 0)
    assert all(type(v) is int for v in (spec.block_stride, spec.layer_stride, spec.offset))
    regions = resolve_regions({"l0": raw}, [spec], num_blocks)
    assert torch.equal(regions["l1"].reshape(-1), raw[num_blocks * block_stride :])


# --- infer_regions -------------------------------------------------------------------------------


@SETTINGS
@given(
    layout=st.sampled_from(["kv_first", "kv_first_hnd", "blocks_first_kv", "mla"]),
    layers=st.integers(1, 3),
    num_blocks=st.integers(3, 6),
    block=block_shape(),
    offset_elems=st.integers(0, 3),
)
def test_infer_per_layer_layouts(layout, layers, num_blocks, block, offset_elems):
    (page, heads, dim), dtype = block
    kv, expected = {}, {}
    storages = []
    for k in range(layers):
        name = f"layer{k}"
        if layout == "mla":
            base_shape = (num_blocks, page, heads * dim)
        elif layout == "blocks_first_kv":
            base_shape = (num_blocks, 2, page, heads, dim)
        elif layout == "kv_first":
            base_shape = (2, num_blocks, page, heads, dim)
        else:  # HND in storage, seen as NHD: the block's dims are permuted, still one dense span
            base_shape = (2, num_blocks, heads, page, dim)
        n = 1
        for s in base_shape:
            n *= s
        raw = random_storage((offset_elems + n) * dtype.itemsize + 5)
        storages.append(storage_range(raw))
        base = typed_view(raw, offset_elems * dtype.itemsize, dtype, base_shape)
        kv[name] = base.transpose(2, 3) if layout == "kv_first_hnd" else base
        if layout.startswith("kv_first"):
            for g in range(2):
                expected[f"{name}.{g}"] = [as_bytes(base[g, b]) for b in range(num_blocks)]
        else:
            expected[name] = [as_bytes(base[b]) for b in range(num_blocks)]

    regions = infer_regions(kv, num_blocks)

    assert list(regions) == list(expected)
    for name, blocks in expected.items():
        for b, want in enumerate(blocks):
            assert torch.equal(regions[name][b], want)
    assert_inside_and_disjoint(regions, storages)


@SETTINGS
@given(
    layers=st.integers(2, 4),
    num_blocks=st.integers(3, 6),
    block=block_shape(),
    per_layer_views=st.booleans(),
)
def test_infer_cross_layer_gives_one_region_spanning_all_layers(layers, num_blocks, block, per_layer_views):
    (page, heads, dim), dtype = block
    raw = random_storage(num_blocks * layers * page * heads * dim * dtype.itemsize)
    t = typed_view(raw, 0, dtype, (num_blocks, layers, page, heads, dim))
    # Either every layer maps to the whole cross-layer tensor, or each to its own slice t[:, k],
    # whose per-layer regions interleave per block and are merged back into one.
    kv = {f"l{k}": (t[:, k] if per_layer_views else t) for k in range(layers)}

    regions = infer_regions(kv, num_blocks)

    assert list(regions) == ["l0"]
    assert regions["l0"].shape[1] == layers * page * heads * dim * dtype.itemsize
    for b in range(num_blocks):
        assert torch.equal(regions["l0"][b], as_bytes(t[b]))


@pytest.mark.parametrize(
    "shape, make, message",
    [
        ((5, 4, 8), lambda t: t, "no block axis of size 6"),
        ((2, 2, 4, 8), lambda t: t, "ambiguous"),
        ((6, 4, 8), lambda t: t[:, :, :4], "not one contiguous byte span"),
        ((6, 4, 8), lambda t: t.as_strided((6, 4, 8), (16, 8, 1)), "blocks overlap"),
    ],
    ids=["no-block-axis", "ambiguous-two-blocks", "block-not-dense", "overlapping-blocks"],
)
def test_infer_rejects_other_layouts_with_an_explanation(shape, make, message):
    num_blocks = 2 if shape[0] == 2 and shape[1] == 2 else 6
    t = make(torch.randn(shape))
    with pytest.raises(ValueError, match=message):
        infer_regions({"layer": t}, num_blocks)


def test_regions_write_through_to_the_cache_and_keep_it_alive():
    import gc

    kv = {"l0": torch.randn(2, 4, 16, 8)}
    expected_v2 = kv["l0"][1, 2].clone()
    regions = infer_regions(kv, 4)
    cache = kv.pop("l0")
    fresh = torch.randint(0, 256, (16 * 8 * 4,), dtype=torch.uint8)
    regions["l0.0"][3] = fresh
    assert torch.equal(as_bytes(cache[0, 3]), fresh)
    # Each region has a storage of its own (what torch.compile needs), yet owns the cache's bytes.
    assert regions["l0.0"].untyped_storage().nbytes() == 4 * 16 * 8 * 4 < cache.untyped_storage().nbytes()
    del cache
    gc.collect()
    assert torch.equal(regions["l0.1"][2], as_bytes(expected_v2))


# --- argument checks -------------------------------------------------------------------------------

BAD_KV_CACHES = [
    ([torch.zeros(4, 8)], r"kv_caches must be a mapping of layer name to torch.Tensor, got list"),
    ((torch.zeros(4, 8),), r"kv_caches must be a mapping of layer name to torch.Tensor, got tuple"),
    (np.zeros((4, 8)), r"kv_caches must be a mapping of layer name to torch.Tensor, got ndarray"),
    ({}, r"kv_caches must hold at least one layer, got an empty dict"),
    ({0: torch.zeros(4, 8)}, r"kv_caches keys must be layer names \(str\), got 0 \(int\)"),
    ({"l0": np.zeros((4, 8))}, r"kv_caches\['l0'\] must be a torch.Tensor, got ndarray"),
]


@pytest.mark.parametrize("kv_caches, message", BAD_KV_CACHES, ids=["list", "tuple", "ndarray", "empty", "key", "value"])
def test_malformed_kv_caches_are_refused_naming_the_caller(kv_caches, message):
    check_kv_caches("OffloadEngine", {"l0": torch.zeros(4, 8)})  # the well-formed case passes
    with pytest.raises(ValueError, match="OffloadEngine: " + message):
        check_kv_caches("OffloadEngine", kv_caches)
    with pytest.raises(ValueError, match="infer_regions: " + message):
        infer_regions(kv_caches, 4)
    spec = KVCacheTensorSpec(["l0"], block_stride=32, layer_stride=0)
    with pytest.raises(ValueError, match="resolve_regions: " + message):
        resolve_regions(kv_caches, [spec], 4)


@pytest.mark.parametrize("value", [0, -2, 2.0, "4", None, True])
def test_a_bad_num_blocks_is_refused_naming_the_caller(value):
    kv = {"l0": torch.randn(4, 8)}
    with pytest.raises(
        ValueError, match=re.escape(f"infer_regions: num_blocks must be a positive integer, got {value!r}")
    ):
        infer_regions(kv, value)
    spec = KVCacheTensorSpec(["l0"], block_stride=32, layer_stride=0)
    with pytest.raises(
        ValueError, match=re.escape(f"resolve_regions: num_blocks must be a positive integer, got {value!r}")
    ):
        resolve_regions(kv, [spec], value)


def test_a_numpy_num_blocks_is_a_count():
    kv = {"l0": torch.randn(4, 8)}
    regions = infer_regions(kv, np.int64(4))
    assert tuple(regions["l0"].shape) == (4, 32)
    assert torch.equal(regions["l0"], as_bytes(kv["l0"]).view(4, 32))


# --- block_bytes takes regions only; specs, when given, are not empty; blocks hold bytes ---------------


def test_block_bytes_sums_the_block_of_every_region_in_a_list_or_a_mapping():
    kv = {"l0": torch.randn(2, 8, 4, 2, 8), "l1": torch.randn(8, 3, 5).half()}
    regions = infer_regions(kv, 8)
    assert kv_ops.block_bytes(regions) == 2 * 4 * 2 * 8 * 4 + 3 * 5 * 2
    assert kv_ops.block_bytes(list(regions.values())) == kv_ops.block_bytes(regions)


@pytest.mark.parametrize(
    "regions, message",
    [
        ({"l0": torch.randn(2, 8, 4, 2, 8)}, r"regions\['l0'\] must be a 2-D uint8 region \[num_blocks, block_bytes\]"),
        ({"a": torch.randn(3, 4)}, r"regions\['a'\] must be a 2-D uint8 region .*got torch.float32 \(3, 4\)"),
        ([], r"regions must hold at least one region, got \[\]"),
        (None, "regions must be a list or mapping of uint8 regions, got None"),
        ("x", "regions must be a list or mapping of uint8 regions, got 'x'"),
        (
            torch.randint(0, 256, (8, 256), dtype=torch.uint8),
            r"regions must be a list or mapping of uint8 regions, got a torch.uint8 tensor of shape \(8, 256\) on cpu",
        ),
        ([torch.randint(0, 256, (4,), dtype=torch.uint8)], r"regions\[0\] must be a 2-D uint8 region .*\(4,\)"),
    ],
    ids=["raw-caches", "float-2d", "empty", "none", "string", "one-tensor", "1-d"],
)
def test_block_bytes_refuses_what_is_not_regions_naming_it(regions, message):
    # Each of these used to give a wrong count (the caches' second dimension, 0) or an unrelated error.
    with pytest.raises(ValueError, match=f"^kv_ops.block_bytes: {message}"):
        kv_ops.block_bytes(regions)


def test_empty_specs_are_refused_rather_than_read_as_no_regions():
    kv = {"l0": torch.randn(2, 8, 4, 2, 8)}
    with pytest.raises(
        ValueError, match=r"^resolve_regions: specs is empty; pass one KVCacheTensorSpec per allocation"
    ):
        resolve_regions(kv, [], 8)
    spec = KVCacheTensorSpec(["l0"], block_stride=256, layer_stride=0)
    with pytest.raises(ValueError, match=r"^resolve_regions: specs must be a list of KVCacheTensorSpec objects"):
        resolve_regions(kv, spec, 8)


@pytest.mark.parametrize(
    "kv, name",
    [
        ({"l0": torch.randn(2, 8, 0, 2, 8)}, "l0"),
        ({"l0": torch.randn(2, 8, 4, 2, 8), "l1": torch.randn(8, 0)}, "l1"),
    ],
    ids=["kv-first", "blocks-first"],
)
def test_infer_refuses_blocks_with_no_bytes_naming_the_cache(kv, name):
    shape = re.escape(str(tuple(kv[name].shape)))
    with pytest.raises(
        ValueError, match=rf"^infer_regions: kv_caches\['{name}'\] of shape {shape}: its blocks have no bytes"
    ):
        infer_regions(kv, 8)
