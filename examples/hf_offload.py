"""Stock transformers generate() with kv_ops's HostOffloadedCache against transformers' on-GPU static cache.

A random-weight Llama (Llama-3-8B widths on CUDA, a tiny one on the CPU) generates greedily from
the same prompt: with ``StaticCache`` twice (the reference must repeat itself) and with
``HostOffloadedCache``, whose full-attention layers live in page-locked host memory. The new
tokens must be identical; the script prints the GPU memory the KV cache holds in each and exits
non-zero on a mismatch. The last line is ``hf offload: tokens match``, ``hf offload: MISMATCH
...`` or, where the reference itself does not repeat, ``hf offload: the reference does not
repeat ...``.

Attention is transformers' ``eager`` implementation by default (``--attention``): at 8B widths
on CUDA its ``sdpa`` gives other decode logits from one run to the next, the on-GPU
``StaticCache`` against itself too (after 1-3 steps on an H200, deterministic algorithms on or
off), so no cache can be compared with it bit for bit. With ``eager`` attention the reference
repeats and HostOffloadedCache gives its tokens and logits.
"""

from __future__ import annotations

import argparse
import sys

import torch

# examples/ is first on sys.path when this file runs as a script
from gemma3n_transformers import at_least, with_cache
from transformers import CompileConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM, StaticCache

from kv_ops.integrations.transformers import HostOffloadedCache


def config(size: str, layers: int, attention: str = "sdpa") -> LlamaConfig:
    """Llama-3-8B's widths (``"8b"``) or a tiny model for the CPU (``"tiny"``)."""
    if size == "8b":
        return LlamaConfig(
            attn_implementation=attention,
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=layers,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=131072,
            rope_theta=500000.0,
        )
    return LlamaConfig(
        attn_implementation=attention,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
    )


def build(cfg: LlamaConfig, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    return model.eval()


def generation(new_tokens: int, mode: str | None) -> GenerationConfig:
    """Greedy, exactly ``new_tokens``; ``mode``: None (eager), "compiled" or "cudagraphs"."""
    compile_config = None
    if mode is not None:
        compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead" if mode == "cudagraphs" else "default")
        compile_config._compile_all_devices = True  # transformers compiles only on accelerators otherwise
    return GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        compile_config=compile_config,
        disable_compile=mode is None,
    )


def generate(model, ids: torch.Tensor, cache, gen: GenerationConfig) -> torch.Tensor:
    if hasattr(cache, "reset"):
        cache.reset()
    with torch.no_grad():
        out = model.generate(ids, **with_cache(cache), generation_config=gen)
    return out[:, ids.shape[1] :]


def parse(argv=None) -> argparse.Namespace:
    """The run's arguments, each left unset filled in for CUDA or the CPU; a count below one is a
    usage error (exit status 2) here, before any model is built."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=["tiny", "8b"], help="model widths (default: 8b on CUDA, tiny on the CPU)")
    # None: the default of the machine's device, chosen below.
    parser.add_argument(
        "--layers", type=at_least(1), default=None, help="decoder layers (default 8 on CUDA, 5 on the CPU)"
    )
    parser.add_argument("--batch", type=at_least(1), default=None, help="sequences (default 4 on CUDA, 2 on the CPU)")
    parser.add_argument(
        "--prompt", type=at_least(1), default=None, help="prompt tokens (default 4096 on CUDA, 12 on the CPU)"
    )
    parser.add_argument(
        "--new-tokens", type=at_least(1), default=None, help="new tokens (default 32 on CUDA, 6 on the CPU)"
    )
    parser.add_argument(
        "--mode", choices=["eager", "compiled", "cudagraphs"], default="eager", help="how generate runs"
    )
    parser.add_argument(
        "--attention", choices=["eager", "sdpa"], default="eager", help="transformers' attention (default eager)"
    )
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    defaults = {"size": ("8b", "tiny"), "layers": (8, 5), "batch": (4, 2), "prompt": (4096, 12), "new_tokens": (32, 6)}
    for name, (on_cuda, on_cpu) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, on_cuda if cuda else on_cpu)
    return args


def main(argv=None) -> int:
    args = parse(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    size, layers, batch, prompt, new = args.size, args.layers, args.batch, args.prompt, args.new_tokens
    cfg = config(size, layers, args.attention)
    model = build(cfg, device, torch.bfloat16 if cuda else torch.float32)
    ids = torch.randint(1, cfg.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(1)).to(device)
    gen = generation(new, None if args.mode == "eager" else args.mode)
    print(
        f"hf offload on {device}: Llama {size}, {layers} layers, batch {batch}, prompt {prompt}, {new} new tokens, "
        f"{args.mode}, {args.attention} attention"
    )

    static = StaticCache(config=cfg, max_cache_len=prompt + new)
    want = generate(model, ids, static, gen)
    if not torch.equal(generate(model, ids, static, gen).cpu(), want.cpu()):
        print("hf offload: the reference does not repeat (StaticCache twice gives other tokens)")
        return 1
    static_bytes = sum(t.numel() * t.element_size() for layer in static.layers for t in (layer.keys, layer.values))
    cache = HostOffloadedCache(config=cfg, max_cache_len=prompt + new)
    got = generate(model, ids, cache, gen)
    down, up = cache.bytes_per_step()
    print(
        f"KV on the GPU: static {static_bytes / 2**20:.1f} MiB, HostOffloadedCache {cache.gpu_bytes() / 2**20:.1f} MiB "
        f"(3 slots of {layers}); per decode step {down / 2**20:.1f} MiB host to GPU, {up / 2**10:.1f} KiB per token back"
    )
    if torch.equal(got.cpu(), want.cpu()):
        print(f"hf offload: tokens match ({got.numel()} tokens)")
        return 0
    where = (got.cpu() != want.cpu()).nonzero()[0].tolist()
    print(f"hf offload: MISMATCH, first at sequence {where[0]}, token {where[1]}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
