"""The decode loop's report: the step-time table per PLE placement, the KV traffic of each pressure
run and the resume-step comparison (the tables README.md quotes)."""

from __future__ import annotations

import torch

from decode_model import Config
from decode_scheduler import Run


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def _us(values: list[float]) -> str:
    """Median (max) in microseconds."""
    return f"{percentile(values, 0.5) * 1e6:.0f} ({max(values) * 1e6:.0f})" if values else "-"


def _report_alternated(device: torch.device, alternated: dict[str, list[list[float]]]) -> None:
    """Step p50 over every round of each placement, and each round's p50 ratio to the model's."""
    rounds = len(alternated["gpu"])
    each = f"{rounds} round{'s' if rounds != 1 else ''} each"
    print(f"\nthe same placements decoding in turn, {each} (one stretch of the host's time)")
    print(f"\n| PLE table ({device.type}), in turn | steps | step p50 (us) | p50 ratio | p50 ratio per round |")
    print("| --- | ---: | ---: | ---: | --- |")
    base = percentile([t for r in alternated["gpu"] for t in r], 0.5)
    labels = {"gpu": "in the model", "process": "offload process", "gather": "host gather"}
    for name, runs in alternated.items():
        steps = [t for r in runs for t in r]
        per_round = " / ".join(
            f"{percentile(r, 0.5) / percentile(m, 0.5):.3f}" for r, m in zip(runs, alternated["gpu"])
        )
        print(
            f"| {labels[name]} | {len(steps)} | {percentile(steps, 0.5) * 1e6:.0f} | "
            f"{percentile(steps, 0.5) / base:.3f} | {per_round if name != 'gpu' else '-'} |"
        )


def _report_step_transfers(tier: str, kv, link) -> None:
    """A run whose steps stored and loaded the blocks themselves, each staged while the step before
    ran: what a transfer adds to the step that carries it (from its launch to its tokens on the
    host), over the median step that moved nothing, as a rate and a ratio to the link."""
    blocks = sum(len(gpu) for gpu, _ in kv.stores)
    block_bytes = kv.stored_bytes / blocks if blocks else 0
    print(
        f"KV pressure, {tier}, resume step: {kv.preemptions} preemptions ({kv.single_run_preemptions} stored to one "
        f"run of host blocks), {kv.resumptions} resumptions; stored {_size(kv.stored_bytes)} and loaded "
        f"{_size(kv.loaded_bytes)} by the steps themselves (kv_ops.StepTransfers); per stage, median (max) of "
        f"{len(kv.stage_times)}: {_us(kv.stage_times)} us of host time, while the step before ran"
    )
    plain = [t for stored, loaded, t in kv.step_transfers if stored == loaded == 0]
    if not plain:
        return
    base = percentile(plain, 0.5)
    rates = {}
    for direction, pick in (("store", lambda s, lo: s and not lo), ("load", lambda s, lo: lo and not s)):
        done = {"store": "stored", "load": "loaded"}[direction]
        steps = [(s + lo, t) for s, lo, t in kv.step_transfers if pick(s, lo)]
        if not steps:
            continue
        moved = sum(n for n, _ in steps) * block_bytes
        extra = sum(t - base for _, t in steps)
        rates[direction] = moved / max(extra, 1e-9) / 1e9
        print(
            f"  steps that {done} only ({len(steps)}): {_us([t for _, t in steps])} us from the launch to the "
            f"step's end, {extra / len(steps) * 1e6:.0f} us each over the median step that moved nothing "
            f"({base * 1e6:.0f} us, {len(plain)} steps): {direction} at {rates[direction]:.2f} GB/s"
        )
    both = sum(1 for s, lo, _ in kv.step_transfers if s and lo)
    if both:
        print(f"  ({both} steps both stored and loaded: in neither figure)")
    if kv.warm_store_call_times:
        print(
            f"  the same {len(kv.stores)} stores by engine.store, replayed back to back after the run: "
            f"{_us(kv.warm_store_call_times)} us inside engine.store, {_us(kv.warm_store_flush_times)} us call to flush"
        )
    if link is not None and rates:
        ratios = ", ".join(
            f"{d} {r / (link.d2h_gbps if d == 'store' else link.h2d_gbps):.2f}" for d, r in rates.items()
        )
        print(
            f"  as a ratio to the link doctor measured ({link.d2h_gbps:.1f} GB/s to host, {link.h2d_gbps:.1f} to "
            f"GPU): {ratios}"
        )


def report(
    cfg: Config,
    device: torch.device,
    results: dict[str, Run],
    pressured,
    max_diff: float,
    alternated: dict[str, list[list[float]]] | None = None,
) -> None:
    """The table the README quotes: step time per PLE placement as a ratio to the table in the
    model, tokens/s, the memory moved off the GPU; the same placements decoded in turn
    (``alternated``, rounds of step seconds per placement); the KV traffic of each pressure run;
    and the resume-step time of each way back (staged, layer-wise, load-then-step)."""
    table_bytes = cfg.vocab * cfg.layers * cfg.ple_dim * 4
    print(f"\nlargest logit difference against the model that holds its PLE table: {max_diff:.3g}")
    print(f"{device.type.upper()} memory the offloaded PLE table no longer takes: {_size(table_bytes)}")
    base = percentile(results["gpu"].step_seconds, 0.5)
    print(
        f"\n| PLE table ({device.type}) | step p50 (us) | step p90 (us) | p50 ratio | tokens/s "
        "| host p50 of prepare / replay launch / release (us) | GPU p50 from the launch to the replay's end (us) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in ["gpu", "process", "gather"]:
        if name not in results:
            continue
        t = results[name].step_seconds
        label = {"gpu": "in the model", "process": "offload process", "gather": "host gather"}[name]
        host = results[name].host_times
        pieces = " / ".join(
            f"{percentile(host[k], 0.5) * 1e6:.1f}" if host.get(k) else "-" for k in ("prepare", "replay", "release")
        )
        gpu = f"{percentile(host['gpu'], 0.5) * 1e6:.0f}" if host.get("gpu") else "-"
        print(
            f"| {label} | {percentile(t, 0.5) * 1e6:.0f} | {percentile(t, 0.9) * 1e6:.0f} | "
            f"{percentile(t, 0.5) / base:.3f} | {cfg.batch * len(t) / sum(t):.0f} | {pieces} | {gpu} |"
        )
    if device.type == "cpu":
        print("(on the CPU the offload process and this one share two cores and spin: times say nothing)")
    if alternated:
        _report_alternated(device, alternated)
    if not pressured:
        return
    link = None
    if device.type == "cuda":
        from kv_ops.tools import doctor

        link = doctor.measure_link(device)
    print()
    for tier, mode, run in pressured:
        kv = run.traffic
        if mode == "step":
            _report_step_transfers(tier, kv, link)
            continue
        store = kv.stored_bytes / max(kv.store_seconds, 1e-9) / 1e9
        load = kv.loaded_bytes / max(kv.load_seconds, 1e-9) / 1e9
        if mode == "layerwise":
            loaded = f"loaded {_size(kv.loaded_bytes)} layer by layer inside the resume steps (no flush: timed below)"
        else:
            loaded = f"loaded {_size(kv.loaded_bytes)} at {load:.2f} GB/s (the same)"
        print(
            f"KV pressure, {tier}, resume {mode}: {kv.preemptions} preemptions ({kv.single_run_preemptions} stored to "
            f"one run of host blocks), {kv.resumptions} resumptions; "
            f"stored {_size(kv.stored_bytes)} at {store:.2f} GB/s (call to flush, wall clock), {loaded}; "
            f"paths {kv.paths}"
        )
        line = (
            f"  per flushed transfer, median (max) of {len(kv.flush_times)}: {_us(kv.flush_times)} us from call to "
            f"flush, of which {_us(kv.call_times)} us inside the engine's store/load call (host work before the "
            "copy is enqueued)"
        )
        if kv.start_times:
            line += f"; per layer-wise load, {_us(kv.start_times)} us inside LayerwiseLoads.start"
        print(line)
        if kv.warm_store_call_times:
            warm = percentile(kv.warm_store_call_times, 0.5)
            print(
                f"  the same {len(kv.stores)} stores replayed back to back on this engine after the run "
                f"({len(kv.warm_store_call_times)} calls): {_us(kv.warm_store_call_times)} us inside engine.store, "
                f"{_us(kv.warm_store_flush_times)} us call to flush; in the loop {_us(kv.store_call_times)} us inside "
                f"engine.store, {percentile(kv.store_call_times, 0.5) / warm:.2f}x the replayed median"
            )
        if link is not None:
            ratios = f"store {store / link.d2h_gbps:.2f}" + (
                f", load {load / link.h2d_gbps:.2f}" if mode == "flush" else ""
            )
            print(
                f"  as a ratio to the link doctor measured ({link.d2h_gbps:.1f} GB/s to host, {link.h2d_gbps:.1f} to "
                f"GPU): {ratios}"
            )
    resumes = {mode: run for tier, mode, run in pressured if tier == "host memory"}
    if len(resumes) < 2:
        return
    if not all(run.traffic.resume_step_times for run in resumes.values()):
        print("\nresume steps: no sequence resumed in host memory, nothing to compare")
        return
    print(
        "\nresume steps (host memory, same engine, workload and process): from the call that loads a resumed "
        "sequence's blocks to the end of the step that first reads them (its tokens on the host); staged while "
        "the step before ran, from that step's launch"
    )
    print(f"\n| resume ({device.type}) | resumed steps | median (us) | max (us) | median ratio |")
    print("| --- | ---: | ---: | ---: | ---: |")
    flushed = percentile(resumes["flush"].traffic.resume_step_times, 0.5)
    for mode, label in [
        ("step", "staged, loaded by the step itself"),
        ("layerwise", "layer-wise loads, then the step"),
        ("flush", "load, flush, then the step"),
    ]:
        if mode not in resumes:
            continue
        t = resumes[mode].traffic.resume_step_times
        print(
            f"| {label} | {len(t)} | {percentile(t, 0.5) * 1e6:.0f} | {max(t) * 1e6:.0f} | "
            f"{percentile(t, 0.5) / flushed:.3f} |"
        )
    if device.type == "cpu":
        print(
            "(on the CPU LayerwiseLoads.start copies at call time and the waits only count, so the rows do the "
            "same work in another order, on a spinning offload process: times say nothing)"
        )
