"""ple_ops.gather_from_host on the CPU: the gathered model equals the local one bitwise, and every
refusal (a device this machine lacks, a layer that is not a pure lookup) leaves the model as it was."""

import re

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


def test_a_gathered_models_state_dict_is_the_local_ones_and_loading_it_writes_the_host_rows():
    local, model = make_lookup_model(), make_lookup_model()
    for block in local.blocks:  # another model's tables, so that a load that writes nothing fails
        torch.nn.init.normal_(block.ple.table, std=2.0)
    ple_ops.gather_from_host(model, "cpu")
    assert list(model.state_dict()) == list(make_lookup_model().state_dict())
    assert model.load_state_dict(local.state_dict()).missing_keys == []
    saved = model.state_dict()
    for key, tensor in local.state_dict().items():
        assert torch.equal(tensor.view(torch.uint8), saved[key].view(torch.uint8)), key
    gen = torch.Generator().manual_seed(45)
    ids, hidden = torch.randint(0, VOCAB, (9,), generator=gen), torch.randn(9, DIM, generator=gen)
    assert torch.equal(local(hidden, ids).view(torch.uint8), model(hidden, ids).view(torch.uint8))


def test_a_table_held_in_a_buffer_keeps_its_place_in_the_state_dict_persistent_or_not():
    persistent, transient = make_lookup_model(), make_lookup_model()
    for model, keep in ((persistent, True), (transient, False)):
        for block in model.blocks:
            table = block.ple.table.detach().clone()
            del block.ple.table
            block.ple.register_buffer("table", table, persistent=keep)
    want = {id(m): list(m.state_dict()) for m in (persistent, transient)}
    assert any(key.endswith("ple.table") for key in want[id(persistent)])
    assert not any(key.endswith("ple.table") for key in want[id(transient)])
    for model in (persistent, transient):
        ple_ops.gather_from_host(model, "cpu")
        assert list(model.state_dict()) == want[id(model)]


def test_a_cast_of_a_gathered_model_is_refused_where_the_rows_would_keep_their_dtype():
    for cast in (torch.nn.Module.half, lambda m: m.to(torch.bfloat16)):
        with pytest.raises(ValueError, match=r"LookupPle: its rows are torch.float32 on cpu, .* cannot be cast to"):
            cast(ple_ops.gather_from_host(make_lookup_model(), "cpu"))
    model = ple_ops.gather_from_host(make_lookup_model(), "cpu").to("cpu")  # a move passes
    gen = torch.Generator().manual_seed(47)
    ids, hidden = torch.randint(0, VOCAB, (5,), generator=gen), torch.randn(5, DIM, generator=gen)
    want = make_lookup_model()(hidden, ids)
    assert torch.equal(want.view(torch.uint8), model(hidden, ids).view(torch.uint8))


class EmbeddingPle(ple_ops.PleOffloadLayer):
    """PleOffloadLayer's own example: an nn.Embedding in the layer, its weight the table."""

    def __init__(self, table=None):
        super().__init__()
        self.table = table if table is not None else torch.nn.Embedding(VOCAB, DIM)

    def forward_impl(self, input_ids):
        return self.table(input_ids)

    def lookup_table(self):
        return self.table.weight


def test_a_submodules_table_is_gathered_and_a_table_tied_between_layers_is_pinned_once_and_stays_tied():
    torch.manual_seed(48)
    shared = torch.nn.Embedding(VOCAB, DIM)
    model = torch.nn.ModuleDict({"a": EmbeddingPle(shared), "b": EmbeddingPle(shared), "c": EmbeddingPle()})
    ids = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(49))
    with torch.no_grad():
        want = {k: layer.forward_impl(ids) for k, layer in model.items()}
    keys = list(model.state_dict())
    ple_ops.gather_from_host(model, "cpu")
    for k, layer in model.items():
        assert torch.equal(want[k], layer(torch.zeros(7, DIM), ids)) and not list(layer.parameters())
    assert model["a"].ple_host_table.data_ptr() == model["b"].ple_host_table.data_ptr()
    assert model["c"].ple_host_table.data_ptr() != model["a"].ple_host_table.data_ptr()
    assert list(model.state_dict()) == keys  # "a.table.weight", as the stock model saves it
    new = torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(50))
    model.load_state_dict({**model.state_dict(), "a.table.weight": new})
    assert torch.equal(model["b"](torch.zeros(7, DIM), ids), new[ids])  # the tie holds


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
        (lambda gen: torch.randint(0, VOCAB, (), generator=gen), r"a torch.int64 tensor of shape \(\) on cpu"),
        (lambda gen: torch.randint(0, VOCAB, (3,), generator=gen).tolist(), r"list with 3 entries"),
    ],
    ids=["0-d", "list"],
)
def test_ids_that_are_not_a_1d_tensor_are_a_value_error_naming_them(ids, shown):
    model = ple_ops.gather_from_host(make_lookup_model(), "cpu")
    gen = torch.Generator().manual_seed(43)
    with pytest.raises(ValueError, match=rf"LookupPle: input_ids must be a 1-D tensor of token ids, got {shown}"):
        model(torch.randn(3, DIM, generator=gen), ids(gen))


@pytest.mark.parametrize(
    "shape, what", [((0, DIM), "row count"), ((VOCAB, 0), "row width")], ids=["no-rows", "no-columns"]
)
def test_a_table_with_no_rows_or_no_columns_is_refused_by_layer_before_any_table_moves(shape, what):
    # The last layer's table is the bad one: the earlier layers must not have been converted.
    model = make_lookup_model()
    gen = torch.Generator().manual_seed(47)
    model.blocks[2].ple.table = torch.nn.Parameter(torch.randn(*shape, generator=gen), requires_grad=False)
    before = tables(model)
    message = rf"^gather_from_host: the {what} of the table of layer 'blocks\.2\.ple' \({shape[0]}, {shape[1]}\)"
    with pytest.raises(ValueError, match=message):
        ple_ops.gather_from_host(model, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(before, tables(model)))
    assert not any(block.ple.ple_gathers for block in model.blocks)


@pytest.mark.parametrize("model", [None, "make_lookup_model", [1, 2]], ids=["none", "str", "list"])
def test_a_model_that_is_not_a_module_is_a_value_error_naming_it(model):
    with pytest.raises(
        ValueError, match=rf"^gather_from_host: model must be an nn.Module .*, got {re.escape(repr(model))}$"
    ):
        ple_ops.gather_from_host(model, "cpu")


def test_a_model_converted_already_or_built_as_placeholders_is_a_value_error_and_stays_served():
    local, model = make_lookup_model(), ple_ops.gather_from_host(make_lookup_model(), "cpu")
    with pytest.raises(
        ValueError, match=r"^gather_from_host: PLE layer 'blocks\.0\.ple' \(LookupPle\) already gathers"
    ):
        ple_ops.gather_from_host(model, "cpu")
    gen = torch.Generator().manual_seed(53)
    ids, hidden = torch.randint(0, VOCAB, (9,), generator=gen), torch.randn(9, DIM, generator=gen)
    assert torch.equal(local(hidden, ids).view(torch.uint8), model(hidden, ids).view(torch.uint8))
    with ple_ops.layer.building_placeholders():
        placeholders = make_lookup_model()
    with pytest.raises(ValueError, match=r"'blocks\.0\.ple' \(LookupPle\) is an offload runtime's placeholder"):
        ple_ops.gather_from_host(placeholders, "cpu")
