"""The Triton prefix-copy kernel against kv_ops.reference.prefix_copy, byte for byte.

Without a GPU the kernel runs under TRITON_INTERPRET=1 on CPU tensors; with one, on the GPU with
page-locked host copies reached through their mapped addresses. Every tensor starts as fresh
random values, so a byte written where it should not be, or not written, shows.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_ops import reference
from kv_ops.cuda.host_memory import device_view, pinned_empty
from kv_ops.cuda.launch import TILE_BYTES
from kv_ops.prefix_copy import PrefixCopy

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def host_pair(shape_k, shape_v, dtype, gen):
    pair = []
    for shape in (shape_k, shape_v):
        t = pinned_empty(shape, dtype=dtype) if CUDA else torch.empty(shape, dtype=dtype)
        t.copy_(torch.randn(shape, generator=gen).to(dtype))
        pair.append(t)
    return tuple(pair)


def run_case(seed, batch, heads, max_len, k_dim, v_dim, dtype, length, out_length, out_saved, start=0):
    gen = torch.Generator().manual_seed(seed)
    shape_k, shape_v = (batch, heads, max_len, k_dim), (batch, heads, max_len, v_dim)
    slot = tuple(torch.randn(s, generator=gen).to(dtype) for s in (shape_k, shape_v))
    host, out = host_pair(shape_k, shape_v, dtype, gen), host_pair(shape_k, shape_v, dtype, gen)
    want_slot, want_host, want_out = ([t.clone() for t in pair] for pair in (slot, host, out))
    reference.prefix_copy(want_slot, want_host, length, want_out, out_length, out_saved, start)

    gpu_slot = tuple(t.to(DEVICE) for t in slot)
    views = (lambda p: tuple(device_view(t) for t in p)) if CUDA else (lambda p: p)
    counts = torch.zeros(5, dtype=torch.int64, device=DEVICE)
    copy = PrefixCopy(gpu_slot, views(host), counts[0], views(out), counts[1], counts[2], counts[3], start=counts[4])
    stream = torch.cuda.current_stream().cuda_stream if CUDA else 0
    copy(stream)  # all counts zero: moves nothing (and compiles; on a GPU later calls skip @jit)
    counts.copy_(torch.tensor([length, out_length, out_saved, -7, start]))  # read when the kernel runs
    copy(stream)
    if CUDA:
        torch.cuda.synchronize()
    for got, want in zip((*gpu_slot, *host, *out), (*want_slot, *want_host, *want_out)):
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
    # The target's saved count is its length, the positions below start included (the caller's).
    assert counts.tolist() == [length, out_length, out_saved, length, start]


def test_a_load_across_tiles_with_the_write_back_in_the_same_tile():
    # bf16, dim 128: 256 B per position, so a tile holds 128 positions; the evicted layer's new
    # position sits in the tile the load also writes, and the load crosses two tile boundaries.
    per_tile = TILE_BYTES // 256
    run_case(0, 2, 3, 4 * per_tile, 128, 128, torch.bfloat16, 2 * per_tile + 5, 2 * per_tile + 3, 2 * per_tile + 2)


def test_a_crop_below_the_saved_count_writes_nothing_back():
    run_case(1, 1, 2, 64, 16, 16, torch.float32, 40, 20, 30)


def test_nothing_to_load_still_writes_the_new_positions_back():
    run_case(2, 2, 1, 48, 8, 24, torch.float16, 0, 17, 0)


def test_a_start_leaves_the_positions_below_it_as_they_were_across_tiles():
    # The positions below start are the copy engine's (an eager step's): the kernel must not
    # write them, and must load the rest, from inside one tile to two tiles on.
    per_tile = TILE_BYTES // 256
    run_case(3, 2, 3, 4 * per_tile, 128, 128, torch.bfloat16, 3 * per_tile + 1, per_tile + 9, per_tile, per_tile + 3)


def test_a_start_past_the_length_loads_nothing_and_still_writes_back():
    run_case(4, 1, 2, 64, 16, 16, torch.float32, 20, 33, 21, 50)


@settings(max_examples=12 if CUDA else 6, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    batch=st.integers(1, 3),
    heads=st.integers(1, 3),
    max_len=st.integers(1, 300),
    dims=st.sampled_from([(16, 16), (8, 24), (64, 64), (128, 128), (3, 5)]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    fractions=st.tuples(st.floats(0, 1), st.floats(0, 1), st.floats(0, 1), st.floats(0, 1)),
)
def test_any_lengths_move_exactly_the_reference_bytes(seed, batch, heads, max_len, dims, dtype, fractions):
    length, out_length, out_saved, start = (int(f * max_len) for f in fractions)
    run_case(seed, batch, heads, max_len, *dims, dtype, length, out_length, out_saved, start)


def test_a_claimed_load_moves_its_bytes_once_until_another_layer_takes_the_slot():
    # The claim reads the slot's holder word: a second launch of the same load (queued ahead of a
    # step, then by the step) must move nothing, even with the host copy changed in between.
    gen = torch.Generator().manual_seed(5)
    shape = (2, 3, 64, 16)
    slot = tuple(torch.randn(shape, generator=gen).to(DEVICE) for _ in range(2))
    host, out = host_pair(shape, shape, torch.float32, gen), host_pair(shape, shape, torch.float32, gen)
    views = (lambda p: tuple(device_view(t) for t in p)) if CUDA else (lambda p: p)
    # length, evicted length, evicted saved, target saved, the slot's holder, the go word
    counts = torch.tensor([40, 12, 5, -7, -1, -3], dtype=torch.int64, device=DEVICE)
    claim = (counts[4], counts[5], 3)
    copy = PrefixCopy(slot, views(host), counts[0], views(out), counts[1], counts[2], counts[3], claim=claim)
    stream = torch.cuda.current_stream().cuda_stream if CUDA else 0
    want_slot, want_out = [t.clone() for t in slot], [t.clone() for t in out]
    reference.prefix_copy(want_slot, host, 40, want_out, 12, 5)

    def check(slot_want, out_want, saved, go):
        if CUDA:
            torch.cuda.synchronize()
        for got, want in zip((*slot, *out), (*slot_want, *out_want)):
            assert torch.equal(got.cpu(), want)
        assert counts.tolist() == [40, 12, 5, saved, 3, go]

    copy(stream)
    check([t.cpu() for t in want_slot], want_out, 40, 1)
    for t in host:  # what a second load would bring in, were it to move anything
        t.copy_(torch.randn(shape, generator=gen))
    copy(stream)
    check([t.cpu() for t in want_slot], want_out, 40, 0)
    counts[4] = 1  # another layer took the slot: the next load of layer 3 moves its bytes again
    copy(stream)
    reference.prefix_copy(want_slot, host, 40, want_out, 12, 5)
    check([t.cpu() for t in want_slot], want_out, 40, 1)


@pytest.mark.parametrize(("batch", "heads", "dim", "align"), [(1, 3, 16, 16), (1, 1, 2, 8), (3, 5, 1, 4)])
def test_the_alignment_is_the_addresses_and_byte_counts_not_the_row_count(batch, heads, dim, align):
    # A row count (batch x heads, odd at batch 1 with an odd head count) never enters an address
    # but through a row's bytes: it must not lower the accesses' width (float32: 4 B a value).
    pair = tuple(torch.empty(batch, heads, 64, dim) for _ in range(2))
    n = torch.zeros((), dtype=torch.int64)
    assert PrefixCopy(pair, pair, n, pair, n, n, n).constexprs["ALIGN"] == align


@pytest.mark.skipif(CUDA, reason="the refusal is of CPU tensors without the interpreter")
def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    t = (torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 4, 4))
    n = torch.zeros((), dtype=torch.int64)
    with pytest.raises(RuntimeError, match="runs on CPU tensors only under TRITON_INTERPRET=1"):
        PrefixCopy(t, t, n, t, n, n, n)(0)
