"""ple_ops.gather_from_host on the CPU: the gathered model equals the local one bitwise, and every
refusal (a device this machine lacks, a layer that is not a pure lookup) leaves the model as it was."""

import pytest
import torch
from ple_models import DIM, VOCAB, TinyModel, make_lookup_model, make_model

import ple_ops


def tables(model):
    return [block.ple.table.detach().clone() for block in model.blocks]


def test_a_gathered_model_gives_the_local_result_bitwise_with_no_table_parameter():
    local, model = make_lookup_model(), make_lookup_model()
    served = ple_ops.gather_from_host(model, "cpu")
    assert served is model
    for block in model.blocks:
        assert not hasattr(block.ple, "table") and block.ple.ple_host_table.dtype == torch.uint8
    gen = torch.Generator().manual_seed(41)
    for n in (1, 7, 33):
        ids, hidden = torch.randint(0, VOCAB, (n,), generator=gen), torch.randn(n, DIM, generator=gen)
        want, got = local(hidden, ids), model(hidden, ids)
        assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is there")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0])
def test_a_cuda_device_without_cuda_is_a_value_error_before_any_table_moves(device):
    model = make_lookup_model()
    before = tables(model)
    with pytest.raises(ValueError, match=f"gather_from_host: device is {device!r}, but this machine has no CUDA"):
        ple_ops.gather_from_host(model, device)
    assert all(torch.equal(a, b) for a, b in zip(before, tables(model)))
    assert not any(block.ple.ple_gathers for block in model.blocks)


@pytest.mark.parametrize(
    "device, message",
    [
        ("meta", r"device must be a CUDA device or 'cpu', got device\(type='meta'\)"),
        ("gpu0", "device 'gpu0' is not a device"),
    ],
)
def test_a_device_that_is_neither_cuda_nor_the_cpu_is_a_value_error(device, message):
    model = make_lookup_model()
    with pytest.raises(ValueError, match=f"gather_from_host: {message}"):
        ple_ops.gather_from_host(model, device)
    assert not any(block.ple.ple_gathers for block in model.blocks)


def test_a_layer_that_is_not_a_pure_lookup_is_refused_before_any_table_moves():
    model = TinyModel(lookup=True)
    model.blocks[2].ple = make_model().blocks[2].ple  # lookup_table() is None
    before = tables(model)
    with pytest.raises(ValueError, match=r"PLE layer 'blocks\.2\.ple' \(TablePle\) is not a pure lookup"):
        ple_ops.gather_from_host(model, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(before, tables(model)))
    assert not any(block.ple.ple_gathers for block in model.blocks)


@pytest.mark.parametrize(
    "ids, shown",
    [
        (lambda gen: torch.randint(0, VOCAB, (), generator=gen), r"a tensor of shape \(\)"),
        (lambda gen: torch.randint(0, VOCAB, (3,), generator=gen).tolist(), r"list \["),
    ],
    ids=["0-d", "list"],
)
def test_ids_that_are_not_a_1d_tensor_are_a_value_error_naming_them(ids, shown):
    model = ple_ops.gather_from_host(make_lookup_model(), "cpu")
    gen = torch.Generator().manual_seed(43)
    with pytest.raises(ValueError, match=rf"LookupPle: input_ids must be a 1-D tensor of token ids, got {shown}"):
        model(torch.randn(3, DIM, generator=gen), ids(gen))
