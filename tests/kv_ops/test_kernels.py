"""The Triton block-copy kernel against the pure-torch reference, byte for byte.

Without a GPU the kernel runs under TRITON_INTERPRET=1 on CPU tensors; with one, on the GPU.
Destinations start as random bytes, so unwritten bytes differ from the reference's result and
bytes written outside a region (the gaps of strided regions) show too.
"""

import pytest
import torch
from byte_checks import assert_same_storages, clone_views, make_regions, random_bytes
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_ops import kernels, reference
from kv_ops.cuda import launch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

widths_strategy = st.lists(
    st.one_of(st.sampled_from([16, 64, 256, 1024, 4096, 20480]), st.integers(1, 300)), min_size=1, max_size=4
)


def pick_ids(gen: torch.Generator, n: int, num_blocks: int, unique: bool) -> torch.Tensor:
    if unique:
        return torch.randperm(num_blocks, generator=gen)[:n]
    return torch.randint(0, num_blocks, (n,), generator=gen)


def run_case(seed, widths, src_blocks, dst_blocks, n, strided, kind, bad, **launch):
    gen = torch.Generator().manual_seed(seed)
    n = min(n, dst_blocks, src_blocks)
    src_ids = pick_ids(gen, n, src_blocks, unique=False)
    dst_ids = pick_ids(gen, n, dst_blocks, unique=True)
    if bad and n:
        # Out-of-range ids on both sides, negative too: skipped and counted, never wrapped.
        src_ids[0] = src_blocks + 3
        dst_ids[-1] = -1
    width = sum(widths)
    src = make_regions(widths, src_blocks, DEVICE, strided, gen)
    dst = make_regions(widths, dst_blocks, DEVICE, strided, gen)
    errors = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    src_ids, dst_ids = src_ids.to(DEVICE), dst_ids.to(DEVICE)

    if kind == "copy":
        want = clone_views(dst)
        skipped = reference.copy_blocks(src, want, src_ids, dst_ids)
        kernels.block_copy(src, dst, src_ids, dst_ids, n, errors, **launch)
        assert_same_storages(dst, want)
    elif kind == "gather":
        out = random_bytes((n, width), DEVICE, gen)
        (want,) = clone_views([out])
        skipped = reference.gather_blocks(src, src_ids, want)
        kernels.block_copy(src, out, src_ids, None, n, errors, **launch)
        assert_same_storages([out], [want])
    else:
        packed = random_bytes((n, width), DEVICE, gen)
        want = clone_views(dst)
        skipped = reference.scatter_blocks(packed, dst_ids, want)
        kernels.block_copy(packed, dst, None, dst_ids, n, errors, **launch)
        assert_same_storages(dst, want)
    assert int(errors) == skipped
    if bad and n:
        assert skipped >= 1


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    widths=widths_strategy,
    src_blocks=st.integers(1, 12),
    dst_blocks=st.integers(1, 12),
    n=st.integers(0, 12),
    strided=st.booleans(),
    kind=st.sampled_from(["copy", "gather", "scatter"]),
    bad=st.booleans(),
)
def test_kernel_matches_reference(seed, widths, src_blocks, dst_blocks, n, strided, kind, bad):
    run_case(seed, widths, src_blocks, dst_blocks, n, strided, kind, bad)


@pytest.mark.parametrize("num_programs", [1, 3, 8], ids=lambda p: f"programs{p}")
@pytest.mark.parametrize("tile_bytes", [256, 16384], ids=lambda t: f"tile{t}")
def test_tiles_dealt_across_many_regions(num_programs, tile_bytes):
    # Many small regions of mixed widths: the round-robin across region boundaries must cover
    # every tile exactly once whatever the program count and tile size.
    run_case(
        7,
        [64, 4096, 48, 1000, 256, 20480, 8],
        9,
        11,
        9,
        True,
        "copy",
        False,
        num_programs=num_programs,
        tile_bytes=tile_bytes,
    )


def test_zero_pairs_launch_nothing():
    dst = make_regions([64], 4, DEVICE)
    (want,) = clone_views(dst)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    kernels.block_copy(
        make_regions([64], 4, DEVICE), dst, empty, empty, 0, torch.zeros(1, dtype=torch.int64, device=DEVICE)
    )
    assert_same_storages(dst, [want])


def test_alignment_is_the_largest_power_of_two_up_to_16():
    assert launch.alignment([64, 4096, 32]) == 16
    assert launch.alignment([12, 4096]) == 4
    assert launch.alignment([3, 4096]) == 1
    assert launch.alignment([0, 0]) == 16


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["gpu_to_host", "host_to_gpu"])
def test_aligned_blocks_compile_to_16_byte_accesses(direction):
    import kv_ops

    gpu = make_regions([4096, 1024], 8, "cuda")
    host = [kv_ops.pinned_empty((8, w)) for w in (4096, 1024)]
    src, dst = (gpu, host) if direction == "gpu_to_host" else (host, gpu)
    ids = torch.arange(8, device="cuda")
    errors = torch.zeros(1, dtype=torch.int64, device="cuda")
    kernel = kernels.block_copy(src, dst, ids, ids.flip(0), 8, errors)
    torch.cuda.synchronize()
    ptx = kernel.asm["ptx"]
    # Every copy access is a 128-bit vector access: ld/st.global(.nc).v4.b32.
    assert "ld.global" in ptx and ".v4.b32" in ptx
    assert all(".v4." in line for line in ptx.splitlines() if "st.global" in line and "b32" in line), ptx[:2000]
    for s, d in zip(src, dst):
        assert torch.equal(d.cpu(), s.cpu().flip(0))


def test_a_launch_from_an_id_block_reads_the_count_and_both_sides_ids_from_it():
    # What the engine's captured graphs run: [n, src ids (n), dst ids (n)] in one int64 block, the
    # count data rather than an argument, so one graph serves every call size up to its capacity.
    gen = torch.Generator().manual_seed(11)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    src = [torch.randint(0, 256, (12, w), dtype=torch.uint8, generator=gen).to(device) for w in (64, 48)]
    dst = [torch.randint(0, 256, (10, w), dtype=torch.uint8, generator=gen).to(device) for w in (64, 48)]
    errors = torch.zeros(1, dtype=torch.int64, device=device)
    capacity, n = 8, 5
    src_ids, dst_ids = torch.randint(0, 12, (n,), generator=gen), torch.randperm(10, generator=gen)[:n]
    src_ids[4] = 12  # out of range: skipped and counted
    block = torch.full((1 + 2 * capacity,), -7, dtype=torch.int64)  # poison past the ids it holds
    block[0], block[1 : 1 + n], block[1 + n : 1 + 2 * n] = n, src_ids, dst_ids
    want = [d.cpu().clone() for d in dst]
    reference.copy_blocks([s.cpu() for s in src], want, src_ids, dst_ids)
    kernels.BoundCopy(torch.device(device), src, dst).launch_from_block(None, block.to(device), capacity, errors)
    assert all(torch.equal(d.cpu(), w) for d, w in zip(dst, want))
    assert int(errors.item()) == 1
    # A gather: the packed side has no ids, so the block is [n, src ids].
    out = torch.randint(0, 256, (capacity, 112), dtype=torch.uint8, generator=gen).to(device)
    before = out.cpu().clone()
    gather = torch.cat([torch.tensor([3]), src_ids[:3], torch.full((capacity - 3,), -7)])
    kernels.BoundCopy(torch.device(device), src, None).launch_from_block(out, gather.to(device), capacity, errors)
    want_out = before.clone()
    reference.gather_blocks([s.cpu() for s in src], src_ids[:3], want_out)
    assert torch.equal(out.cpu(), want_out)


def test_launches_share_a_compiled_kernel_only_when_triton_would_compile_the_same_one():
    # After @jit's first launch of a specialisation, BoundCopy launches the kernel it returned
    # directly. Each way @jit would specialise differently must give another key, and ids that
    # differ only in values or address (both aligned) the same one.
    base = torch.randint(0, 100, (40,), dtype=torch.int64)
    small = base.to(torch.int32)
    packed = torch.zeros(64, dtype=torch.uint8)
    ints = (0, 16, 40, 40)

    def key(src=base[:8], dst=base[16:24], out=packed, values=ints, align=16, in_block=False):
        return kernels.specialisation(align, in_block, src, dst, out, values)

    same = key(src=base[24:32].clone(), dst=base[8:16].clone())
    assert key() == same
    others = [
        key(src=base[1:9]),  # 8 bytes in: not 16-byte aligned
        key(dst=base[17:25]),
        key(src=small[:8]),  # int32 ids
        key(dst=small[4:12]),  # int32 ids, 16 bytes in: aligned
        key(out=packed[4:]),  # a packed side 4 bytes in
        key(values=(0, 16, 40, 1 << 31)),  # one integer passed as i64
        key(values=(1 << 31, 16, 40, 40)),  # another one
        key(align=4),
        key(in_block=True),
    ]
    assert len({key(), *others}) == len(others) + 1
