"""Decode with transformers' generate(): kv_ops's HostOffloadedCache against transformers' own caches.

One process, one random-weight Llama at Llama-3-8B widths per layer count, greedy decoding from a
random prompt; per cache, side by side: the on-GPU ``static`` cache (compiled with CUDA graphs,
its best mode), transformers' ``offloaded`` and ``offloaded_static`` (eager: neither keeps CUDA
graphs), and ``HostOffloadedCache`` eager and with CUDA graphs (``mode="reduce-overhead"``).
Decode tokens/s is ``batch x (N - 1)`` over a generate of N new tokens less a generate of one (the
prefill taken out), best of ``--reps``. The link floor is the KV bytes a step must move host to GPU
over the same run's pinned memcpy rate. Every cache's tokens are checked against ``static``'s.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, StaticCache

from kv_ops.integrations.transformers import HostOffloadedCache

from common import finish, guard, parse, parser, save  # this script's own directory

# The example's model and generate() settings, loaded by path (it shares this script's name).
_spec = importlib.util.spec_from_file_location(
    "hf_offload_example", Path(__file__).parents[1] / "examples/hf_offload.py"
)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)
build, config, generate, generation = example.build, example.config, example.generate, example.generation

COLUMNS = [
    "layers", "batch", "context", "cache", "mode", "decode_tok_s", "step_ms", "vs_best_transformers_offload",
    "floor_ms", "step_vs_floor", "kv_gpu_mib", "peak_gpu_gib", "h2d_mib_per_step", "tokens_match",
]  # fmt: skip


def memcpy_rate() -> float:
    """Pinned host-to-GPU bytes per second, 256 MiB, best of 5."""
    host = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device="cuda")
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return host.numel() / best


def timed(model, ids, cache, gen) -> tuple[float, torch.Tensor]:
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = generate(model, ids, cache, gen)
    torch.cuda.synchronize()
    return time.perf_counter() - t, out


def decode(model, ids, make_cache, mode, new, reps) -> tuple[float, torch.Tensor, float]:
    """Best decode seconds per step, the tokens, peak GPU GiB (warm-up compiles and captures)."""
    full, one = make(mode, new), make(mode, 1)
    cache = make_cache()
    torch.cuda.reset_peak_memory_stats()
    timed(model, ids, cache, full)  # warm-up: compiles, captures
    timed(model, ids, cache, one)
    best, out = float("inf"), None
    for _ in range(reps):
        t_full, out = timed(model, ids, cache, full)
        t_one, _ = timed(model, ids, cache, one)
        best = min(best, (t_full - t_one) / (new - 1))
    return best, out, torch.cuda.max_memory_allocated() / 2**30


def make(mode, new):
    if isinstance(mode, str) and mode.startswith("transformers:"):
        return GenerationConfig(
            max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None,
            cache_implementation=mode.split(":", 1)[1], disable_compile=True,
        )  # fmt: skip
    return generation(new, mode)


def shape_rows(layers, batch, context, new, reps, rate) -> list[dict]:
    cfg = config("8b", layers)
    model = build(cfg, torch.device("cuda"), torch.bfloat16)
    ids = torch.randint(1, cfg.vocab_size, (batch, context - new), generator=torch.Generator().manual_seed(1)).cuda()
    length = context
    runs = [
        ("static", "cudagraphs", lambda: StaticCache(config=cfg, max_cache_len=length)),
        ("offloaded", "eager", None),
        ("offloaded_static", "eager", None),
        ("HostOffloadedCache", "eager", lambda: HostOffloadedCache(config=cfg, max_cache_len=length)),
        ("HostOffloadedCache", "cudagraphs", lambda: HostOffloadedCache(config=cfg, max_cache_len=length)),
    ]
    rows, want = [], None
    probe = HostOffloadedCache(config=cfg, max_cache_len=length)
    layer_bytes = 2 * batch * cfg.num_key_value_heads * length * cfg.head_dim * 2
    h2d = (layers - 1) * layer_bytes  # what HostOffloadedCache streams per step
    all_bytes = layers * layer_bytes  # what a cache that crosses the link once per step moves
    probe.close()
    for cache, mode, factory in runs:
        gen_mode = None if mode == "eager" else mode
        if factory is None:
            gen_mode, factory = f"transformers:{cache}", lambda: None
        got = guard(
            f"{cache} {mode} at {layers} layers, batch {batch}, {context}",
            decode,
            model,
            ids,
            factory,
            gen_mode,
            new,
            reps,
        )
        if got is None:
            continue
        step, out, peak = got
        want = out if want is None else want
        moved = {"static": 0, "HostOffloadedCache": h2d}.get(cache, all_bytes)
        kv_gpu = {"static": all_bytes, "HostOffloadedCache": min(3, layers) * layer_bytes}.get(cache, 2 * layer_bytes)
        rows.append(
            {
                "layers": layers, "batch": batch, "context": context, "cache": cache, "mode": mode,
                "decode_tok_s": batch / step, "step_ms": step * 1e3, "floor_ms": h2d / rate * 1e3,
                "step_vs_floor": step / (h2d / rate) if h2d else None, "kv_gpu_mib": kv_gpu / 2**20,
                "peak_gpu_gib": peak, "h2d_mib_per_step": moved / 2**20,
                "tokens_match": bool(torch.equal(out.cpu(), want.cpu())),
            }
        )  # fmt: skip
    best_hf = max((r["decode_tok_s"] for r in rows if r["cache"].startswith("offloaded")), default=None)
    for r in rows:
        r["vs_best_transformers_offload"] = r["decode_tok_s"] / best_hf if best_hf else None
    del model
    torch.cuda.empty_cache()
    return rows


def markdown(rows, rate) -> str:
    lines = [
        "# HostOffloadedCache in generate()",
        "",
        f"Random-weight Llama at Llama-3-8B widths, bf16, greedy, 32 new tokens; pinned host-to-GPU memcpy "
        f"{rate / 1e9:.1f} GB/s in this run (the floor's rate). Decode tokens/s; `vs best offload`: over the better "
        "of transformers' offloaded caches; floor: HostOffloadedCache's bytes per step at the memcpy rate.",
        "",
        "| layers | batch | context | cache | mode | tokens/s | step ms | vs best offload | floor ms | step / floor "
        "| KV on GPU MiB | peak GPU GiB | tokens |",
        "| ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        floor = "-" if r["step_vs_floor"] is None else f"{r['step_vs_floor']:.2f}"
        lines.append(
            f"| {r['layers']} | {r['batch']} | {r['context']} | {r['cache']} | {r['mode']} | {r['decode_tok_s']:.0f} "
            f"| {r['step_ms']:.2f} | {r['vs_best_transformers_offload']:.2f} | {r['floor_ms']:.2f} | {floor} "
            f"| {r['kv_gpu_mib']:.0f} | {r['peak_gpu_gib']:.2f} | {'same' if r['tokens_match'] else 'DIFFER'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--shapes", default="8x4x4096", help="LAYERSxBATCHxCONTEXT, comma-separated (default 8x4x4096)")
    p.add_argument("--reps", type=int, default=2, help="timed repetitions per cache (best is kept)")
    args = parse(p, cuda=True, argv=argv)
    rate = memcpy_rate()
    rows = []
    for shape in args.shapes.split(","):
        layers, batch, context = (int(v) for v in shape.split("x"))
        rows += shape_rows(layers, batch, context, 32, args.reps, rate)
    save(args.out, "hf_offload", rows, COLUMNS, table=markdown(rows, rate))
    finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
