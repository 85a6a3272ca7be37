"""ple_ops.host_embedding: bitwise the original forward (stock, Gemma 3n's and Gemma 4's scaled
embeddings, and whole tiny Gemma 4 models through their own per-layer accessors), the dtype kept,
the refusals, and on the GPU the table's memory given back."""

import copy
import gc
import re
import sys

import pytest
import torch
from torch import nn

import kv_ops
import ple_ops

DTYPES = [torch.bfloat16, torch.float32]


def gemma3n_embedding_class():
    modeling = pytest.importorskip("transformers.models.gemma3n.modeling_gemma3n")
    return modeling.Gemma3nTextScaledWordEmbedding


def gemma4_modeling():
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    return pytest.importorskip(
        "transformers.models.gemma4.modeling_gemma4", reason="this transformers release has no Gemma 4"
    )


def scaled_embedding_class(family):
    if family == "gemma3n":
        return gemma3n_embedding_class()
    return gemma4_modeling().Gemma4TextScaledWordEmbedding


SCALED_FAMILIES = ["gemma3n", "gemma4"]


def random_ids(vocab, shape, seed):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def assert_bitwise(want, got):
    assert got.dtype == want.dtype and got.shape == want.shape and got.device == want.device
    assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_stock_embedding_gives_its_rows_bitwise_in_its_dtype(dtype):
    torch.manual_seed(0)
    emb = nn.Embedding(300, 40, padding_idx=0).to(dtype)
    host = ple_ops.host_embedding(emb)
    assert isinstance(host, ple_ops.HostEmbedding) and list(host.parameters()) == []
    assert host.host_rows.dtype == torch.uint8 and host.dtype == dtype
    for seed, shape in enumerate([(7,), (2, 5), (3, 1, 4), (0,)]):
        ids = random_ids(300, shape, seed)
        assert_bitwise(emb(ids), host(ids))


@pytest.mark.parametrize("family", SCALED_FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [48, 256, 3072 // 16], ids=lambda d: f"dim{d}")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_scaled_embedding_pre_scaled_equals_its_forward_bitwise(family, dtype, dim, seed):
    # The scale sqrt(dim) is irrational for 48 and 192 (sqrt(256) = 16 is the E2B PLE width's
    # exact one, in Gemma 3n and Gemma 4 alike), so the product rounds; pre-scaling must round
    # every element the same way.
    cls = scaled_embedding_class(family)
    torch.manual_seed(seed)
    emb = cls(512, dim, padding_idx=0, embed_scale=dim**0.5).to(dtype)
    nn.init.normal_(emb.weight, std=3.0)
    assert emb.embed_scale.dtype == dtype  # .to(dtype) casts the buffer too; the forward casts it anyway
    host = ple_ops.host_embedding(emb)
    ids = random_ids(512, (4, 97), seed)
    assert_bitwise(emb(ids), host(ids))
    every = torch.arange(512)  # every row of the table, not a sample
    assert_bitwise(emb(every), host(every))


@pytest.mark.parametrize("family", SCALED_FAMILIES)
def test_a_scaled_embedding_with_a_float32_scale_on_a_bf16_table(family):
    # transformers builds the buffer as float32 and may load bf16 weights without casting it:
    # the forward casts the scale to the weight's dtype, and so must the pre-scaling.
    cls = scaled_embedding_class(family)
    torch.manual_seed(3)
    emb = cls(256, 96, padding_idx=0, embed_scale=96**0.5)
    emb.weight.data = emb.weight.data.to(torch.bfloat16)
    assert emb.embed_scale.dtype == torch.float32
    ids = random_ids(256, (64,), 3)
    assert_bitwise(emb(ids), ple_ops.host_embedding(emb)(ids))


@pytest.mark.parametrize("padding_idx", [None, 5, -1], ids=lambda p: f"padding{p}")
def test_gemma4_scaled_embedding_with_any_padding_idx_equals_its_forward_bitwise(padding_idx):
    # Gemma 4 pads with config.pad_token_id, which may be None; the padding row is ordinary data
    # to the forward (nn.Embedding only skips it in the gradient), so it must come back as is.
    cls = gemma4_modeling().Gemma4TextScaledWordEmbedding
    torch.manual_seed(4)
    emb = cls(300, 72, padding_idx=padding_idx, embed_scale=72**0.5).to(torch.bfloat16)
    nn.init.normal_(emb.weight, std=2.0)  # the padding row too: not left at its initial zeros
    assert emb.embed_scale.dtype == torch.bfloat16
    host = ple_ops.host_embedding(emb)
    ids = torch.cat([random_ids(300, (50,), 4), torch.tensor([emb.padding_idx or 0, 299, 0])])
    assert_bitwise(emb(ids), host(ids))
    assert "Gemma4TextScaledWordEmbedding" in repr(host)


# Both tiny Gemma families' widths, each with a few layers of its own kinds.
TINY_WIDTHS = dict(
    vocab_size=512,
    vocab_size_per_layer_input=512,
    hidden_size=64,
    hidden_size_per_layer_input=24,  # embed_scale sqrt(24) is not a power of two: the product rounds
    intermediate_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    sliding_window=16,
    max_position_embeddings=256,
)


def tiny_gemma4_text_config(modeling, **overrides):
    """Two sliding and two full layers, the last two sharing the first two's KV, as E2B does."""
    own = dict(
        num_hidden_layers=4,
        global_head_dim=64,
        num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 2,
        use_double_wide_mlp=True,
        final_logit_softcapping=30.0,
    )
    return modeling.Gemma4TextConfig(**{**TINY_WIDTHS, **own, **overrides})


def tiny_gemma4(kind, **overrides):
    """A random-weight Gemma4ForCausalLM, or the multimodal Gemma4ForConditionalGeneration (the
    class of the published checkpoints) with a one-layer vision tower and no audio."""
    modeling = gemma4_modeling()
    text = tiny_gemma4_text_config(modeling, **overrides)
    torch.manual_seed(0)
    if kind == "causal_lm":
        return modeling.Gemma4ForCausalLM(text).eval()
    vision = modeling.Gemma4VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
    )
    config = modeling.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    return modeling.Gemma4ForConditionalGeneration(config).eval()


@pytest.mark.parametrize("kind", ["causal_lm", "conditional_generation"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_tiny_gemma4_model_through_its_own_accessors_gives_bitwise_its_logits(kind, dtype):
    model = tiny_gemma4(kind).to(dtype)
    table = model.get_per_layer_input_embeddings()
    assert type(table).__qualname__ == "Gemma4TextScaledWordEmbedding"
    nn.init.normal_(table.weight, std=3.0)  # beyond the initialiser's tiny values, so rounding shows
    ids = random_ids(512, (2, 19), 5)
    with torch.no_grad():
        want = model(input_ids=ids).logits
    model.set_per_layer_input_embeddings(ple_ops.host_embedding(table))
    del table
    host = model.get_per_layer_input_embeddings()
    assert isinstance(host, ple_ops.HostEmbedding) and host.dtype == dtype
    assert not any("embed_tokens_per_layer" in name for name, _ in model.named_parameters())
    with torch.no_grad():
        assert_bitwise(want, model(input_ids=ids).logits)


def test_gemma4_with_the_per_layer_table_in_host_memory_generates_the_same_tokens():
    model = tiny_gemma4("causal_lm")
    ids = random_ids(512, (2, 7), 6)
    settings = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        want = model.generate(ids, cache_implementation="static", **settings)
        model.set_per_layer_input_embeddings(ple_ops.host_embedding(model.get_per_layer_input_embeddings()))
        got = model.generate(ids, cache_implementation="static", **settings)
    assert torch.equal(want, got)


def test_the_original_module_is_left_unchanged():
    torch.manual_seed(0)
    emb = nn.Embedding(50, 8)
    before = emb.weight.detach().clone()
    ple_ops.host_embedding(emb)
    assert torch.equal(emb.weight, before)


def test_the_state_dict_holds_the_table_as_the_originals_weight_and_a_load_writes_the_rows():
    torch.manual_seed(0)
    emb = nn.Embedding(50, 8).to(torch.bfloat16)
    host = ple_ops.host_embedding(emb)
    state = host.state_dict()
    assert list(state) == ["weight"]
    assert_bitwise(emb.weight.detach(), state["weight"])
    # A load writes new weights into the host rows in place (cast to their dtype, as a
    # parameter's copy_ casts), and the forward then gives the new table's rows.
    other = nn.Embedding(50, 8)
    nn.init.normal_(other.weight, std=5.0)
    rows_before = host.host_rows.data_ptr()
    assert not host.load_state_dict(other.state_dict()).missing_keys
    ids = random_ids(50, (3, 7), 1)
    assert_bitwise(other.to(torch.bfloat16)(ids), host(ids))
    assert host.host_rows.data_ptr() == rows_before


def test_a_load_without_the_table_or_of_another_shape_fails_as_a_parameters_would_and_writes_nothing():
    torch.manual_seed(1)
    emb = nn.Embedding(50, 8)
    host = ple_ops.host_embedding(emb)
    with pytest.raises(RuntimeError, match='Missing key.*"weight"'):
        host.load_state_dict({})
    assert host.load_state_dict({}, strict=False).missing_keys == ["weight"]
    for wrong in (torch.randn(49, 8), torch.randn(50, 9)):
        with pytest.raises(
            RuntimeError, match=re.escape(f"size mismatch for weight: copying a param with shape {tuple(wrong.shape)}")
        ):
            host.load_state_dict({"weight": wrong})
    with pytest.raises(RuntimeError, match=r"weight is a meta tensor in the checkpoint: it holds no values"):
        host.load_state_dict({"weight": torch.empty(50, 8, device="meta")})
    ids = torch.arange(50)
    assert_bitwise(emb(ids).detach(), host(ids))


def tiny_gemma3n():
    """A random-weight two-layer Gemma3nForCausalLM whose logits depend on its per-layer table."""
    modeling = pytest.importorskip("transformers.models.gemma3n.modeling_gemma3n")
    text = modeling.Gemma3nTextConfig(
        **TINY_WIDTHS,
        num_hidden_layers=2,
        num_kv_shared_layers=0,
        layer_types=["sliding_attention", "full_attention"],
        activation_sparsity_pattern=[0.0, 0.0],
        laurel_rank=8,
    )
    torch.manual_seed(0)
    model = modeling.Gemma3nForCausalLM(text)
    with torch.no_grad():  # transformers' zero AltUp correction scale would cancel the per-layer inputs
        for name, param in model.named_parameters():
            if name.endswith("altup.correct_output_scale"):
                param.normal_()
    return model.eval()


@pytest.mark.parametrize("family", ["gemma3n", "gemma4"])
def test_save_pretrained_of_a_converted_model_writes_the_table_and_from_pretrained_gives_its_logits(family, tmp_path):
    # The checkpoint a converted model saves is the stock model's: the stock class loads it with
    # no missing key, and gives bitwise the logits of the model that was converted.
    model = tiny_gemma4("causal_lm") if family == "gemma4" else tiny_gemma3n()
    table = model.get_per_layer_input_embeddings()
    nn.init.normal_(table.weight, std=3.0)
    ids = random_ids(512, (2, 11), 2)
    with torch.no_grad():
        want = model(input_ids=ids).logits
    model.set_per_layer_input_embeddings(ple_ops.host_embedding(table))
    del table
    model.save_pretrained(tmp_path)
    loaded, info = type(model).from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(loaded.get_per_layer_input_embeddings()) is not ple_ops.HostEmbedding
    with torch.no_grad():
        assert_bitwise(want, loaded.eval()(input_ids=ids).logits)
        # And the stock weights load back into a converted model, table included.
        converted = type(model)(model.config).eval()
        converted.set_per_layer_input_embeddings(ple_ops.host_embedding(converted.get_per_layer_input_embeddings()))
        converted.load_state_dict(loaded.state_dict())
        assert_bitwise(want, converted(input_ids=ids).logits)


class Shifted(nn.Embedding):
    def forward(self, ids):
        return super().forward(ids) + 1


def test_an_unknown_subclass_is_refused_by_name():
    with pytest.raises(ValueError, match="Shifted"):
        ple_ops.host_embedding(Shifted(10, 4))


def test_a_subclass_of_gemma4s_scaled_embedding_is_refused_by_name():
    # Only the class transformers ships is known; a subclass may change the forward.
    class Gemma4Variant(gemma4_modeling().Gemma4TextScaledWordEmbedding):
        def forward(self, ids):
            return super().forward(ids).flip(-1)

    with pytest.raises(ValueError, match="Gemma4Variant is a subclass of nn.Embedding whose forward is not known"):
        ple_ops.host_embedding(Gemma4Variant(10, 4, 0, embed_scale=2.0))


def test_max_norm_is_refused():
    with pytest.raises(ValueError, match="max_norm"):
        ple_ops.host_embedding(nn.Embedding(10, 4, max_norm=1.0))


def test_hooks_and_patched_forwards_are_refused():
    hooked = nn.Embedding(10, 4)
    hooked.register_forward_hook(lambda m, i, o: o * 2)
    with pytest.raises(ValueError, match="hooks"):
        ple_ops.host_embedding(hooked)
    patched = nn.Embedding(10, 4)
    patched.forward = lambda ids: torch.zeros(4)
    with pytest.raises(ValueError, match="patched"):
        ple_ops.host_embedding(patched)


def test_something_that_is_not_an_embedding_is_refused():
    with pytest.raises(ValueError, match="Linear"):
        ple_ops.host_embedding(nn.Linear(4, 4))


@pytest.mark.parametrize("shape, what", [((0, 4), "row count"), ((10, 0), "row width")], ids=["no-rows", "no-columns"])
def test_a_weight_with_no_rows_or_no_columns_is_a_value_error_naming_it(shape, what):
    # Nothing to gather: refused by name, where pin_rows would fail with torch's RuntimeError.
    torch.manual_seed(11)
    emb = nn.Embedding(*shape)
    before = emb.weight.detach().clone()
    name = r"torch\.nn\.modules\.sparse\.Embedding's weight"
    with pytest.raises(
        ValueError, match=rf"^host_embedding: the {what} of {name} {re.escape(str(shape))} must be a positive integer"
    ):
        ple_ops.host_embedding(emb)
    assert torch.equal(emb.weight, before)


@pytest.mark.parametrize("family", [None, *SCALED_FAMILIES])
def test_a_cast_after_conversion_casts_the_host_rows_as_it_would_the_originals_weight(family):
    # The scale is a buffer, which the cast reaches; the rows are bytes in host memory, cast into
    # a new page-locked table: the outputs are the cast original's, bit for bit.
    torch.manual_seed(4)
    emb = nn.Embedding(64, 32) if family is None else scaled_embedding_class(family)(64, 32, 0, embed_scale=32**0.5)
    nn.init.normal_(emb.weight, std=3.0)  # values that round differently in each dtype
    host = ple_ops.host_embedding(emb)
    ids = random_ids(64, (3, 7), 4)
    for cast in (lambda m: m.half(), lambda m: m.to(torch.bfloat16), lambda m: nn.Sequential(m).double()[0]):
        emb, host = cast(emb), cast(host)
        assert host.dtype == emb.weight.dtype and host.state_dict()["weight"].dtype == emb.weight.dtype
        with torch.no_grad():
            assert_bitwise(emb(ids), host(ids))
    rows = host.host_rows.data_ptr()
    assert_bitwise(emb(ids).detach(), host.double().to("cpu")(ids))  # its own dtype and a move: no copy
    assert host.host_rows.data_ptr() == rows


def test_a_converted_gemma_model_cast_after_gives_the_cast_stock_models_logits():
    model = tiny_gemma4("causal_lm")
    nn.init.normal_(model.get_per_layer_input_embeddings().weight, std=3.0)
    stock = copy.deepcopy(model).to(torch.bfloat16)
    model.set_per_layer_input_embeddings(ple_ops.host_embedding(model.get_per_layer_input_embeddings()))
    model.to(torch.bfloat16)
    ids = random_ids(512, (2, 11), 5)
    with torch.no_grad():
        assert_bitwise(stock(input_ids=ids).logits, model(input_ids=ids).logits)


def test_gradient_only_options_are_accepted():
    torch.manual_seed(0)
    emb = nn.Embedding(20, 6, padding_idx=3, scale_grad_by_freq=True, sparse=True)
    ids = torch.tensor([3, 0, 19, 3])
    assert_bitwise(emb(ids), ple_ops.host_embedding(emb)(ids))


def test_out_of_range_ids_raise_in_eager_mode():
    host = ple_ops.host_embedding(nn.Embedding(10, 4))
    with pytest.raises(ValueError):
        host(torch.tensor([10]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", SCALED_FAMILIES)
def test_on_the_gpu_rows_land_there_bitwise_and_the_table_is_freed(dtype, family):
    cls = scaled_embedding_class(family)
    torch.manual_seed(0)
    emb = cls(65536, 1536, padding_idx=0, embed_scale=48**0.5).to("cuda", dtype)  # 192 / 384 MiB
    table_bytes = emb.weight.numel() * emb.weight.element_size()
    ids = random_ids(65536, (3, 41), 0).cuda()
    with torch.no_grad():  # an output with a grad_fn would keep the weight alive (AccumulateGrad)
        want = emb(ids)
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    host = ple_ops.host_embedding(emb)
    del emb
    gc.collect()
    torch.cuda.synchronize()
    freed = before - torch.cuda.memory_allocated()
    assert abs(freed - table_bytes) <= 0.01 * table_bytes, (freed, table_bytes)
    assert host.host_rows.is_cuda and list(host.parameters()) == []
    assert_bitwise(want, host(ids))


@pytest.mark.gpu
def test_on_the_gpu_a_tiny_gemma4_model_frees_its_table_and_gives_bitwise_its_logits():
    model = tiny_gemma4("causal_lm", vocab_size_per_layer_input=16384).to("cuda", torch.bfloat16)  # a 3 MiB table
    table = model.get_per_layer_input_embeddings()
    table_bytes = table.weight.numel() * table.weight.element_size()
    ids = random_ids(512, (2, 19), 7).cuda()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model.set_per_layer_input_embeddings(ple_ops.host_embedding(table))
    del table
    gc.collect()
    torch.cuda.synchronize()
    freed = before - torch.cuda.memory_allocated()
    assert abs(freed - table_bytes) <= 0.01 * table_bytes, (freed, table_bytes)
    assert model.get_per_layer_input_embeddings().host_rows.is_cuda
    with torch.no_grad():
        assert_bitwise(want, model(input_ids=ids).logits)


@pytest.mark.gpu
def test_on_the_gpu_the_state_dict_round_trips_through_the_host_rows_in_stream_order():
    # The saved table is the device view of the rows (on the model's device, no copy); a load
    # writes a CPU checkpoint into them on the current stream, after the gathers queued before it.
    torch.manual_seed(2)
    emb = nn.Embedding(4096, 256).to("cuda", torch.bfloat16)
    host = ple_ops.host_embedding(emb)
    saved = host.state_dict()["weight"]
    assert saved.is_cuda and saved.data_ptr() == host.host_rows.data_ptr()
    assert_bitwise(emb.weight.detach(), saved)
    ids = random_ids(4096, (2048,), 3).cuda()
    new = torch.randn(4096, 256, generator=torch.Generator().manual_seed(4))
    host(ids)  # the gather's first call builds its kernel on the host: not inside the sleep below
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # keeps the stream busy past the load's host work
    # The eager id check reads the ids on the host, which waits for the sleep: off here.
    with kv_ops.id_checks(False):
        before = host(ids)  # queued before the load: it must see the old rows
    assert not torch.cuda.current_stream().query()  # still queued when the load is issued
    host.load_state_dict({"weight": new})
    after = host(ids)
    assert_bitwise(emb(ids).detach(), before)
    assert_bitwise(new.to(torch.bfloat16)[ids.cpu()].cuda(), after)


@pytest.mark.gpu
@pytest.mark.parametrize("family", SCALED_FAMILIES)
def test_on_the_gpu_a_cast_after_conversion_casts_the_host_rows(family):
    torch.manual_seed(5)
    emb = scaled_embedding_class(family)(8192, 256, 0, embed_scale=16.0).to("cuda", torch.bfloat16)
    host = ple_ops.host_embedding(emb)
    ids = random_ids(8192, (4, 33), 6).cuda()
    emb, host = emb.half(), host.half()
    assert host.host_rows.is_cuda and host.dtype == torch.float16
    with torch.no_grad():
        assert_bitwise(emb(ids), host(ids))


class ScaledOtherwise(nn.Embedding):  # looks like Gemma 3n's, but its forward does more
    def __init__(self, *args):
        super().__init__(*args)
        self.embed_scale = nn.Buffer(torch.tensor(2.0), persistent=False)

    def forward(self, ids):
        return super().forward(ids) * self.embed_scale + 1e-3


def test_a_known_class_whose_forward_differs_is_refused_by_the_conversion_check(monkeypatch):
    module = sys.modules["ple_ops.gather.host_embedding"]  # the module; ple_ops.host_embedding is the function
    monkeypatch.setattr(module, "_SCALED", {(ScaledOtherwise.__module__, ScaledOtherwise.__qualname__)})
    with pytest.raises(ValueError, match="ScaledOtherwise.*does not equal"):
        ple_ops.host_embedding(ScaledOtherwise(10, 4))


@pytest.mark.parametrize("ids", [[1, 2, 3], (4,), 5], ids=["list", "tuple", "int"])
def test_ids_that_are_not_a_tensor_are_a_value_error_naming_them(ids):
    host = ple_ops.host_embedding(nn.Embedding(10, 4))
    with pytest.raises(
        ValueError, match=f"HostEmbedding: input_ids must be an integer tensor.*got {type(ids).__name__}"
    ):
        host(ids)


def test_ids_on_another_device_than_the_rows_are_a_value_error_naming_both():
    host = ple_ops.host_embedding(nn.Embedding(10, 4))
    with pytest.raises(ValueError, match=r"input_ids are on meta, but this embedding's rows land on cpu"):
        host(torch.tensor([1, 2], device="meta"))


def test_a_weight_on_a_device_other_than_cuda_or_cpu_is_refused_by_name():
    with pytest.raises(ValueError, match=r"host_embedding: torch\.nn\.modules\.sparse\.Embedding's weight is on meta"):
        ple_ops.host_embedding(nn.Embedding(10, 4, device="meta"))
