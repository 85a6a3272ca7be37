"""kv_pair: keys and values in one allocation, as two storages; engine_positions: which eager loads the copy engine takes."""

from __future__ import annotations

import functools
import gc

import pytest
import torch

from kv_ops.transfer.slot_engines import FROM_BYTES, engine_positions, kv_pair

make = functools.partial(torch.empty, device="cpu")


def test_keys_and_values_of_one_shape_lie_back_to_back_each_a_storage_of_its_own():
    shape = (2, 3, 40, 16)
    keys, values = kv_pair(make, shape, torch.bfloat16, shape, torch.bfloat16)
    assert keys.shape == values.shape == shape and keys.dtype == values.dtype == torch.bfloat16
    assert keys.is_contiguous() and values.is_contiguous()
    assert values.data_ptr() == keys.data_ptr() + keys.numel() * keys.element_size()  # one copy moves both
    # Two storages: a compiled step takes them as two inputs, not as aliases of one base.
    assert keys.untyped_storage().data_ptr() != values.untyped_storage().data_ptr()
    assert keys.untyped_storage().nbytes() == values.untyped_storage().nbytes() == keys.numel() * 2


def test_the_halves_keep_their_allocation_alive_and_are_written_apart():
    shape = (1, 2, 33, 8)
    keys, values = kv_pair(make, shape, torch.float32, shape, torch.float32)
    gc.collect()  # nothing but the halves holds the allocation now
    gen = torch.Generator().manual_seed(3)
    want_k, want_v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    keys.copy_(want_k)
    values.copy_(want_v)
    assert torch.equal(keys, want_k)  # the values' write stopped at their own first byte
    del keys
    gc.collect()
    assert torch.equal(values, want_v)  # the keys' half going away leaves the values' bytes alone


@pytest.mark.parametrize(
    "k_shape, k_dtype, v_shape, v_dtype",
    [
        ((2, 4, 64, 192), torch.bfloat16, (2, 4, 64, 128), torch.bfloat16),  # another head dim for values
        ((2, 4, 64, 128), torch.bfloat16, (2, 4, 64, 128), torch.float16),  # another dtype
    ],
)
def test_keys_and_values_that_differ_get_an_allocation_each(k_shape, k_dtype, v_shape, v_dtype):
    made = []

    def counted(shape, dtype):
        made.append((tuple(shape), dtype))
        return torch.empty(shape, dtype=dtype)

    keys, values = kv_pair(counted, k_shape, k_dtype, v_shape, v_dtype)
    assert made == [(k_shape, k_dtype), (v_shape, v_dtype)]
    assert (keys.shape, keys.dtype, values.shape, values.dtype) == (k_shape, k_dtype, v_shape, v_dtype)


def test_an_eager_step_takes_the_copy_engine_from_from_bytes_of_known_positions_on():
    assert engine_positions(0, 4096) == 0  # a prefill: nothing on the host yet
    n = FROM_BYTES // 4096
    assert engine_positions(n - 1, 4096) == 0 and engine_positions(n, 4096) == n
    assert engine_positions(5 * n, 4096) == 5 * n

    def llama_3_8b(batch):  # one position's bytes: 8 KV heads, keys and values of 128 bf16 each
        return batch * 8 * 2 * 128 * 2

    # The measured sides of the line: a 2k prompt at batch 1 (8 MiB a layer) stays with the
    # kernel; at batch 4 (32 MiB) and 16 (128 MiB) it takes the copy engine.
    assert engine_positions(2048, llama_3_8b(1)) == 0
    assert engine_positions(2048, llama_3_8b(4)) == engine_positions(2048, llama_3_8b(16)) == 2048
