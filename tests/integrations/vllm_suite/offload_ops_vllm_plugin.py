"""pytest plugin that runs vLLM's own KV-offloading tests against kv_ops.integrations.vllm.

.ci/run extracts ``tests/v1/kv_offload/`` and ``tests/v1/kv_connector/unit/offloading_connector/``
from each supported vLLM release's sdist (fetch.py) and runs them with ``-p
offload_ops_vllm_plugin``, on that release's vLLM (a release other than the installed one on its
own Python sources, fetch.py ``--sources``). The plugin points vLLM's spec, worker and manager at
ours, the way a user's ``spec_name`` / ``spec_module_path`` would:

- vLLM's spec registry answers ``"CPUOffloadingSpec"`` with :class:`OffloadOpsSpec`, and a test
  module's own ``CPUOffloadingSpec`` name is that class too (``isinstance`` checks then hold
  only for ours, ``is`` checks compare ours with ours).
- ``CPUOffloadingWorker(...)`` in a test builds an :class:`OffloadOpsWorker`, with read-only
  views that stand for the internals vLLM's transfer tests read: ``_store_handler`` /
  ``_load_handler`` with their ``src_tensors`` / ``dst_tensors`` (the GPU tensors and our host
  mirror's columns), ``layer_refs_per_group`` and ``_transfers`` (the jobs not yet reported).
- ``make_cpu_manager(...)`` (test_manager.py) builds the manager through
  ``OffloadOpsSpec.get_manager()``, sized to the chunks asked for.
- Where a test builds vLLM's model config for ``facebook/opt-125m``, the hub is a cache written
  at start with that model's ``config.json`` alone (transformers' ``OPTConfig`` defaults are
  opt-125m's), and ``HF_HUB_OFFLINE=1``: no weights, no network.

:data:`NOT_APPLICABLE` lists, in this one place, every test that cannot apply and why; they are
skipped with that reason (a whole file without being imported). :data:`VLLM_FAILS_ON_ITS_CPU_PLATFORM`
(vLLM's, per release, with no spec of ours involved) are strict xfails on vLLM's CPU platform: each
turns into a failure the day it passes. Every other test must pass.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

import pytest

# (node id prefix, parameters that must all match or None, reason). A prefix ending in "/" is a
# folder; a whole file or folder is skipped without being imported.
NOT_APPLICABLE: list[tuple[str, dict | None, str]] = [
    (
        "tests/v1/kv_offload/tiering/",
        None,
        "vLLM's TieringOffloadingSpec and its secondary tiers (fs, obj, kvcr, p2p): a spec of its own "
        "that builds vLLM's CPUOffloadingWorker itself; no configuration reaches OffloadOpsSpec",
    ),
    (
        "tests/v1/kv_offload/cpu/test_shared_offload_region.py",
        None,
        "vLLM's own SharedOffloadRegion class (a named /dev/shm file of per-chunk rank slots); "
        "OffloadOpsSpec shares host memory its own way, one slab per rank of a nameless memfd "
        "mapping (kv_ops.cuda.host_memory.shared_host_buffer, tests/kv_ops/test_shared_host_buffer.py)",
    ),
    (
        "tests/v1/kv_offload/cpu/test_canonical_layout.py",
        None,
        "the canonical (parallelism-free) host layout: OffloadOpsSpec refuses canonical_layout; the "
        "file's CPU tests call vLLM's private gpu_worker helpers (_build_copy_plan, "
        "_canonical_block_sizes, _canonical_page_ids), its worker tests need CUDA and vLLM's "
        "SharedOffloadRegion canonical views",
    ),
    (
        "tests/v1/kv_offload/cpu/test_swap_blocks_batch.py",
        None,
        "vLLM's own copy kernels (ops.swap_blocks_batch), which OffloadOpsWorker does not use",
    ),
    (
        "tests/v1/kv_offload/cpu/test_swap_blocks_triton.py",
        None,
        "vLLM's own copy kernels (its Triton swap_blocks_batch), which OffloadOpsWorker does not use",
    ),
    *(
        (
            f"tests/v1/kv_offload/cpu/test_gpu_worker.py::{name}",
            None,
            "internals of vLLM's CPUOffloadingWorker (its per-direction handlers, their shutdown "
            "order, its choice of copy kernel), built with __new__ and mocks, not through its interface",
        )
        for name in (
            "test_rocm_cpu_to_gpu_uses_dma",
            "test_unpinned_cpu_to_gpu_uses_dma",
            "test_worker_shutdown_releases_region_and_runs_both_handlers",
            "test_worker_logs_handler_error_and_cleans_region",
            "test_handler_shutdown_skips_transfers_after_event_sync_failure",
            "test_worker_syncs_before_cleanup_after_handler_failure",
        )
    ),
    *(
        (
            f"tests/v1/kv_offload/test_factory.py::{name}",
            None,
            "what vLLM's CPU spec passes its own CPUOffloadingWorker (mocked there: shared region or "
            "not, rank slot); OffloadOpsSpec.create_worker builds an OffloadOpsWorker instead",
        )
        for name in (
            "test_cpu_spec_create_worker_uses_mmap_on_cuda",
            "test_cpu_spec_create_worker_uses_tensor_path_without_shared_region",
            "test_cpu_spec_create_worker_skips_mmap_for_empty_cache",
            "test_cpu_spec_create_worker_rank_assignment",
        )
    ),
    (
        "tests/v1/kv_offload/test_factory.py::test_dynamic_load_via_spec_module_path",
        None,
        "loads vLLM's own CPUOffloadingSpec by its module path; here the registry's name points at "
        "ours instead (tests/integrations/test_vllm.py loads ours by its module path)",
    ),
    (
        "tests/v1/kv_offload/cpu/test_gpu_worker.py::test_transfer[",
        {"use_shared_memory": True},
        "a worker handed vLLM's SharedOffloadRegion object (mmap_region=, with and without the "
        "replicated layout), whose rank slots are strided per chunk; OffloadOpsSpec shares its own "
        "memfd mapping, one contiguous slab per rank (tests/kv_ops/test_shared_host_buffer.py)",
    ),
    (
        "tests/v1/kv_offload/cpu/test_manager.py::test_cpu_manager_reports_no_config_info_without_info",
        None,
        "a CPUOffloadingManager built without the spec's config info (vLLM 0.33); here make_cpu_manager "
        "builds it through OffloadOpsSpec.get_manager, which passes the info as vLLM's CPU spec does "
        "(test_factory.py's config-info tests check what it publishes)",
    ),
]

# Per vLLM release: vLLM's connector scheduler driven through its RequestRunner with vLLM's
# MockOffloadingSpec (mock manager and worker: no spec of ours takes part, and this plugin changes
# nothing these tests use but the hub's config), with async scheduling, on vLLM's CPU platform;
# their synchronous twins pass. In 0.32 each trips AsyncScheduler's placeholder check
# (vllm/v1/core/sched/async_scheduler.py, ``assert request.num_output_placeholders >= 0``); 0.33
# removed that check, and the ones left fail the runner's own asserts on the transfers it expects.
# Strict: the day vLLM's CPU platform passes them, the list must shrink.
_SCHEDULER_TESTS = "tests/v1/kv_connector/unit/offloading_connector/test_scheduler.py::"
VLLM_FAILS_ON_ITS_CPU_PLATFORM = {
    "0.32.0": (
        "test_final_sampled_token_does_not_complete_an_offloaded_block[-1-True]",
        "test_final_sampled_token_does_not_complete_an_offloaded_block[-2-True]",
        "test_offloading_connector[True]",
        "test_request_preemption[True]",
        "test_on_request_finished_not_deferred_until_store_completion[True]",
        "test_on_request_finished_fires_after_final_block_store[True]",
        "test_concurrent_lookups_of_the_same_prefix[True]",
        "test_abort_loading_requests[True]",
        "test_two_groups_full_and_sliding_window[True]",
        "test_two_groups_different_block_sizes[True]",
        "test_request_level_policy_stores_all_blocks[True]",
        "test_complete_store_called_per_job[True]",
        "test_complete_store_waits_for_all_worker_acks[True]",
        "test_max_offload_tokens_validation[True]",
        "test_offload_prompt_only[True]",
        "test_reset_cache[True]",
        "test_reset_cache_finalizes_finished_request_with_pending_store[True]",
        "test_async_preempt_readmit_before_transfer_output_is_deferred",
        "test_swa_alignment_skip[True-0]",
        "test_swa_alignment_skip[True-1]",
        "test_swa_alignment_skip[True-3]",
        "test_stale_sliding_window_block_after_prepare_store_failure[True]",
        "test_skip_reading_prefix_cache[True]",
        "test_max_load_tokens_limits_external_load[True]",
        "TestEagle::test_full_attn_store_excludes_trailing_decode_block[True]",
        "TestEagle::test_sw_store_excludes_trailing_decode_block[True]",
        "TestEagle::test_single_block_stored_at_end_of_prefill[True]",
        "TestEagle::test_multichunk_store_no_interior_holes[True]",
        "TestEagle::test_full_attn_store_then_load[True]",
        "test_retention_interval_sparsifies_swa_stores[True]",
        "test_retention_interval_zero_stores_only_replay_boundary[True]",
        "TestSharedGroupMTPOffload::test_no_annotation_marks_no_groups",
    ),
    "0.33.0": (
        "test_offloading_connector[True]",
        "test_streaming_session_stores_new_chunks[True]",
        "test_request_preemption[True-True]",
        "test_request_preemption[False-True]",
        "test_on_request_finished_not_deferred_until_store_completion[True]",
        "test_two_groups_full_and_sliding_window[True]",
        "test_two_groups_different_block_sizes[True]",
        "test_complete_store_called_per_job[True]",
        "test_async_preempt_readmit_before_transfer_output_is_deferred",
        "test_stale_sliding_window_block_after_prepare_store_failure[True]",
        "TestEagle::test_full_attn_store_excludes_trailing_decode_block[True]",
        "TestEagle::test_sw_store_excludes_trailing_decode_block[True]",
    ),
}


def _not_applicable(nodeid: str, params: dict | None) -> str | None:
    """Why the test ``nodeid`` with call parameters ``params`` cannot apply, or None; ``params``
    None: ``nodeid`` is a whole file, which only an entry without parameters skips."""
    for prefix, match, reason in NOT_APPLICABLE:
        if not nodeid.startswith(prefix):
            continue
        if match is not None and (params is None or any(params.get(k) != v for k, v in match.items())):
            continue
        return reason
    return None


class _NotApplicableFile(pytest.Module):
    """A test file that :data:`NOT_APPLICABLE` skips whole: one skip, and never imported (it may
    import what the installed vLLM lacks)."""

    reason = ""

    def collect(self):
        # A skip raised while collecting is reported where it is raised, here: name the file.
        pytest.skip(f"not applicable: {self.nodeid}: {self.reason}")


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path, parent):
    reason = _not_applicable(module_path.relative_to(parent.config.rootpath).as_posix(), None)
    if reason is None:
        return None
    module = _NotApplicableFile.from_parent(parent, path=module_path)
    module.reason = reason
    return module


_hub: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _hub
    for marker in ("cpu_test", "skip_global_cleanup", "slow_test", "optional", "distributed"):
        config.addinivalue_line("markers", f"{marker}: a marker of vLLM's test suite")
    # For any subprocess, and set on huggingface_hub's constants as well: it reads the variables
    # once, at its import, which may already have happened.
    _hub = tempfile.mkdtemp(prefix="offload-ops-hub-")
    os.environ["HF_HUB_CACHE"] = _hub
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import huggingface_hub.constants
    from transformers import OPTConfig

    huggingface_hub.constants.HF_HUB_CACHE = _hub
    huggingface_hub.constants.HF_HUB_OFFLINE = True

    revision = "0" * 40
    repo = os.path.join(_hub, "models--facebook--opt-125m")
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(revision)
    OPTConfig(torch_dtype="float16").save_pretrained(os.path.join(repo, "snapshots", revision))

    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    import kv_ops.integrations.vllm as ours

    # What a user's {"spec_name": "OffloadOpsSpec", "spec_module_path": "kv_ops.integrations.vllm"}
    # loads, under the name vLLM's tests ask for.
    OffloadingSpecFactory._registry["CPUOffloadingSpec"] = lambda: ours.OffloadOpsSpec


def pytest_unconfigure(config: pytest.Config) -> None:
    if _hub is not None:
        shutil.rmtree(_hub, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from vllm.platforms import current_platform

    import kv_ops.integrations.vllm as ours

    on_cpu = current_platform.is_cpu()  # the xfails are its CPU platform's, not CUDA's
    fails = VLLM_FAILS_ON_ITS_CPU_PLATFORM.get(ours.installed_vllm_version().split("+")[0], ())
    reason = (
        "vLLM's own scheduler test with its mock spec, async scheduling on vLLM's CPU platform "
        "(VLLM_FAILS_ON_ITS_CPU_PLATFORM; no spec of ours involved)"
    )
    for item in items:
        callspec = getattr(item, "callspec", None)
        reason = _not_applicable(item.nodeid, callspec.params if callspec is not None else {})
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"not applicable: {reason}"))
        if on_cpu and item.nodeid.startswith(_SCHEDULER_TESTS) and item.nodeid[len(_SCHEDULER_TESTS) :] in fails:
            item.add_marker(pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason))


@pytest.fixture
def default_vllm_config():
    """vLLM's default VllmConfig made current (what vLLM's root conftest gives these tests)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config


@dataclass
class _Job:
    job_id: int


class _Handler:
    """What vLLM's transfer tests read of one direction of its worker, over ours."""

    def __init__(self, worker, src_tensors, dst_tensors, kind: str):
        self._worker = worker
        self._kind = kind
        self.src_tensors = src_tensors
        self.dst_tensors = dst_tensors
        self.layer_refs_per_group = worker.layer_refs_per_group

    @property
    def _transfers(self) -> list[_Job]:
        return [_Job(job_id) for job_id, kind in self._worker.job_kinds.items() if kind == self._kind]


def _worker_factory():
    import torch

    import kv_ops.integrations.vllm as ours

    class VllmShapedWorker(ours.OffloadOpsWorker):
        def __init__(self, kv_caches, blocks_per_chunk, num_cpu_chunks, mmap_region=None, canonical_layout=False):
            assert mmap_region is None and not canonical_layout, "listed as not applicable in the plugin"
            super().__init__(kv_caches, blocks_per_chunk, num_cpu_chunks)
            self.layer_refs_per_group = kv_caches.group_data_refs
            self.job_kinds: dict[int, str] = {}
            gpu = [t.tensor.view(torch.int8).view(-1, t.page_size_bytes) for t in kv_caches.tensors]
            host = [self.engine.mirror_regions[f"t{i}"].view(torch.int8) for i in range(len(gpu))]
            self._store_handler = _Handler(self, gpu, host, "store")
            self._load_handler = _Handler(self, host, gpu, "load")

        def submit_store(self, job_id, src_spec, dst_spec):
            self.job_kinds[job_id] = "store"
            return super().submit_store(job_id, src_spec, dst_spec)

        def submit_load(self, job_id, src_spec, dst_spec, expedited=False):
            self.job_kinds[job_id] = "load"
            return super().submit_load(job_id, src_spec, dst_spec, expedited)

        def get_finished(self):
            results = super().get_finished()
            for result in results:
                self.job_kinds.pop(result.job_id, None)
            return results

    return VllmShapedWorker


def _manager_factory():
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    import kv_ops.integrations.vllm as ours

    def make_cpu_manager(
        num_chunks=4,
        cache_policy="lru",
        cache_policy_module_path=None,
        enable_events=False,
        store_threshold=0,
        max_tracker_size=64_000,
    ):
        # One chunk of exactly the alignment per num_chunks: the spec sizes the manager to num_chunks.
        chunk = ours.OffloadOpsSpec.BLOCK_SIZE_ALIGNMENT
        extra = {
            "spec_name": "OffloadOpsSpec",
            "spec_module_path": "kv_ops.integrations.vllm",
            "cpu_bytes_to_use": max(num_chunks, 1) * chunk,
            "eviction_policy": cache_policy,
            "store_threshold": store_threshold,
            "max_tracker_size": max_tracker_size,
        }
        if cache_policy_module_path is not None:
            extra["cache_policy_module_path"] = cache_policy_module_path
        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layer",), group_id=0),),
            worker_kv_bytes_per_block=chunk if num_chunks else 0,
            enable_kv_cache_events=enable_events,
            extra_config=extra,
            engine_id="offload-ops",
            model=OffloadingModelConfig(name="offload-ops", dtype="float16"),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
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
        spec = ours.OffloadOpsSpec(config)
        assert spec.num_chunks == num_chunks, (spec.num_chunks, num_chunks)
        manager = spec.get_manager()
        assert isinstance(manager, CPUOffloadingManager)
        return manager

    return make_cpu_manager


@pytest.fixture(autouse=True)
def _offload_ops_in_place_of_vllm_cpu(request, monkeypatch):
    """Rebind the names a vLLM test module uses for the CPU spec, worker and manager to ours."""
    module = getattr(request, "module", None)
    if module is None:
        return
    if hasattr(module, "CPUOffloadingSpec"):
        import kv_ops.integrations.vllm as ours

        monkeypatch.setattr(module, "CPUOffloadingSpec", ours.OffloadOpsSpec)
    if hasattr(module, "CPUOffloadingWorker"):
        monkeypatch.setattr(module, "CPUOffloadingWorker", _worker_factory())
    if hasattr(module, "make_cpu_manager"):
        monkeypatch.setattr(module, "make_cpu_manager", _manager_factory())
