"""ple_ops.host_embedding under torch.compile(fullgraph=True) (CPU and GPU) and in a captured
CUDA graph replayed with new ids: bitwise the original module's forward."""

import pytest
import torch
from torch import nn

import ple_ops


def scaled_embedding(vocab, dim, dtype, device="cpu"):
    """Gemma 3n's scaled embedding where transformers is installed, else a stock one."""
    torch.manual_seed(0)
    try:
        from transformers.models.gemma3n.modeling_gemma3n import Gemma3nTextScaledWordEmbedding
    except ImportError:
        return nn.Embedding(vocab, dim, padding_idx=0).to(device, dtype)
    return Gemma3nTextScaledWordEmbedding(vocab, dim, 0, embed_scale=dim**0.5).to(device, dtype)


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


class Step(nn.Module):  # the embedding inside a bigger graph, as in a model's forward
    def __init__(self, emb):
        super().__init__()
        self.emb = emb

    def forward(self, ids):
        return self.emb(ids).reshape(*ids.shape, 4, -1).sum(-2)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_compiled_fullgraph_on_the_cpu_equals_the_original_bitwise(backend, dtype):
    torch._dynamo.reset()
    emb = scaled_embedding(1000, 96, dtype)
    stock, host = Step(emb), Step(ple_ops.host_embedding(emb))
    compiled = torch.compile(host, backend=backend, fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(1)
    for shape in [(2, 7), (1, 1), (3, 13)]:
        ids = torch.randint(0, 1000, shape, generator=gen)
        with torch.no_grad():
            assert same_bits(stock(ids), compiled(ids))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_compiled_and_captured_on_the_gpu_replays_new_ids_bitwise(dtype):
    torch._dynamo.reset()
    emb = scaled_embedding(32768, 1024, dtype, "cuda")
    stock, host = Step(emb), Step(ple_ops.host_embedding(emb))
    compiled = torch.compile(host, fullgraph=True)
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
    stock, host = Step(emb), Step(ple_ops.host_embedding(emb))
    compiled = torch.compile(host, mode="reduce-overhead", fullgraph=True)
    gen = torch.Generator(device="cuda").manual_seed(3)
    with torch.no_grad():
        for _ in range(4):
            ids = torch.randint(0, 4096, (2, 5), device="cuda", generator=gen)
            assert same_bits(stock(ids), compiled(ids).clone())
