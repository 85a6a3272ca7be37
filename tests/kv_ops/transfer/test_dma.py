"""The copy-engine plans: against the reference, run merging, the driver calls.

On the CPU a plan is executed by ``kv_ops.dma.run_on_host`` with ``ctypes.memmove``, copy by
copy, exactly as the copy engines would execute it: that checks every address and size the
driver would be handed. On the GPU the same plans go through ``cuMemcpyBatchAsync``. (What
``path="auto"`` measures and picks is tested in test_crossover.py.)
"""

import numpy as np
import pytest
import torch
from byte_checks import assert_same_storages, clone_views, host_regions, make_regions
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_ops import reference
from kv_ops.transfer import dma

gpu = pytest.mark.gpu


def random_pairs(gen, n, src_blocks, dst_blocks, runs: bool):
    """n (src, dst) id pairs, dst ids distinct; with ``runs``, in stretches of consecutive ids."""
    if not runs:
        return torch.randint(0, src_blocks, (n,), generator=gen), torch.randperm(dst_blocks, generator=gen)[:n]
    src_start = int(torch.randint(0, src_blocks - n + 1, (1,), generator=gen))
    dst_start = int(torch.randint(0, dst_blocks - n + 1, (1,), generator=gen))
    src, dst = torch.arange(src_start, src_start + n), torch.arange(dst_start, dst_start + n)
    cut = int(torch.randint(0, max(n, 1), (1,), generator=gen))  # one break: two runs on the source side
    src[cut:] = torch.roll(src[cut:], 1)
    return src, dst


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    widths=st.lists(st.sampled_from([16, 80, 256, 1024]), min_size=1, max_size=3),
    n=st.integers(0, 12),
    src_strided=st.booleans(),
    dst_strided=st.booleans(),
    runs=st.booleans(),
)
def test_a_plan_copies_exactly_the_chosen_blocks_and_nothing_else(seed, widths, n, src_strided, dst_strided, runs):
    gen = torch.Generator().manual_seed(seed)
    src = make_regions(widths, 16, strided=src_strided, generator=gen)
    dst = make_regions(widths, 14, strided=dst_strided, generator=gen)  # random bytes: the poison
    src_ids, dst_ids = random_pairs(gen, n, 16, 14, runs)
    want = clone_views(dst)
    reference.copy_blocks(src, want, src_ids, dst_ids)
    plan = dma.plan_copies(src, dst, src_ids, dst_ids)
    dma.run_on_host(plan)
    assert_same_storages(dst, want)  # gaps between strided blocks included
    if n:
        # What the engine uses: the runs found once, and the copy count it decides by.
        runs = dma.run_starts(src_ids, dst_ids)
        again = dma.plan_copies(src, dst, src_ids, dst_ids, runs)
        assert all(
            np.array_equal(a, b)
            for a, b in zip((plan.dsts, plan.srcs, plan.sizes), (again.dsts, again.srcs, again.sizes))
        )
        assert dma.count_copies(src, dst, n, runs) == plan.count


@settings(max_examples=200, deadline=None)
@given(
    pairs=st.lists(
        st.tuples(
            st.one_of(st.integers(0, 40), st.integers(2**31 - 40, 2**31 - 1)),
            st.one_of(st.integers(0, 40), st.integers(2**31 - 40, 2**31 - 1)),
        ),
        max_size=40,
    ),
    runs_from=st.integers(0, 40),
)
def test_count_runs_counts_the_runs_that_run_starts_finds(pairs, runs_from):
    # Some pairs made consecutive on purpose (runs), ids from both ends of [0, 2**31): the packed
    # word must not mistake a step of the high id for one of the low id, or a wrap for a step.
    for i in range(runs_from, len(pairs) - 1):
        if (i - runs_from) % 3 != 2:
            a, b = pairs[i]
            pairs[i + 1] = (min(a + 1, 2**31 - 1), min(b + 1, 2**31 - 1))
    src = np.array([a for a, _ in pairs], dtype=np.int64)
    dst = np.array([b for _, b in pairs], dtype=np.int64)
    starts, _ = dma.run_starts(src, dst)
    assert dma.count_runs(src, dst) == starts.size


@pytest.mark.parametrize(
    "strided, copies_per_region",
    [
        pytest.param(False, 3, id="back-to-back-blocks-merge-runs"),
        pytest.param(True, 7, id="strided-blocks-copy-one-by-one"),
    ],
)
def test_runs_of_consecutive_ids_become_one_copy_only_where_blocks_are_back_to_back(strided, copies_per_region):
    src = make_regions([64, 32], 20, strided=strided)
    dst = make_regions([64, 32], 20, strided=strided)
    src_ids = torch.tensor([2, 3, 4, 9, 10, 0, 1])  # runs: 2..4 -> 5..7, 9..10 -> 0..1, 0..1 -> 12..13
    dst_ids = torch.tensor([5, 6, 7, 0, 1, 12, 13])
    plan = dma.plan_copies(src, dst, src_ids, dst_ids)
    assert plan.count == 2 * copies_per_region
    if not strided:
        assert plan.sizes.tolist() == [3 * 64, 2 * 64, 2 * 64, 3 * 32, 2 * 32, 2 * 32]


@pytest.mark.parametrize(
    "src_ids, dst_ids, message",
    [
        pytest.param([0, 20], [0, 1], r"kv_ops.dma: src_ids\[1\] = 20 is outside \[0, 20\)", id="src-too-large"),
        pytest.param([0, 1], [-1, 1], r"kv_ops.dma: dst_ids\[0\] = -1 is outside \[0, 12\)", id="dst-negative"),
        pytest.param([0, 1], [0], "equal length", id="length-mismatch"),
    ],
)
def test_ids_outside_a_region_are_refused_before_any_address_is_made(src_ids, dst_ids, message):
    src, dst = make_regions([48], 20), make_regions([48], 12)
    with pytest.raises(ValueError, match=message):
        dma.plan_copies(src, dst, torch.tensor(src_ids), torch.tensor(dst_ids))


def test_mismatched_block_sizes_are_refused():
    with pytest.raises(ValueError, match=r"kv_ops.dma: region pair 0 has block sizes 48 \(src\) and 32 \(dst\)"):
        dma.plan_copies(make_regions([48], 4), make_regions([32], 4), torch.tensor([0]), torch.tensor([0]))


# --- on the GPU ----------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("direction", ["gpu-to-host", "host-to-gpu"])
@pytest.mark.parametrize("runs", [False, True], ids=["random-ids", "runs"])
def test_batched_copies_match_the_reference(direction, runs):
    assert dma.has_batched_copy()  # driver 580 / CUDA 13 has it: the batched call is what runs here
    gen = torch.Generator().manual_seed(7)
    widths = [4096, 1024, 80]
    gpu_regions = make_regions(widths, 40, "cuda", strided=True, generator=gen)
    host = host_regions(widths, 40, gen)
    src, dst = (gpu_regions, host) if direction == "gpu-to-host" else (host, gpu_regions)
    src_ids, dst_ids = random_pairs(gen, 17, 40, 40, runs)
    want = clone_views(dst)
    reference.copy_blocks([s.cpu() for s in src], want, src_ids, dst_ids)
    stream = torch.cuda.Stream()
    dma.enqueue_copies(src, dst, src_ids, dst_ids, stream)
    stream.synchronize()
    assert_same_storages(dst, want)


@gpu
def test_the_dma_path_refuses_capture_and_the_legacy_stream_before_enqueueing():
    src = make_regions([256], 8, "cuda")
    dst = host_regions([256], 8)
    before = dst[0].clone()
    plan = dma.plan_copies(src, dst, torch.arange(4), torch.arange(4))
    with pytest.raises(ValueError, match="legacy default stream"):
        dma.launch(plan, torch.cuda.default_stream())
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with pytest.raises(RuntimeError, match="cannot be captured"):
        with torch.cuda.graph(graph, stream=stream):
            dma.launch(plan, stream)
    torch.cuda.synchronize()
    assert torch.equal(dst[0], before)


@gpu
def test_a_bound_2d_copy_moves_each_rows_first_width_bytes_at_every_width_it_is_given():
    from kv_ops.cuda.host_memory import device_view, pinned_empty

    gen = torch.Generator().manual_seed(11)
    rows, row_bytes = 24, 4096
    host = pinned_empty((rows, row_bytes), dtype=torch.uint8)
    host.copy_(torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, generator=gen))
    view = device_view(host, torch.device("cuda", 0))
    stream = torch.cuda.Stream()
    slot = torch.full((rows, 2 * row_bytes), 0xA5, dtype=torch.uint8, device="cuda")  # poison; pitch of its own
    copy = dma.Launcher(stream).bind_2d(
        dma.Copy2D(slot.data_ptr(), slot.stride(0), view.data_ptr(), host.stride(0), 0, rows)
    )
    for width in (512, 4096, 128, 2048):  # grows and shrinks: each call copies its own width
        slot.fill_(0xA5)
        torch.cuda.current_stream().synchronize()
        copy(width)
        stream.synchronize()
        want = torch.full((rows, 2 * row_bytes), 0xA5, dtype=torch.uint8)
        want[:, :width] = host[:, :width]
        assert torch.equal(slot.cpu(), want), width
