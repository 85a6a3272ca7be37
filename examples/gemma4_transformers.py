"""Stock transformers Gemma 4 with its per-layer table and its full-attention KV cache in page-locked host memory.

Builds ``Gemma4ForCausalLM`` from a random-weight config at Gemma 4 E2B's text widths on CUDA (a
tiny one on the CPU; nothing is downloaded) and runs compiled ``generate()`` (on CUDA with CUDA
graphs, transformers' default ``mode="reduce-overhead"``) three ways, in one process:

1. ``stock``: the model as built, with transformers' ``StaticCache`` (the reference);
2. ``host``: after the one line
   ``model.set_per_layer_input_embeddings(ple_ops.host_embedding(model.get_per_layer_input_embeddings()))``,
   with a ``StaticCache``;
3. ``host+kv``: that model with kv_ops's ``HostOffloadedCache``, whose GPU budget
   (``max_gpu_bytes``) holds ``--kv-layers`` full-attention layers (default 2): one stays resident
   and the others are streamed from host memory through one shared slot each step.

Gemma 4 E2B's 35 layers put full attention in every fifth, and its last 20 reuse earlier layers'
keys and values, so three full-attention layers own a KV cache; the sliding-window layers stay
on the GPU in both caches. It prints whether the greedy tokens of 2 and 3 equal 1's (the
reference must repeat itself first; exit status 1 otherwise), the GPU memory each change frees
(the table; StaticCache's full-layer KV bytes against the offloaded cache's slots, computed and,
on CUDA, measured with ``torch.cuda.memory_allocated``), the bytes streamed per decode step, and
the decode tokens/s of each run against stock. The last line is ``gemma4 transformers: tokens
match (N tokens)``.

    python examples/gemma4_transformers.py                  # E2B widths on CUDA, a tiny config on the CPU
    python examples/gemma4_transformers.py --config tiny    # anywhere, a minute or two on a CPU

The timed runs alternate (stock, host, host+kv, then the reverse, ...) and the best of each is
compared, since the host-bound decode step follows the host's speed, which drifts.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

# examples/ is first on sys.path when this file runs as a script
from gemma3n_transformers import (
    allocated,
    at_least,
    build,
    generation_config,
    run_arguments,
    run_defaults,
    with_cache,
)
from transformers import StaticCache

import ple_ops
from kv_ops.integrations.transformers import HostOffloadedCache

RUNS = ("stock", "host", "host+kv")


def cache_owners(cfg) -> list[int]:
    """Model indices of the full-attention layers that own a KV cache: the last
    ``num_kv_shared_layers`` layers reuse earlier layers' keys and values and own none."""
    owners = cfg.num_hidden_layers - (cfg.num_kv_shared_layers or 0)
    return [i for i, kind in enumerate(cfg.layer_types[:owners]) if kind == "full_attention"]


def generate(model, ids, cache, gen) -> tuple[torch.Tensor, float]:
    """The greedy new tokens of one generate() on ``cache`` (reset first, as for a new prompt), and its time."""
    cache.reset()
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, **with_cache(cache), generation_config=gen)
    sync()
    return out[:, ids.shape[1] :].cpu(), time.perf_counter() - start


def prefill_bytes(model, ids, cache, device) -> int:
    """The device memory a fresh ``cache`` takes: allocated at its first update, an eager prefill
    here (generate() runs its prefill eagerly too), whose activations are freed by its end."""
    before = allocated(device)
    with torch.no_grad():
        model(ids, **with_cache(cache), use_cache=True)
    grown = allocated(device) - before
    cache.reset()
    return grown


def warm(model, ids, cache, args, device) -> tuple[tuple, list[torch.Tensor]]:
    """Compile (on CUDA also capture) the decode step of both generate() lengths the timing runs;
    the two configs, and the full run's tokens in a list (the timed runs add theirs)."""
    full = generation_config(args.new_tokens, device, args.backend, cache_implementation=None)
    one = generation_config(1, device, args.backend, cache_implementation=None)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    tokens = [generate(model, ids, cache, full)[0]]
    generate(model, ids, cache, one)
    if torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs:
        raise SystemExit("gemma4 transformers: generate() compiled nothing; the timings would be eager ones")
    return (full, one), tokens


def decode_rate(model, ids, cache, configs) -> tuple[torch.Tensor, float]:
    """Greedy new tokens of one compiled generate, and its decode tokens/s (the prefill's time
    taken out: a one-token generate's time is subtracted)."""
    full, one = configs
    t_one = generate(model, ids, cache, one)[1]
    out, t_full = generate(model, ids, cache, full)  # last: the cache is left at a full run's length
    return out, ids.shape[0] * (full.max_new_tokens - 1) / max(t_full - t_one, 1e-9)


def parse(argv):
    """The run's arguments, its device and its model's config; a usage error (exit status 2) for
    anything the run cannot do, before any model is built."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    run_arguments(parser)
    parser.add_argument(
        "--max-cache-len", type=at_least(1), default=None, help="both caches' length; default 4 x (prompt + new tokens)"
    )
    parser.add_argument(
        "--kv-layers", type=at_least(2), default=2, help="full-attention layers the offloaded cache's GPU budget holds"
    )
    # Eager by default: the tokens are compared bit for bit, and sdpa's logits on the GPU need not
    # repeat from one run of the same model to the next with a cache longer than the sequence
    # (the reference itself gave other tokens).
    parser.add_argument(
        "--attention", choices=["eager", "sdpa"], default="eager", help="transformers' attention (default eager)"
    )
    args = parser.parse_args(argv)
    device, cfg = run_defaults(parser, args, "gemma4")
    if args.max_cache_len is None:
        args.max_cache_len = 4 * (args.prompt_len + args.new_tokens)
    if args.max_cache_len < args.prompt_len + args.new_tokens:
        parser.error(f"--max-cache-len: {args.max_cache_len} is below prompt + new tokens")
    return args, device, cfg


def kv_bytes(cache, layers: list[int]) -> int:
    """Bytes of the keys and values that ``cache`` (allocated) holds for ``layers``."""
    return sum(t.numel() * t.element_size() for i in layers for t in (cache.layers[i].keys, cache.layers[i].values))


def to_host(model, device) -> tuple[int, int]:
    """Move ``model``'s per-layer table to page-locked host memory: the table's bytes, and the
    device memory that frees (on CUDA; measured fresh, with no compiled graph holding the table)."""
    table = model.get_per_layer_input_embeddings().weight
    table_bytes = table.numel() * table.element_size()
    del table
    before = allocated(device)
    model.set_per_layer_input_embeddings(ple_ops.host_embedding(model.get_per_layer_input_embeddings()))
    return table_bytes, before - allocated(device)


def main(argv: list[str] | None = None) -> int:
    args, device, cfg = parse(argv)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ids = torch.randint(3, cfg.vocab_size, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    print(
        f"Gemma4ForCausalLM ({args.config}: hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, PLE "
        f"{cfg.hidden_size_per_layer_input}, per-layer vocab {cfg.vocab_size_per_layer_input}), {dtype}, {device}, "
        f"batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, max_cache_len "
        f"{args.max_cache_len}, {args.attention} attention, backend {args.backend}"
    )

    # The stock model is built and compiled first: the host model's conversion is then measured
    # fresh. Both are built from the same seed (the same weights); runs 2 and 3 share the host model.
    models = {name: build(cfg, device, dtype) for name in ("stock", "host")}
    models["host+kv"] = models["host"]
    for model in models.values():
        model.set_attn_implementation(args.attention)
    caches = {name: StaticCache(config=cfg, max_cache_len=args.max_cache_len) for name in ("stock", "host")}
    configs, tokens = {}, {}
    configs["stock"], tokens["stock"] = warm(models["stock"], ids, caches["stock"], args, device)
    table_bytes, table_freed = to_host(models["host"], device)

    # Both caches of the host model are measured at their first (eager) prefill: the sliding
    # layers are the same in both, so the difference is the full-attention layers'. The offloaded
    # cache's GPU budget is --kv-layers of StaticCache's full-attention layers, as allocated.
    static_measured = prefill_bytes(models["host"], ids, caches["host"], device)
    owners = cache_owners(cfg)
    static_full = kv_bytes(caches["host"], owners)
    budget = args.kv_layers * static_full // len(owners)
    caches["host+kv"] = HostOffloadedCache(
        config=cfg, max_cache_len=args.max_cache_len, max_batch_size=args.batch, device=device, max_gpu_bytes=budget
    )
    offload_measured = prefill_bytes(models["host"], ids, caches["host+kv"], device)
    for name in ("host", "host+kv"):
        configs[name], tokens[name] = warm(models[name], ids, caches[name], args, device)

    rates: dict[str, list[float]] = {name: [] for name in RUNS}
    for r in range(args.repeats):
        for name in RUNS if r % 2 == 0 else RUNS[::-1]:
            out, rate = decode_rate(models[name], ids, caches[name], configs[name])
            tokens[name].append(out)
            rates[name].append(rate)

    print(
        f"per-layer table: [{cfg.vocab_size_per_layer_input}, {cfg.num_hidden_layers * cfg.hidden_size_per_layer_input}]"
        f" {dtype}, {table_bytes / 2**20:.1f} MiB"
    )
    if device.type == "cuda":
        print(
            f"GPU memory freed by host_embedding: {table_freed / 2**20:.1f} MiB "
            f"({table_freed / table_bytes:.4f} of the table)"
        )
    print_kv_memory(caches["host+kv"], static_full, static_measured - offload_measured, device)
    print_rates(rates, args.repeats)
    return verdict(tokens, device, table_bytes, table_freed)


def print_kv_memory(offload, static_full: int, measured: int, device) -> None:
    """The full-attention KV lines: which layers own a cache, what the offloaded cache keeps on the
    device, frees and streams."""
    resident = offload.resident()
    streamed = [i for i in offload.offloaded if i not in resident]
    print(
        f"full-attention KV: layers {offload.offloaded} own a cache; HostOffloadedCache keeps {resident} on the "
        f"{device.type} and streams {streamed}; StaticCache holds {static_full / 2**20:.3f} MiB of it there, "
        f"HostOffloadedCache {offload.gpu_bytes() / 2**20:.3f} MiB"
    )
    freed = static_full - offload.gpu_bytes()
    where = "GPU" if device.type == "cuda" else device.type
    measured = f", measured {measured / 2**20:.3f} MiB" if device.type == "cuda" else ""
    print(
        f"{where} memory freed by HostOffloadedCache: {freed / 2**20:.3f} MiB (StaticCache's less gpu_bytes(){measured})"
    )
    down, up = offload.bytes_per_step()
    print(f"streamed per decode step at a run's end: {down / 2**20:.3f} MiB host to {where}, {up / 2**10:.3f} KiB back")


def print_rates(rates: dict[str, list[float]], repeats: int) -> None:
    best = {name: max(rates[name]) for name in RUNS}
    print("| PLE table | full-attention KV | decode tokens/s | ratio to stock |")
    print("| --- | --- | ---: | ---: |")
    print(f"| in the model (stock) | StaticCache | {best['stock']:.1f} | 1.000 |")
    for name, cache in (("host", "StaticCache"), ("host+kv", "HostOffloadedCache")):
        ratio = best[name] / best["stock"]
        print(f"| page-locked host (host_embedding) | {cache} | {best[name]:.1f} | {ratio:.3f} |")
    spread = ", ".join(f"{name} {min(rates[name]) / best[name]:.3f}" for name in RUNS)
    print(f"best of {repeats} alternating runs each; spread (worst/best) {spread}")


def verdict(tokens, device, table_bytes, table_freed) -> int:
    """Exit status: 0 where every run's tokens equal the reference's and the reference repeats itself."""
    want = tokens["stock"][0]
    for r, out in enumerate(tokens["stock"]):
        if not torch.equal(want, out):
            print(f"gemma4 transformers: the reference does not repeat (stock run {r} gives other tokens)")
            print_classes(tokens)
            return 1
    for name in RUNS[1:]:
        for r, out in enumerate(tokens[name]):
            if not torch.equal(want, out):
                differ = (want != out).nonzero()[0].tolist()
                print(
                    f"gemma4 transformers: MISMATCH ({name} run {r}: first at sequence {differ[0]}, token {differ[1]})"
                )
                return 1
    if device.type == "cuda" and abs(table_freed - table_bytes) > 0.01 * table_bytes:
        print("gemma4 transformers: tokens match, but the GPU memory freed is not the table's")
        return 1
    print(f"gemma4 transformers: tokens match ({want.numel()} tokens)")
    return 0


def print_classes(tokens) -> None:
    """Where the reference does not repeat: each run's tokens by class (runs giving equal tokens share
    a letter, run 0 is the warm-up), which tells a warm-up that differs from its replays apart from
    runs that drift."""
    seen: list[torch.Tensor] = []

    def letter(out):
        for i, t in enumerate(seen):
            if torch.equal(t, out):
                return chr(ord("a") + i)
        seen.append(out)
        return chr(ord("a") + len(seen) - 1)

    for name in RUNS:
        print(f"  {name}: runs 0-{len(tokens[name]) - 1} give tokens {' '.join(letter(out) for out in tokens[name])}")


if __name__ == "__main__":
    sys.exit(main())
