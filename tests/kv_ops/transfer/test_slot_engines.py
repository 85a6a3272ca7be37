"""kv_pair: a layer's keys and values in one allocation where they agree, as two storages."""

from __future__ import annotations

import functools
import gc

import pytest
import torch

from kv_ops.transfer.slot_engines import kv_pair

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
