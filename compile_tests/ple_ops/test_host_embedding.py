"""ple_ops.host_embedding under torch.compile(fullgraph=True) (CPU and GPU) and in a captured
CUDA graph replayed with new ids: bitwise the original module's forward, for Gemma 3n's and
Gemma 4's scaled embeddings and inside a whole tiny Gemma 4 model."""

import pytest
import torch
from torch import nn

import ple_ops


def scaled_embedding(vocab, dim, dtype, device="cpu", family="gemma3n"):
    """Gemma 3n's (or Gemma 4's) scaled embedding where transformers has it; else a stock one
    for Gemma 3n, a skip for Gemma 4."""
    torch.manual_seed(0)
    try:
        from transformers.models.gemma3n.modeling_gemma3n import Gemma3nTextScaledWordEmbedding
    except ImportError:
        if family == "gemma4":
            pytest.skip("transformers (the hf extra) is not installed")
        return nn.Embedding(vocab, dim, padding_idx=0).to(device, dtype)
    if family == "gemma4":
        modeling = pytest.importorskip(
            "transformers.models.gemma4.modeling_gemma4", reason="this transformers release has no Gemma 4"
        )
        return modeling.Gemma4TextScaledWordEmbedding(vocab, dim, 0, embed_scale=dim**0.5).to(device, dtype)
    return Gemma3nTextScaledWordEmbedding(vocab, dim, 0, embed_scale=dim**0.5).to(device, dtype)


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


class Step(nn.Module):  # the embedding inside a bigger graph, as in a model's forward
    def __init__(self, emb):
        super().__init__()
        self.emb = emb

    def forward(self, ids):
        return self.emb(ids).reshape(*ids.shape, 4, -1).sum(-2)


@pytest.mark.parametrize("family", ["gemma3n", "gemma4"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_compiled_fullgraph_on_the_cpu_equals_the_original_bitwise(backend, dtype, family):
    """Compiled the same way as the original: Inductor fuses the scale into the ops after it (in
    fp32, unrounded) in both, so the outputs equal each other, not eager's."""
    torch._dynamo.reset()
    emb = scaled_embedding(1000, 96, dtype, family=family)
    stock, host = (
        torch.compile(Step(e), backend=backend, fullgraph=True, dynamic=True)
        for e in (emb, ple_ops.host_embedding(emb))
    )
    gen = torch.Generator().manual_seed(1)
    for shape in [(2, 7), (1, 1), (3, 13)]:
        ids = torch.randint(0, 1000, shape, generator=gen)
        with torch.no_grad():
            assert same_bits(stock(ids), host(ids))


def tiny_gemma4_causal_lm():
    modeling = pytest.importorskip(
        "transformers.models.gemma4.modeling_gemma4", reason="transformers with Gemma 4 is not installed"
    )
    config = modeling.Gemma4TextConfig(
        vocab_size=512,
        vocab_size_per_layer_input=512,
        hidden_size=64,
        hidden_size_per_layer_input=24,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        global_head_dim=64,
        num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=16,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return modeling.Gemma4ForCausalLM(config).eval()


def test_a_tiny_gemma4_model_compiled_fullgraph_equals_its_eager_stock_forward_bitwise():
    # aot_eager runs the same aten kernels as eager, so the whole model's logits must match to
    # the bit; the model's own accessors do the replacement.
    torch._dynamo.reset()
    model = tiny_gemma4_causal_lm()
    table = model.get_per_layer_input_embeddings()
    nn.init.normal_(table.weight, std=3.0)
    gen = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, 512, shape, generator=gen) for shape in [(2, 9), (1, 5)]]
    with torch.no_grad():
        want = [model(input_ids=ids).logits for ids in batches]
    model.set_per_layer_input_embeddings(ple_ops.host_embedding(table))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        for ids, logits in zip(batches, want):
            assert same_bits(logits, compiled(input_ids=ids).logits)


def test_a_tiny_bf16_gemma4_model_under_inductor_equals_the_stock_model_under_inductor_bitwise():
    # Inductor keeps a fused kernel's bf16 intermediates in fp32, so in the stock model the table's
    # scale runs unrounded into the ops after it. The host table is multiplied in the same place
    # (not stored pre-scaled, rounded once), so the two compiled models agree to the bit.
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 512, shape, generator=gen) for shape in [(4, 24), (1, 7)]]
    stock, host = (tiny_gemma4_causal_lm().to(torch.bfloat16) for _ in range(2))  # the same seed: the same weights
    host.set_per_layer_input_embeddings(ple_ops.host_embedding(host.get_per_layer_input_embeddings()))
    stock_c, host_c = (torch.compile(m, fullgraph=True) for m in (stock, host))
    with torch.no_grad():
        for ids in batches:
            assert same_bits(stock_c(input_ids=ids).logits, host_c(input_ids=ids).logits)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gemma3n", "gemma4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_compiled_and_captured_on_the_gpu_replays_new_ids_bitwise(dtype, family):
    torch._dynamo.reset()
    emb = scaled_embedding(32768, 1024, dtype, "cuda", family)
    # The original compiled too: Inductor fuses the scale into the sum unrounded in both.
    stock, host = (torch.compile(Step(e), fullgraph=True) for e in (emb, ple_ops.host_embedding(emb)))
    compiled = host
    ids = torch.randint(0, 32768, (4, 8), device="cuda")
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            compiled(ids)  # warm-up: compile and the op's first call
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = compiled(ids)
        gen = torch.Generator(device="cuda").manual_seed(2)
        for _ in range(5):
            ids.copy_(torch.randint(0, 32768, ids.shape, device="cuda", generator=gen))
            graph.replay()
            torch.cuda.synchronize()
            assert same_bits(stock(ids), out)


@pytest.mark.gpu
def test_reduce_overhead_keeps_the_device_view_and_equals_the_original():
    torch._dynamo.reset()
    emb = scaled_embedding(4096, 512, torch.bfloat16, "cuda")
    stock = torch.compile(Step(emb), fullgraph=True)  # the same kernels, not captured
    compiled = torch.compile(Step(ple_ops.host_embedding(emb)), mode="reduce-overhead", fullgraph=True)
    gen = torch.Generator(device="cuda").manual_seed(3)
    with torch.no_grad():
        for _ in range(4):
            ids = torch.randint(0, 4096, (2, 5), device="cuda", generator=gen)
            assert same_bits(stock(ids), compiled(ids).clone())
