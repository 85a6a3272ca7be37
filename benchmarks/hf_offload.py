"""Decode with transformers' generate(): kv_ops's HostOffloadedCache against transformers' own caches.

One process, one random-weight Llama at Llama-3-8B widths per layer count, greedy decoding from a
random prompt, sized the way a static cache is sized: ``max_cache_len`` at 1x, 4x or 8x the
sequence. Per shape, side by side: transformers' on-GPU ``static`` cache, its ``offloaded`` and
``offloaded_static`` caches (eager: neither keeps CUDA graphs), ``HostOffloadedCache``, and at the
``--graph-shapes`` also with CUDA graphs (``mode="reduce-overhead"``), static and ours alike, and
ours with a GPU budget for half the layers (``max_gpu_bytes``), ours with its step captured while
the matmuls leave the copy kernels their SMs (cuBLASLt's SM carveout, as README's layer-wise
section offers: what SM sharing costs the loads), and ours with ``load_ahead=True`` (the next
step's first loads queued by the step before: what loading ahead gains, in the same run).
Decode tokens/s is ``batch x (N - 1)`` over a generate of N new tokens less a generate of one
(the prefill taken out), best of ``--reps``. The eager runs of a shape take turns rep by rep, so
that a slow stretch of the host's time (an eager step is the host's launches) falls on every
cache alike, and each eager cache's step over StaticCache's of the same turn, median over the
turns, is kept beside the best of each (``paired_vs_static``); the CUDA-graph runs go one after
another, each compiled step warmed up and timed on its own.

Floor: the bytes HostOffloadedCache streams per step (the positions in use of every streamed
layer in, one new position of each out, at the decode's mean length) at the same run's pinned
host-to-GPU memcpy rate; target: max(floor, the on-GPU static step at the same ``max_cache_len``
and mode). Host time per layer update, eager: ``Cache.update`` of a decode token over every
layer, p50 of 24 steps with the GPU idle between steps, StaticCache's and ours taking turns step
by step, and ours' excess, the p50 of the two's paired differences (a slow stretch of the host's
time falls on both steps of a pair); and ours piece by piece, p50 per call: transformers' own
``StaticLayer.update`` on the cache's layer, the capture check, a streamed layer's event wait,
and one queued load (two events and a graph launch). With CUDA graphs, each step split in two
(one more generate(), CUDA events around each call of the compiled step): the step's call, and
generate()'s own work between calls, which no load inside a captured step can overlap (the loads
queued ahead can). And one step's loads alone, no layer computing beside them (:func:`loads_alone`):
the copies' own rate, against the memcpy's. With ``--timeline``, static's and ours' runs (with
and without ``load_ahead``) are also profiled (torch.profiler, one generate of one token and one
of N): per decode step, how long the copy kernels and the other kernels kept the GPU busy, how
long both ran at once (benchmarks/timeline.py), and how long no load was under way (the step's
boundary); ours' kernels are kept per mode, for a closer look.
``--merge`` adds an earlier run's CSV rows (other shapes, each with its own run's rate and
references) to this run's table, in the shapes' order, for a sweep split over several processes.
The CSV is written after every shape, so a run stopped partway leaves the shapes it finished.
Attention is transformers' ``sdpa``; its decode logits do not repeat bit for bit from run to run
at these widths, so tokens are not compared here: examples/hf_offload.py (eager attention)
checks them bit for bit.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, StaticCache
from transformers.cache_utils import StaticLayer

from kv_ops.cuda.capture import capturing
from kv_ops.cuda.launch import NUM_PROGRAMS
from kv_ops.integrations.transformers import HostOffloadedCache

import timeline
from common import at_least_one, finish, guard, matmuls_leave_sms, parse, parser, save  # this script's own directory
from report import card, write_csv

# The example's model and generate() settings, loaded by path (it shares this script's name);
# examples/ goes on sys.path for what the example imports from its neighbours, as when it runs.
_examples = Path(__file__).parents[1] / "examples"
sys.path.append(str(_examples))
_spec = importlib.util.spec_from_file_location("hf_offload_example", _examples / "hf_offload.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)
build, config, generate, generation, with_cache = (
    example.build,
    example.config,
    example.generate,
    example.generation,
    example.with_cache,
)

NEW = 32
CARVEOUT = ", matmuls leave the copies' SMs"  # the run captured with cuBLASLt's SM carveout
AHEAD = "HostOffloadedCache, load ahead"  # the run with load_ahead=True
COLUMNS = [
    "gpu", "layers", "batch", "sequence", "capacity", "context", "cache", "mode", "memcpy_gbs", "decode_tok_s", "step_ms",
    "vs_best_transformers_offload", "floor_ms", "target_ms", "step_vs_target", "kv_gpu_mib", "kv_gpu_saved_mib",
    "peak_gpu_gib", "mib_per_step", "update_host_us", "static_update_host_us", "update_excess_us",
    "part_layer_us", "part_check_us", "part_wait_us", "part_issue_us", "streamed_layers", "loads_alone_ms", "loads_alone_mib", "call_ms", "between_ms",
    "kernels_span_ms", "copies_busy_ms", "others_busy_ms", "both_busy_ms", "loads_span_ms", "paired_vs_static",
]  # fmt: skip
BUSY = ("span", "copies", "others", "both", "loads_span")  # timeline.per_step's keys, in the columns below
KERNEL_COLUMNS = ("kernels_span", "copies_busy", "others_busy", "both_busy", "loads_span")
PARTS = ("layer", "check", "wait", "issue")


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
    if cache is not None:
        cache.reset()  # generate() continues a cache it is handed: each run starts from the prompt
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = generate(model, ids, cache, gen)
    torch.cuda.synchronize()
    return time.perf_counter() - t, out


def warmed(model, ids, make_cache, mode, held: int):
    """A cache made by ``make_cache`` and warmed up (compiled, captured), a timer of one decode
    rep (seconds per step), and the GPU GiB the warm-up peaked at, less ``held`` bytes that other
    runs' live caches take."""
    full, one = make(mode, NEW), make(mode, 1)
    cache = make_cache()
    torch.cuda.reset_peak_memory_stats()
    timed(model, ids, cache, full)
    timed(model, ids, cache, one)
    peak = (torch.cuda.max_memory_allocated() - held) / 2**30

    def once() -> float:
        t_full, _ = timed(model, ids, cache, full)
        t_one, _ = timed(model, ids, cache, one)
        return (t_full - t_one) / (NEW - 1)

    return cache, once, peak


def cuda_timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def step_split(model, ids, cache, gen, event=cuda_timing_event) -> tuple[float, float]:
    """Seconds per decode step of one generate() on ``cache``, medians: the compiled step's call,
    from before it is launched to its end on the GPU, and the time from one call's end to the next
    one's start, when only generate()'s own work runs. Events (``event()``) are recorded around
    each call of the step transformers compiled (``model.get_compiled_call``), in stream order."""
    marks, compiled_call = [], model.get_compiled_call

    def clocked(compile_config):
        step = compiled_call(compile_config)

        def call(*args, **kwargs):
            before, after = event(), event()
            before.record()
            out = step(*args, **kwargs)
            after.record()
            marks.append((before, after))
            return out

        return call

    model.get_compiled_call = clocked  # generate() asks for its compiled step here
    try:
        generate(model, ids, cache, gen)
    finally:
        del model.get_compiled_call
    if len(marks) < 2:
        raise RuntimeError(f"generate() called a compiled step {len(marks)} times: no decode step to split")
    marks[-1][1].synchronize()
    calls = [before.elapsed_time(after) for before, after in marks]
    between = [after.elapsed_time(before) for (_, after), (before, _) in zip(marks, marks[1:])]
    return statistics.median(calls) / 1e3, statistics.median(between) / 1e3


def best_in_turns(timers: dict, reps: int, what=str, turns: dict | None = None) -> dict:
    """The best of ``reps`` calls of each timer, the timers taking turns rep by rep. A timer that
    raises is reported as ``what(key)`` (:func:`common.guard`) and drops out; the others go on.
    ``turns``, where given, gets every timer's calls in order (key -> list)."""
    best = dict.fromkeys(timers, float("inf"))
    for _ in range(reps):
        for key in list(best):
            got = guard(what(key), timers[key])
            if got is None:
                del best[key]
            else:
                best[key] = min(best[key], got)
                if turns is not None:
                    turns.setdefault(key, []).append(got)
    return best


def paired(turns: dict, reference) -> dict:
    """Per timer of ``turns`` (:func:`best_in_turns`'s), the median over turns of its call over the
    ``reference`` timer's call of the same turn: where the host's speed drifts from turn to turn,
    each ratio compares calls made moments apart (the best of each can come from different turns)."""
    base = turns.get(reference, [])
    return {
        key: statistics.median(t / b for t, b in zip(times, base))
        for key, times in turns.items()
        if key != reference and base and times
    }


def make(mode, new):
    if mode.startswith("transformers:"):
        return GenerationConfig(
            max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None,
            cache_implementation=mode.split(":", 1)[1], disable_compile=True,
        )  # fmt: skip
    return generation(new, None if mode == "eager" else mode)


def host_p50_us(piece, reps: int) -> float:
    """Host microseconds of ``piece()``, p50 over ``reps`` calls, the GPU idle before each."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        piece()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def decode_token(model, ids, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode token's keys and values for ``cache``, after a prefill of ``ids`` through the model."""
    with torch.no_grad():
        model(ids, **with_cache(cache), use_cache=True)
    cfg = model.config
    shape = (ids.shape[0], cfg.num_key_value_heads, 1, cfg.head_dim)
    return torch.randn(shape, device="cuda", dtype=torch.bfloat16), torch.randn(
        shape, device="cuda", dtype=torch.bfloat16
    )


def update_host_us(model, ids, static, ours, reps: int = NEW - 8) -> tuple[float, float, float]:
    """Host microseconds per layer of ``static``'s and ``ours``' ``update`` with a decode token (p50
    over ``reps`` steps of every layer), after a prefill through the model, and ours' excess: the
    p50 over the reps of ours' step less static's step of the same rep. The two take turns step by
    step, so a slow stretch of the host's time falls on both steps of a rep and cancels in their
    difference, which the difference of the two p50s does not do. Each step writes one position
    more: at 1x ``max_cache_len`` the prompt leaves ``NEW`` of them."""
    layers = model.config.num_hidden_layers
    steps = []
    for cache in (static, ours):
        k, v = decode_token(model, ids, cache)

        def step(cache=cache, k=k, v=v):
            for layer in range(layers):
                cache.update(k, v, layer)

        steps.append(step)
    pairs = [(host_p50_us(steps[0], 1), host_p50_us(steps[1], 1)) for _ in range(reps)]
    excess = statistics.median(b - a for a, b in pairs)
    return (
        statistics.median(a for a, _ in pairs) / layers,
        statistics.median(b for _, b in pairs) / layers,
        excess / layers,
    )


def update_parts_us(model, ids, cache: HostOffloadedCache, reps: int = 20) -> dict[str, float]:
    """Host microseconds per call of each piece of ``cache``'s eager layer update (p50 over
    ``reps``), after a prefill through the model."""
    k, v = decode_token(model, ids, cache)
    loads, layer = cache.loads, cache.layers[cache.offloaded[0]]
    streamed = loads.plan.streamed[0]
    return {
        "layer": host_p50_us(lambda: StaticLayer.update(layer, k, v), reps),  # what StaticCache's update does
        "check": host_p50_us(lambda: capturing(k.device), reps),
        "wait": host_p50_us(lambda: loads.wait(streamed), reps),
        "issue": host_p50_us(lambda: loads.issue(streamed), reps),
    }


def loads_alone(model, ids, cache: HostOffloadedCache, reps: int = 5, event=cuda_timing_event) -> tuple[float, int]:
    """One step's loads with no layer computing beside them, after a prefill of ``ids``: every
    streamed layer's positions in use moved by its bound copy, back to back on the load stream
    (on the CPU by the reference); the best seconds of ``reps`` and the bytes they move. Each rep
    first empties the shared slots' holder words, or a load's claim would find its layer there
    and move nothing; an untimed first rep also writes back what the prefill left in the slots."""
    with torch.no_grad():
        model(ids, **with_cache(cache), use_cache=True)
    loads = cache.loads
    plan = loads.plan
    shared = sorted({plan.slot[k] for k in plan.streamed})
    lengths = [int(n) for n in loads.lengths]
    slot_k, slot_v = loads.slots[shared[0]]
    per_position = sum(t[:, :, :1].numel() * t.element_size() for t in (slot_k, slot_v))
    best = float("inf")
    for rep in range(reps + 1):
        loads.held[shared] = -1
        start, end = event(), event()
        if loads.stream is None:
            start.record()
            for k in plan.streamed:
                loads.load_now(k, *loads.slots[plan.slot[k]], lengths[k], lengths[plan.evicts[k]])
            end.record()
        else:
            torch.cuda.synchronize()
            with torch.cuda.stream(loads.stream):
                start.record()
            for k in plan.streamed:
                loads.issue(k)
            with torch.cuda.stream(loads.stream):
                end.record()
        end.synchronize()
        if rep:
            best = min(best, start.elapsed_time(end) / 1e3)
    return best, sum(lengths[k] for k in plan.streamed) * per_position


def facts(cache):
    """(streamed layers, GPU bytes) of a HostOffloadedCache; None for another cache."""
    return (len(cache.loads.plan.streamed), cache.gpu_bytes()) if isinstance(cache, HostOffloadedCache) else None


def copy_launches(cache) -> int | None:
    """Copy kernels a HostOffloadedCache launches per decode step (None for another cache): one per
    streamed layer, and with ``load_ahead`` one more per first load, the step's own, which the
    claim leaves with nothing to move (the step before loaded that layer ahead)."""
    if not isinstance(cache, HostOffloadedCache):
        return None
    plan = cache.loads.plan
    return len(plan.streamed) + (len(plan.issues.get(0, ())) if cache.load_ahead else 0)


def kernel_time(model, ids, cache, mode, what: str, keep: Path | None = None) -> dict | None:
    """:func:`timeline.per_step` of generate() on ``cache`` in ``mode`` (the kernels of its long run
    kept in ``keep``, where given; the loads' span per step for ours); None where it failed."""
    return guard(
        f"{what}: the kernels' timeline",
        timeline.per_step, lambda n: timed(model, ids, cache, make(mode, n)), 1, NEW, keep, copy_launches(cache),
    )  # fmt: skip


def measure(model, ids, runs, reps, where, profiled=(), keep=None) -> dict:
    """``run -> (best seconds per step, peak GPU GiB, facts(cache), split, kernels, paired)`` for each
    run that did not fail, ``split`` being :func:`step_split`'s for a CUDA-graph run, else None,
    ``paired`` an eager run's :func:`paired` ratio to static's eager step (else None), and
    ``kernels`` :func:`kernel_time`'s for a run whose cache is named in ``profiled``, else None;
    the kernels of ours are kept in ``keep(run)``, where given.
    The eager runs are all warmed up, then take turns; the CUDA-graph runs go one by one after
    them, each cache closed before the next (its compiled step then passes to the next
    HostOffloadedCache, as in serving)."""
    measured, warm, held, start = {}, {}, 0, torch.cuda.memory_allocated()

    def kernels_of(run, cache) -> dict | None:  # --timeline's figures of a profiled run, ours' kernels kept
        if run[0] not in profiled:
            return None
        kept = keep(run) if keep else None
        return kernel_time(model, ids, cache, run[1], where(run), kept)

    for run in [r for r in runs if r[1] != "cudagraphs"]:
        got = guard(where(run), warmed, model, ids, run[2] or (lambda: None), run[1], held)
        if got is not None:
            warm[run] = got
            held = torch.cuda.memory_allocated() - start  # what the caches warmed so far hold
    turns: dict = {}
    best = best_in_turns({run: once for run, (_, once, _) in warm.items()}, reps, where, turns)
    ratios = paired(turns, next((run for run in warm if run[:2] == ("static", "eager")), None))
    for run, step in best.items():
        measured[run] = (step, warm[run][2], facts(warm[run][0]), None, kernels_of(run, warm[run][0]), ratios.get(run))
    for cache, _, _ in warm.values():
        if hasattr(cache, "close"):
            cache.close()
    del warm  # the eager caches' memory is free for the graph runs
    for run in [r for r in runs if r[1] == "cudagraphs"]:
        with matmuls_leave_sms(NUM_PROGRAMS if run[0].endswith(CARVEOUT) else None):  # captured under it
            got = guard(where(run), warmed, model, ids, run[2], run[1], 0)
            if got is None:
                continue
            cache, once, peak = got
            steps = [step for step in (guard(where(run), once) for _ in range(reps)) if step is not None]
            split = guard(
                f"{where(run)}: the step's call and the work between", step_split, model, ids, cache, make(run[1], NEW)
            )
            kernels = kernels_of(run, cache)
        if steps:
            measured[run] = (min(steps), peak, facts(cache), split, kernels, None)
        if hasattr(cache, "close"):
            cache.close()
        del cache, once
    return measured


def shape_rows(layers, batch, sequence, capacity, reps, rate, graphs: bool, profile: Path | None = None) -> list[dict]:
    """The rows of one shape; ``profile``, where given, is the folder for ``--timeline``'s kernels."""
    cfg = config("8b", layers)
    model = build(cfg, torch.device("cuda"), torch.bfloat16)
    context = capacity * sequence  # max_cache_len, as a static cache is sized
    ids = torch.randint(1, cfg.vocab_size, (batch, sequence - NEW), generator=torch.Generator().manual_seed(1)).cuda()
    per_position = 2 * batch * cfg.num_key_value_heads * cfg.head_dim * 2  # K and V, bf16
    layer_bytes = per_position * context
    half = (layers // 2 + 2) * layer_bytes  # half the layers resident, beside the two shared slots

    def factory(cls, **kw):
        return lambda: cls(config=cfg, max_cache_len=context, **kw)

    def where(run) -> str:
        return f"{run[0]} {run[1]} at {layers} layers, batch {batch}, sequence {sequence}, max_cache_len {context}"

    modes = ["eager", "cudagraphs"] if graphs else ["eager"]
    runs = [("static", m, factory(StaticCache)) for m in modes]
    runs += [("offloaded", "transformers:offloaded", None), ("offloaded_static", "transformers:offloaded_static", None)]
    runs += [("HostOffloadedCache", m, factory(HostOffloadedCache)) for m in modes]
    # The same cache with each step's first loads queued by the step before: what loading ahead gains.
    runs += [(AHEAD, m, factory(HostOffloadedCache, load_ahead=True)) for m in modes]
    if graphs:
        runs += [
            ("HostOffloadedCache, half resident", m, factory(HostOffloadedCache, max_gpu_bytes=half)) for m in modes
        ]
        # Last, since a later cache's step may replay its recording: the same cache, its step
        # captured with the matmuls leaving the copy kernels their SMs (what SM sharing costs).
        runs += [(f"HostOffloadedCache{CARVEOUT}", "cudagraphs", factory(HostOffloadedCache))]
    static_us, ours_us, excess_us = update_host_us(
        model,
        ids,
        StaticCache(config=cfg, max_cache_len=context),
        HostOffloadedCache(config=cfg, max_cache_len=context),
    )
    parts = update_parts_us(model, ids, HostOffloadedCache(config=cfg, max_cache_len=context))
    alone = guard(
        f"the loads alone at {layers} layers, batch {batch}, max_cache_len {context}",
        loads_alone, model, ids, HostOffloadedCache(config=cfg, max_cache_len=context),
    )  # fmt: skip
    profiled = ("static", "HostOffloadedCache", AHEAD) if profile else ()

    def keep(run) -> Path | None:  # where --timeline keeps ours' kernels in this run's mode
        if not run[0].startswith("HostOffloadedCache"):
            return None
        tag = "_ahead" if run[0] == AHEAD else ""
        return profile / f"hf_offload_kernels_{layers}x{batch}x{sequence}x{capacity}{tag}_{run[1]}.json.gz"

    measured = measure(model, ids, runs, reps, where, profiled, keep if profile else None)
    all_bytes = layers * layer_bytes
    mean_positions = sequence - NEW + NEW // 2  # the decode's mean length
    rows, reference = [], {}
    for run in runs:
        if run not in measured:
            continue
        cache, mode, _ = run
        step, peak, held, split, kernels, ratio = measured[run]
        shown = "eager" if mode.startswith("transformers:") else mode
        if cache == "static":
            reference[mode] = step
        base_step = reference.get(shown)
        streamed = held[0] if held is not None else 0
        moved = streamed * (mean_positions + 1) * per_position
        if cache == "static":
            kv_gpu = all_bytes
        elif held is not None:
            kv_gpu = held[1]
        else:  # transformers' offloaded caches hold two layers on the GPU, at the sequence's length
            kv_gpu = 2 * per_position * sequence
        floor = moved / rate
        pieces = cache == "HostOffloadedCache" and shown == "eager"
        target = max(floor, base_step) if base_step is not None else floor
        rows.append(
            {
                "gpu": torch.cuda.get_device_name(), "layers": layers, "batch": batch, "sequence": sequence,
                "capacity": capacity, "context": context, "cache": cache, "mode": shown, "memcpy_gbs": rate / 1e9, "decode_tok_s": batch / step,
                "step_ms": step * 1e3,
                "floor_ms": floor * 1e3, "target_ms": target * 1e3,
                "step_vs_target": step / target if held is not None else None,
                "kv_gpu_mib": kv_gpu / 2**20, "kv_gpu_saved_mib": (all_bytes - kv_gpu) / 2**20,
                "peak_gpu_gib": peak, "mib_per_step": moved / 2**20,
                "update_host_us": ours_us if cache == "HostOffloadedCache" and shown == "eager" else None,
                "static_update_host_us": static_us if cache == "static" and shown == "eager" else None,
                "update_excess_us": excess_us if pieces else None,
                **{f"part_{name}_us": parts[name] if pieces else None for name in PARTS},
                "streamed_layers": streamed if pieces else None,
                "loads_alone_ms": alone[0] * 1e3 if pieces and alone else None,
                "loads_alone_mib": alone[1] / 2**20 if pieces and alone else None,
                "call_ms": split[0] * 1e3 if split else None, "between_ms": split[1] * 1e3 if split else None,
                **{f"{c}_ms": kernels.get(key) if kernels else None for key, c in zip(BUSY, KERNEL_COLUMNS)},
                "paired_vs_static": ratio,
            }
        )  # fmt: skip
    best_hf = max((r["decode_tok_s"] for r in rows if r["cache"].startswith("offloaded")), default=None)
    for r in rows:
        r["vs_best_transformers_offload"] = r["decode_tok_s"] / best_hf if best_hf else None
    del model
    torch._dynamo.reset()  # the next shape compiles afresh, within dynamo's recompile limit
    torch.cuda.empty_cache()
    return rows


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def shape_key(row: dict) -> tuple:
    """A row's shape, the table's order: layers, batch, sequence, max_cache_len."""
    return row["layers"], row["batch"], row["sequence"], row["context"]


def read_rows(path: Path) -> list[dict]:
    """An earlier run's rows from its CSV, typed as this script writes them (empty cells: None)."""

    def typed(value: str):
        if value == "":
            return None
        for kind in (int, float):
            try:
                return kind(value)
            except ValueError:
                pass
        return value

    with open(path, newline="") as f:
        return [{k: typed(v) for k, v in row.items()} for row in csv.DictReader(f)]


def statics(rows, column: str, *keys: str) -> dict:
    """Static's ``column`` by shape (layers, batch, max_cache_len, then ``keys``), where it has one."""
    shape = ("layers", "batch", "context", *keys)
    return {tuple(r[k] for k in shape): r[column] for r in rows if r["cache"] == "static" and r.get(column) is not None}


def markdown(rows) -> str:
    rates = sorted({round(r["memcpy_gbs"], 1) for r in rows if r.get("memcpy_gbs") is not None})
    rate = "-".join(str(v) for v in sorted({rates[0], rates[-1]})) if rates else "?"
    lines = [
        "# HostOffloadedCache in generate()",
        "",
        f"Random-weight Llama at Llama-3-8B widths, bf16, greedy, {NEW} new tokens, sdpa attention; pinned "
        f"host-to-GPU memcpy {rate} GB/s, measured in each shape's own run. Decode tokens/s; `vs offload`: "
        "over the better of transformers' offloaded caches at the shape; floor: HostOffloadedCache's bytes per step at the memcpy rate; "
        "target: max(floor, static's step at the same max_cache_len and mode); update us: host time per layer "
        "update, eager.",
        "",
        "| GPU | layers | batch | sequence | max_cache_len | cache | mode | tokens/s | step ms | vs offload "
        "| floor ms | step / target | MiB per step | KV on GPU MiB | update us |",
        "| --- | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        update = r["update_host_us"] if r["update_host_us"] is not None else r["static_update_host_us"]
        lines.append(
            f"| {card(r['gpu'])} | {r['layers']} | {r['batch']} | {r['sequence']} | {r['context']} | {r['cache']} "
            f"| {r['mode']} "
            f"| {r['decode_tok_s']:.0f} | {r['step_ms']:.2f} | {fmt(r['vs_best_transformers_offload'], '.2f')} "
            f"| {r['floor_ms']:.2f} | {fmt(r['step_vs_target'], '.2f')} | {r['mib_per_step']:.0f} "
            f"| {r['kv_gpu_mib']:.0f} | {fmt(update, '.1f')} |"
        )
    lines += [
        "",
        "Eager update, host us per layer: StaticCache's beside ours, and ours piece by piece (p50 per call): "
        "transformers' `StaticLayer.update` on the cache's layer, the capture check, then per step one event "
        "wait and one queued load per streamed layer; excess: the p50 of ours' step less static's, taken in "
        "turns, per layer (in a run from before that pairing, the two p50s' difference).",
        "",
        "| layers | batch | max_cache_len | StaticCache | HostOffloadedCache | layer | check | wait | load "
        "| streamed | excess / layer |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    static = statics(rows, "static_update_host_us")
    for r in rows:
        if r["part_layer_us"] is None:
            continue
        base = static.get((r["layers"], r["batch"], r["context"]))
        excess = r.get("update_excess_us")  # paired per step; a run from before it: the medians' difference
        if excess is None and base is not None:
            excess = r["update_host_us"] - base
        lines.append(
            f"| {r['layers']} | {r['batch']} | {r['context']} | {fmt(base, '.1f')} | {r['update_host_us']:.1f} "
            f"| {r['part_layer_us']:.1f} | {r['part_check_us']:.1f} | {r['part_wait_us']:.1f} "
            f"| {r['part_issue_us']:.1f} | {r['streamed_layers']} | {fmt(excess, '.1f')} |"
        )
    return "\n".join(lines + paired_table(rows) + loads_table(rows) + split_table(rows) + kernels_table(rows)) + "\n"


def sub_table(rows, column: str, caption: str, columns: str, aligns: str, line) -> list[str]:
    """A table under the one before it: its caption, header and ``line(row)`` for every row that has
    ``column``; nothing where no row has it (a run from before it was measured)."""
    have = [r for r in rows if r.get(column) is not None]
    return ["", caption, "", columns, aligns, *map(line, have)] if have else []


def paired_table(rows) -> list[str]:
    """The eager runs' steps over StaticCache's, turn by turn (:func:`paired`)."""
    static = statics(rows, "step_ms", "mode")

    def line(r: dict) -> str:
        base = static.get((r["layers"], r["batch"], r["context"], "eager"))
        return (
            f"| {r['layers']} | {r['batch']} | {r['context']} | {r['cache']} | {r['paired_vs_static']:.3f} "
            f"| {fmt(r['step_ms'] / base if base else None, '.3f')} |"
        )

    return sub_table(
        rows,
        "paired_vs_static",
        "Eager, paired: each cache's step over StaticCache's eager step of the same turn, median over the "
        "turns (where the host's speed drifts between turns, steadier than the best of each).",
        "| layers | batch | max_cache_len | cache | over static, paired | over static, best of each |",
        "| ---: | ---: | ---: | --- | ---: | ---: |",
        line,
    )


def loads_table(rows) -> list[str]:
    """The step's loads alone (:func:`loads_alone`), against the same run's memcpy."""

    def line(r: dict) -> str:
        gbs = r["loads_alone_mib"] * 2**20 / r["loads_alone_ms"] / 1e6
        return (
            f"| {r['layers']} | {r['batch']} | {r['context']} | {r['loads_alone_mib']:.0f} | {r['loads_alone_ms']:.2f} "
            f"| {gbs:.1f} | {gbs / r['memcpy_gbs']:.2f} |"
        )

    return sub_table(
        rows,
        "loads_alone_ms",
        "One step's loads alone, with no layer computing beside them (best of 5, after a prefill of the "
        "prompt): the bound copies of every streamed layer back to back, against the same run's memcpy.",
        "| layers | batch | max_cache_len | MiB | ms | GB/s | ratio to memcpy |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        line,
    )


def split_table(rows) -> list[str]:
    """The CUDA-graph steps split in two: the compiled step's call and generate()'s work between calls."""
    static = statics(rows, "call_ms")

    def line(r: dict) -> str:
        base = static.get((r["layers"], r["batch"], r["context"]))
        ours = r["cache"] != "static" and r["floor_ms"] > 0
        return (
            f"| {r['layers']} | {r['batch']} | {r['context']} | {r['cache']} | {r['step_ms']:.2f} | {r['call_ms']:.2f} "
            f"| {r['between_ms']:.2f} | {r['floor_ms']:.2f} | {fmt(r['call_ms'] / r['floor_ms'] if ours else None, '.2f')} "
            f"| {fmt(r['call_ms'] / base if ours and base else None, '.2f')} |"
        )

    return sub_table(
        rows,
        "call_ms",
        "CUDA graphs, per decode step, median of one generate(): the compiled step's call (from before it is "
        "launched to its end on the GPU) and the time from its end to the next call, when only generate()'s own "
        "work runs.",
        "| layers | batch | max_cache_len | cache | step ms | call ms | between ms | floor ms | call / floor "
        "| call / static's |",
        "| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        line,
    )


def kernels_table(rows) -> list[str]:
    """Per decode step, where the GPU's time went (``--timeline``)."""
    static = statics(rows, "others_busy_ms", "mode")

    def line(r: dict) -> str:
        copies = r["copies_busy_ms"]
        rate = r["mib_per_step"] * 2**20 / copies / 1e6 / r["memcpy_gbs"] if copies > 0 else None
        base = static.get((r["layers"], r["batch"], r["context"], r["mode"]))
        loads = r.get("loads_span_ms")
        idle = None if loads is None else r["kernels_span_ms"] - loads
        return (
            f"| {r['layers']} | {r['batch']} | {r['context']} | {r['cache']} | {r['mode']} | {r['kernels_span_ms']:.2f} "
            f"| {copies:.2f} | {fmt(loads, '.2f')} | {fmt(idle, '.2f')} | {r['others_busy_ms']:.2f} "
            f"| {r['both_busy_ms']:.2f} "
            f"| {fmt(rate, '.2f')} "
            f"| {fmt(r['others_busy_ms'] / base if base else None, '.2f')} |"
        )

    return sub_table(
        rows,
        "kernels_span_ms",
        "Per decode step, from a torch.profiler trace (one generate of 32 tokens less one of 1): the kernels' span "
        "(first start to last end), how long the copy kernels (`kv_ops.prefix_copy`'s copy and claim) kept the GPU "
        "busy and how long the model's kernels did, how long both ran at once, the copies' rate while they ran "
        "(the step's bytes over their busy time) against the memcpy's, and the model's busy time over static's. "
        "Loads' span: the median step's time from its first copy's start to its last copy's end (back to back, "
        "the copies' busy time); no load: the span less the loads' span, the part of a step (the step's boundary "
        "included) with no load under way.",
        "| layers | batch | max_cache_len | cache | mode | span ms | copies ms | loads' span ms | no load ms | model ms "
        "| both ms | copies' rate / memcpy | model / static's |",
        "| ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        line,
    )


def plot(rows, path) -> None:
    import matplotlib.pyplot as plt

    shapes = sorted({(r["layers"], r["batch"], r["context"]) for r in rows})  # context: max_cache_len
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
    cards = {(r["layers"], r["batch"], r["context"]): card(r.get("gpu")) for r in rows}
    ax.set_xticklabels([f"{n} layers\nbatch {b}, {c // 1024}k\n{cards[n, b, c]}" for n, b, c in shapes])
    ax.set_ylabel("decode tokens/s")
    ax.set_title("each shape's own run, on the GPU named below it", fontsize=9)
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def shapes(text: str) -> tuple[tuple[int, int, int, int], ...]:
    """An argparse type: comma-separated LAYERSxBATCHxSEQUENCExCAPACITY, each a whole number of at
    least 1 (an empty text: none), refused before any measurement."""
    got = []
    for shape in filter(None, text.split(",")):
        parts = shape.split("x")
        if len(parts) != 4 or not all(v.isdigit() and int(v) >= 1 for v in parts):
            raise argparse.ArgumentTypeError(
                f"expected LAYERSxBATCHxSEQUENCExCAPACITY, four whole numbers of at least 1, got {shape!r}"
            )
        got.append(tuple(int(v) for v in parts))
    return tuple(got)


def existing_file(text: str) -> Path:
    """An argparse type: a file that is there."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return Path(text)


def check_shapes(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """At least one shape, and every CUDA-graph shape among them (by default, all of them)."""
    if args.graph_shapes is None:
        args.graph_shapes = args.shapes
    if not args.shapes:
        p.error("--shapes: give at least one shape")
    if stray := [s for s in args.graph_shapes if s not in args.shapes]:
        p.error(f"--graph-shapes: {', '.join('x'.join(map(str, s)) for s in stray)} not among --shapes")


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument(
        "--shapes",
        type=shapes,
        default="8x1x2048x4,8x4x2048x1,8x4x2048x4,8x4x2048x8,8x16x2048x4,32x4x2048x4",
        help="LAYERSxBATCHxSEQUENCExCAPACITY (max_cache_len = CAPACITY x SEQUENCE), comma-separated: every "
        "cache eager, transformers' offloaded caches",
    )
    p.add_argument(
        "--graph-shapes",
        type=shapes,
        help="the shapes (among --shapes) that also run with CUDA graphs, and with a budget for half the layers "
        "(default: every one of --shapes; empty: none)",
    )
    p.add_argument("--reps", type=at_least_one, default=3, help="timed repetitions per cache (best is kept)")
    p.add_argument(
        "--merge", type=existing_file, help="an earlier run's hf_offload.csv, whose rows join this run's table"
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="also profile static's and ours' runs: where each step's GPU time goes (ours' kernels kept in "
        "OUT/hf_offload_kernels_SHAPE_MODE.json.gz, with load_ahead in ..._SHAPE_ahead_MODE.json.gz)",
    )
    args = parse(p, cuda=True, argv=argv, check=check_shapes)
    rate = memcpy_rate()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    rows = read_rows(args.merge) if args.merge else []
    profile = args.out if args.timeline else None
    for shape in args.shapes:
        rows += shape_rows(*shape, args.reps, rate, shape in args.graph_shapes, profile)
        # The CSV after every shape: a run stopped later (a timeout) still leaves the shapes done,
        # for --merge.
        write_csv(args.out / "hf_offload.csv", rows, COLUMNS)
    rows.sort(key=shape_key)  # merged runs read in the shapes' order; stable, so each shape's caches keep theirs
    save(args.out, "hf_offload", rows, COLUMNS, table=markdown(rows), plot=plot)
    finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
