"""Block copies captured into a real torch.cuda.CUDAGraph and replayed with new ids.

Replaying must move the blocks named by whatever the id tensors hold at replay time, between
GPU memory and page-locked host memory, and skip-and-count ids that went bad after capture.
"""

import pytest
import torch
from byte_checks import assert_same_storages, clone_views, host_regions, make_regions, random_bytes

import kv_ops
from kv_ops import reference

pytestmark = pytest.mark.gpu

WIDTHS = [4096, 512, 96]


def test_captured_store_and_load_replay_with_new_ids():
    gen = torch.Generator().manual_seed(0)
    cache = make_regions(WIDTHS, 64, "cuda", strided=True, generator=gen)
    host = host_regions(WIDTHS, 48, gen)
    ids = [torch.zeros(8, dtype=torch.int64, device="cuda") for _ in range(4)]  # static id tensors

    def step():
        kv_ops.copy_blocks(cache, host, ids[0], ids[1])  # store
        kv_ops.copy_blocks(host, cache, ids[2], ids[3])  # load

    ids[1].copy_(torch.arange(8))
    ids[3].copy_(torch.arange(8, 16))
    step()  # warm-up: compiles the kernel, builds the region tables and the error counter
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for _ in range(5):
        for c in cache:
            c.copy_(random_bytes(c.shape, "cuda", gen))
        store_src, store_dst = torch.randperm(64, generator=gen)[:8], torch.randperm(48, generator=gen)[:8]
        # Load back four of the slots just stored (order inside the graph matters) and four others.
        others = [b for b in torch.randperm(48, generator=gen).tolist() if b not in store_dst[:4]][:4]
        load_src = torch.cat([store_dst[:4], torch.tensor(others)])
        load_dst = torch.tensor([b for b in torch.randperm(64, generator=gen).tolist() if b not in store_src][:8])
        new = [store_src, store_dst, load_src, load_dst]
        both = clone_views(cache + host)
        reference.copy_blocks(both[:3], both[3:], store_src, store_dst)
        reference.copy_blocks(both[3:], both[:3], load_src, load_dst)
        for static, fresh in zip(ids, new):
            static.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert_same_storages(cache + host, both)


def test_captured_gather_to_host_and_scatter_from_host():
    gen = torch.Generator().manual_seed(1)
    cache = make_regions(WIDTHS, 40, "cuda", strided=True, generator=gen)
    staging = kv_ops.pinned_empty((6, sum(WIDTHS)))
    ids_out = torch.arange(6, device="cuda")
    ids_in = torch.arange(6, 12, device="cuda")

    def step():
        kv_ops.gather_blocks(cache, ids_out, staging)
        kv_ops.scatter_blocks(staging, ids_in, cache)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for _ in range(4):
        staging.copy_(random_bytes(staging.shape, generator=gen))
        for c in cache:
            c.copy_(random_bytes(c.shape, "cuda", gen))
        perm = torch.randperm(40, generator=gen)
        out_ids, in_ids = perm[:6], perm[6:12]
        want_cache = clone_views(cache)
        (want_staging,) = clone_views([staging])
        reference.gather_blocks(want_cache, out_ids, want_staging)
        reference.scatter_blocks(want_staging, in_ids, want_cache)
        ids_out.copy_(out_ids)
        ids_in.copy_(in_ids)
        graph.replay()
        torch.cuda.synchronize()
        assert_same_storages([staging], [want_staging])
        assert_same_storages(cache, want_cache)


def test_ids_that_go_bad_after_capture_are_skipped_and_counted():
    gen = torch.Generator().manual_seed(2)
    cache = make_regions(WIDTHS, 16, "cuda", strided=True, generator=gen)
    host = host_regions(WIDTHS, 10, gen)
    src = torch.arange(4, device="cuda")
    dst = torch.arange(4, device="cuda")
    kv_ops.copy_blocks(cache, host, src, dst)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kv_ops.copy_blocks(cache, host, src, dst)

    bad_src, bad_dst = torch.tensor([1, 16, 2, -5]), torch.tensor([10, 3, 9, 0])  # pairs 0, 1, 3 invalid
    want = clone_views(host)
    skipped = reference.copy_blocks(cache, want, bad_src, bad_dst)
    kv_ops.reset_error_count("cuda")
    src.copy_(bad_src)
    dst.copy_(bad_dst)
    graph.replay()
    torch.cuda.synchronize()
    assert skipped == 3
    assert kv_ops.error_count("cuda") == 3
    assert_same_storages(host, want)  # only pair 2 moved; nothing outside a region changed


def test_regions_first_seen_during_capture_get_a_clear_error():
    cache = make_regions([128], 8, "cuda")
    other = make_regions([128], 8, "cuda")
    ids = torch.arange(2, device="cuda")
    kv_ops.error_counter("cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="first seen during CUDA graph capture"):
        with torch.cuda.graph(graph):
            kv_ops.copy_blocks(cache, other, ids, ids + 2)
