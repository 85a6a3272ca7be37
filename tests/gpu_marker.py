"""Shared by tests/ and compile_tests/ conftests: Triton's interpreter where no GPU exists (set
before any kernel module is imported), the `gpu` marker, whose tests skip without CUDA, and,
under a sanitizer, cells standing in for `path="auto"`'s measurement, SDPA's math attention under
racecheck and CUDA-graph trees' pool check off (it fails on transformers' own step there)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture(autouse=True, scope="session")
def stand_ins_under_a_sanitizer():
    """Under compute-sanitizer (``.ci/gpu`` sets ``KV_OPS_SANITIZER``), cells stand in for an auto
    engine's crossover measurement: its ~600 copies per engine shape took over 4 minutes under
    memcheck, longer than a test may run. The cells rate every path alike, so that auto takes
    the kernel path for a call alone and the staged path behind others, and both run. The
    sanitizers check memory accesses, not rates; the measurement's own tests are deselected there.
    """
    if not os.environ.get("KV_OPS_SANITIZER"):
        yield
        return
    from kv_ops.transfer import crossover
    from kv_ops.transfer.paths import PATH_NAMES

    def stand_in(device, widths, ring_bytes):
        cells = [
            crossover.Cell(path, direction, blocks, runs, 10.0, 10.0, 10.0)
            for direction in ("store", "load")
            for blocks in crossover.COUNTS
            for runs in sorted({blocks, max(1, blocks // crossover.RUN)})
            for path in PATH_NAMES
        ]
        return crossover.Crossover(crossover.shape_key(device, list(widths), ring_bytes), cells)

    # SDPA's fused attention kernels (cuDNN's, then the memory-efficient one once cuDNN's is off)
    # draw racecheck hazard reports from inside themselves by the tens of thousands, which is not
    # what is checked here: they drown the report and slowed racecheck over the transformers tests
    # past a whole device call. Racecheck's runs attend with SDPA's math kernels (memcheck's keep
    # the fused ones).
    fused = {
        torch.backends.cuda.enable_cudnn_sdp: torch.backends.cuda.cudnn_sdp_enabled(),
        torch.backends.cuda.enable_mem_efficient_sdp: torch.backends.cuda.mem_efficient_sdp_enabled(),
        torch.backends.cuda.enable_flash_sdp: torch.backends.cuda.flash_sdp_enabled(),
    }
    if os.environ["KV_OPS_SANITIZER"] == "racecheck":
        for enable in fused:
            enable(False)
    # Under memcheck, CUDA-graph trees' check of their memory pool fails in transformers' own
    # StaticCache step, compiled with CUDA graphs, before any kv_ops op exists in the test: 43
    # blocks that Inductor's warm-up allocated and no output holds (the same step passes the check
    # without the sanitizer). The check guards the trees' bookkeeping, not memory accesses, which
    # memcheck itself checks: it is off under a sanitizer, and on in every unsanitized run.
    import torch._inductor.config as inductor_config

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(crossover, "measured_once", stand_in)
        patch.setattr(inductor_config.triton, "slow_path_cudagraph_asserts", False)
        yield
    for enable, was in fused.items():
        enable(was)
