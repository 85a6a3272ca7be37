"""kv_ops.cuda.host_memory.shared_host_buffer across two real processes (ranks), and an engine that
adopts a slab of it: each rank's stored blocks are visible to the other, a SIGKILL of either
rank leaves the survivor's view intact and nothing in /dev/shm, and a restart starts clean."""

import multiprocessing
import os
import signal
import warnings

import pytest
import torch

import kv_ops
from kv_ops.cuda.host_memory import shared_host_buffer

NUM_BLOCKS, WIDTH, ROWS = 16, 96, 12
SLAB = ROWS * WIDTH


def cache_of(rank: int, run: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (NUM_BLOCKS, WIDTH), dtype=torch.uint8, generator=torch.Generator().manual_seed(run * 10 + rank)
    )


def stored(rank: int, run: int) -> torch.Tensor:
    """What rank ``rank``'s slab holds after its store: rows 0..9 from blocks 3..12, zeros after."""
    slab = torch.zeros(ROWS, WIDTH, dtype=torch.uint8)
    slab[:10] = cache_of(rank, run)[3:13]
    return slab


def rank_main(rank: int, init: str, run: int, conn) -> None:
    import torch.distributed as dist

    warnings.simplefilter("ignore")  # no CUDA: the engine's page-locked memory is plain memory
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    shared = shared_host_buffer(2 * SLAB)
    fresh = int(shared.count_nonzero())
    dist.barrier()  # both have looked before either stores
    engine = kv_ops.OffloadEngine(
        {"kv": cache_of(rank, run)}, NUM_BLOCKS, SLAB, host_buffer=shared[rank * SLAB : (rank + 1) * SLAB]
    )
    engine.store(list(range(3, 13)), list(range(10)))
    engine.flush()
    dist.barrier()
    other = 1 - rank
    seen = shared[other * SLAB : (other + 1) * SLAB].view(ROWS, WIDTH)
    conn.send(("ready", fresh, torch.equal(seen, stored(other, run))))
    if conn.recv() == "check":  # the other rank is dead by now
        conn.send(
            (
                "checked",
                torch.equal(seen, stored(other, run)),
                engine.mirror.data_ptr() == shared.data_ptr() + rank * SLAB,
            )
        )
    engine.close()
    conn.send(("closed", torch.equal(shared[rank * SLAB : (rank + 1) * SLAB].view(ROWS, WIDTH), stored(rank, run))))
    os._exit(0)  # the peer is gone: no collective teardown


def start(tmp_path, run: int):
    ctx = multiprocessing.get_context("spawn")
    init = tmp_path / f"init{run}"
    ranks = []
    for rank in range(2):
        parent, child = ctx.Pipe()
        process = ctx.Process(target=rank_main, args=(rank, str(init), run, child), daemon=True)
        process.start()
        ranks.append((process, parent))
    return ranks


def shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("killed", [0, 1], ids=["the rank that made the memory", "the other rank"])
def test_two_ranks_share_one_buffer_and_a_sigkill_leaves_nothing_behind(tmp_path, killed):
    before = shm()
    for run in (0, 1):  # the second run is the restart after the SIGKILL
        ranks = start(tmp_path, run)
        for _, conn in ranks:
            assert conn.poll(120), "a rank did not come up"
            kind, fresh, sees_other = conn.recv()
            assert kind == "ready" and fresh == 0 and sees_other  # fresh memory, then the other's blocks
        assert shm() == before, "the shared buffer left a name in /dev/shm"
        victim, survivor = ranks[killed], ranks[1 - killed]
        os.kill(victim[0].pid, signal.SIGKILL)
        victim[0].join(30)
        assert victim[0].exitcode == -signal.SIGKILL
        survivor[1].send("check")
        kind, still_there, adopted = survivor[1].recv()
        assert kind == "checked" and still_there and adopted
        kind, own_kept = survivor[1].recv()
        assert kind == "closed" and own_kept  # close unregisters and drops, never frees or clears
        survivor[0].join(30)
        assert shm() == before


def test_bad_sizes_are_refused_before_any_collective():
    for nbytes in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=f"shared_host_buffer: nbytes must be a positive integer, got {nbytes!r}"):
            shared_host_buffer(nbytes)


@pytest.mark.parametrize(
    "buffer,message",
    [
        (torch.zeros(SLAB, dtype=torch.int8), "host_buffer must be uint8, got torch.int8"),
        (
            torch.zeros(SLAB - 1, dtype=torch.uint8),
            f"host_buffer holds {SLAB - 1} bytes, but the mirror of capacity_bytes needs {SLAB}",
        ),
        (torch.zeros(2, SLAB, dtype=torch.uint8).t(), r"host_buffer must be contiguous, got strides \(1, 1152\)"),
        (torch.zeros(SLAB, dtype=torch.uint8, device="meta"), "host_buffer must be host memory, got a tensor on meta"),
        (bytearray(SLAB), "host_buffer must be a CPU uint8 tensor, got bytearray"),
    ],
)
def test_a_bad_host_buffer_is_refused_naming_it_before_any_byte_moves(buffer, message):
    cache = cache_of(0, 0)
    kept = cache.clone()
    with pytest.raises(ValueError, match=f"OffloadEngine: {message}"):
        kv_ops.OffloadEngine({"kv": cache}, NUM_BLOCKS, SLAB, host_buffer=buffer)
    assert torch.equal(cache, kept)


def test_a_host_buffer_and_a_disk_tier_are_refused_together(tmp_path):
    with pytest.raises(ValueError, match="host_buffer holds the host mirror, but disk_dir was given"):
        kv_ops.OffloadEngine(
            {"kv": cache_of(0, 0)},
            NUM_BLOCKS,
            1 << 20,
            host_buffer=torch.zeros(SLAB, dtype=torch.uint8),
            disk_dir=str(tmp_path),
        )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["kernel", "staged", "dma"])
def test_an_adopted_buffer_is_registered_while_the_engine_lives_and_never_freed(path):
    buffer = shared_host_buffer_alone(SLAB + 100)
    assert not buffer.is_pinned()
    cache = cache_of(0, 0).cuda()
    engine = kv_ops.OffloadEngine({"kv": cache}, NUM_BLOCKS, SLAB, host_buffer=buffer, path=path)
    assert buffer.is_pinned() and engine.mirror.data_ptr() == buffer.data_ptr()
    engine.store(list(range(3, 13)), list(range(10)))
    engine.flush()
    engine.close()
    assert not buffer.is_pinned()
    assert torch.equal(buffer[:SLAB].view(ROWS, WIDTH), stored(0, 0))


def shared_host_buffer_alone(nbytes: int) -> torch.Tensor:
    """Host memory the test owns, from an mmap of its own (not page-locked)."""
    import mmap

    from kv_ops.cuda.host_memory import pin_mapping

    return pin_mapping(mmap.mmap(-1, nbytes), nbytes, register=False)
