"""Decode with transformers' generate(): kv_ops's HostOffloadedCache against transformers' own caches.

One process, one random-weight Llama at Llama-3-8B widths per layer count, greedy decoding from a
random prompt; per shape, side by side: transformers' on-GPU ``static`` cache, its ``offloaded``
and ``offloaded_static`` caches (eager: neither keeps CUDA graphs), and ``HostOffloadedCache``,
eager at every shape, and at the ``--graph-shapes`` also compiled (``fullgraph=True``) and with
CUDA graphs (``mode="reduce-overhead"``), ``static`` likewise. Decode tokens/s is ``batch x (N - 1)`` over a generate of N new tokens less a
generate of one (the prefill taken out), best of ``--reps``.

Floors, from the same run's pinned host-to-GPU memcpy rate: ``floor`` is the bytes
HostOffloadedCache streams per step (every full-attention layer but the one that keeps its slot),
``floor_all`` the whole KV cache crossing the link once. ``copies`` times the cache's own copies
alone (every streamed layer into its slot, back to back on a side stream), and ``target`` is
max(floor, the on-GPU static step of the same mode). Attention is transformers' ``sdpa``, the
fast one; its decode logits do not repeat bit for bit from run to run at these widths, so tokens
are not compared here: examples/hf_offload.py (eager attention) checks them bit for bit.
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

NEW = 32
COLUMNS = [
    "layers", "batch", "context", "cache", "mode", "decode_tok_s", "step_ms", "vs_best_transformers_offload",
    "floor_ms", "floor_all_ms", "copies_ms", "target_ms", "step_vs_target", "kv_gpu_mib", "kv_gpu_saved_mib",
    "peak_gpu_gib", "h2d_mib_per_step",
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


def decode(model, ids, make_cache, mode, reps) -> tuple[float, float]:
    """Best decode seconds per step, peak GPU GiB (warm-up compiles and captures)."""
    full, one = make(mode, NEW), make(mode, 1)
    cache = make_cache()
    torch.cuda.reset_peak_memory_stats()
    timed(model, ids, cache, full)  # warm-up: compiles, captures
    timed(model, ids, cache, one)
    best = float("inf")
    for _ in range(reps):
        t_full, _ = timed(model, ids, cache, full)
        t_one, _ = timed(model, ids, cache, one)
        best = min(best, (t_full - t_one) / (NEW - 1))
    if hasattr(cache, "close"):
        cache.close()
    return best, torch.cuda.max_memory_allocated() / 2**30


def make(mode, new):
    if mode.startswith("transformers:"):
        return GenerationConfig(
            max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None,
            cache_implementation=mode.split(":", 1)[1], disable_compile=True,
        )  # fmt: skip
    return generation(new, None if mode == "eager" else mode)


def copies_alone(layer_bytes: int, streamed: int, reps: int = 5) -> float:
    """Seconds for the cache's copies of one step alone: ``streamed`` layers, back to back."""
    host = torch.empty(layer_bytes, dtype=torch.uint8).pin_memory()
    slot = torch.empty(layer_bytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[0])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        with torch.cuda.stream(stream):
            start.record()
            for _ in range(streamed):
                slot.copy_(host, non_blocking=True)
            end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def shape_rows(layers, batch, context, reps, rate, graphs: bool) -> list[dict]:
    cfg = config("8b", layers)
    model = build(cfg, torch.device("cuda"), torch.bfloat16)
    ids = torch.randint(1, cfg.vocab_size, (batch, context - NEW), generator=torch.Generator().manual_seed(1)).cuda()

    def static():
        return StaticCache(config=cfg, max_cache_len=context)

    def ours():
        return HostOffloadedCache(config=cfg, max_cache_len=context)

    modes = ["eager", "compiled", "cudagraphs"] if graphs else ["eager"]
    runs = [("static", m, static) for m in modes]
    runs += [("offloaded", "transformers:offloaded", None), ("offloaded_static", "transformers:offloaded_static", None)]
    runs += [("HostOffloadedCache", m, ours) for m in modes]
    layer_bytes = 2 * batch * cfg.num_key_value_heads * context * cfg.head_dim * 2
    h2d = (layers - 1) * layer_bytes  # what HostOffloadedCache streams per step
    all_bytes = layers * layer_bytes  # what a cache that crosses the link once per step moves
    floor, floor_all = h2d / rate, all_bytes / rate
    copies = copies_alone(layer_bytes, layers - 1)
    rows, reference = [], {}
    for cache, mode, factory in runs:
        where = f"{cache} {mode} at {layers} layers, batch {batch}, context {context}"
        got = guard(where, decode, model, ids, factory or (lambda: None), mode, reps)
        if got is None:
            continue
        step, peak = got
        shown = "eager" if mode.startswith("transformers:") else mode
        if cache == "static":
            reference[mode] = step
        base_step = reference.get(shown)
        moved = {"static": 0, "HostOffloadedCache": h2d}.get(cache, all_bytes)
        kv_gpu = {"static": all_bytes, "HostOffloadedCache": min(3, layers) * layer_bytes}.get(cache, 2 * layer_bytes)
        target = max(floor, base_step) if base_step is not None else floor
        rows.append(
            {
                "layers": layers, "batch": batch, "context": context, "cache": cache, "mode": shown,
                "decode_tok_s": batch / step, "step_ms": step * 1e3, "floor_ms": floor * 1e3,
                "floor_all_ms": floor_all * 1e3, "copies_ms": copies * 1e3, "target_ms": target * 1e3,
                "step_vs_target": step / target if cache == "HostOffloadedCache" else None,
                "kv_gpu_mib": kv_gpu / 2**20, "kv_gpu_saved_mib": (all_bytes - kv_gpu) / 2**20,
                "peak_gpu_gib": peak, "h2d_mib_per_step": moved / 2**20,
            }
        )  # fmt: skip
    best_hf = max((r["decode_tok_s"] for r in rows if r["cache"].startswith("offloaded")), default=None)
    for r in rows:
        r["vs_best_transformers_offload"] = r["decode_tok_s"] / best_hf if best_hf else None
    del model
    torch.cuda.empty_cache()
    return rows


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(rows, rate) -> str:
    lines = [
        "# HostOffloadedCache in generate()",
        "",
        f"Random-weight Llama at Llama-3-8B widths, bf16, greedy, {NEW} new tokens, sdpa attention; pinned "
        f"host-to-GPU memcpy {rate / 1e9:.1f} GB/s in this run. Decode tokens/s; `vs offload`: over the better of "
        "transformers' offloaded caches at the shape; floor: HostOffloadedCache's bytes per step at the memcpy rate "
        "(all: the whole KV cache once); copies: the cache's copies alone; target: max(floor, static's step in the "
        "same mode).",
        "",
        "| layers | batch | context | cache | mode | tokens/s | step ms | vs offload | floor / all / copies ms "
        "| step / target | KV on GPU MiB | saved MiB |",
        "| ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['layers']} | {r['batch']} | {r['context']} | {r['cache']} | {r['mode']} | {r['decode_tok_s']:.0f} "
            f"| {r['step_ms']:.2f} | {fmt(r['vs_best_transformers_offload'], '.2f')} "
            f"| {r['floor_ms']:.2f} / {r['floor_all_ms']:.2f} / {r['copies_ms']:.2f} "
            f"| {fmt(r['step_vs_target'], '.2f')} | {r['kv_gpu_mib']:.0f} | {r['kv_gpu_saved_mib']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows, path) -> None:
    import matplotlib.pyplot as plt

    shapes = sorted({(r["layers"], r["batch"], r["context"]) for r in rows})
    series = sorted({(r["cache"], r["mode"]) for r in rows})
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(shapes)), 4))
    width = 0.8 / len(series)
    for i, (cache, mode) in enumerate(series):
        got = {
            (r["layers"], r["batch"], r["context"]): r["decode_tok_s"]
            for r in rows
            if (r["cache"], r["mode"]) == (cache, mode)
        }
        xs = [j + i * width for j, s in enumerate(shapes) if s in got]
        ax.bar(xs, [got[s] for s in shapes if s in got], width, label=f"{cache} ({mode})")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
    ax.set_xticklabels([f"{n} layers\nbatch {b}, {c // 1024}k" for n, b, c in shapes])
    ax.set_ylabel("decode tokens/s")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument(
        "--shapes",
        default="8x1x4096,8x4x4096,8x16x2048,8x4x16384,8x1x32768,32x4x4096",
        help="LAYERSxBATCHxCONTEXT, comma-separated: every cache eager, transformers' offloaded caches",
    )
    p.add_argument(
        "--graph-shapes", default="8x4x4096,32x4x4096", help="the shapes that also run compiled and with CUDA graphs"
    )
    p.add_argument("--reps", type=int, default=2, help="timed repetitions per cache (best is kept)")
    args = parse(p, cuda=True, argv=argv)
    rate = memcpy_rate()
    graph_shapes = set(args.graph_shapes.split(",")) if args.graph_shapes else set()
    rows = []
    for shape in args.shapes.split(","):
        layers, batch, context = (int(v) for v in shape.split("x"))
        rows += shape_rows(layers, batch, context, args.reps, rate, shape in graph_shapes)
    save(args.out, "hf_offload", rows, COLUMNS, table=markdown(rows, rate), plot=plot)
    finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
