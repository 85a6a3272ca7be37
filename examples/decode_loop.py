"""The main job: decode with a model whose per-layer embeddings live off the GPU and whose KV
blocks are preempted to host memory (or disk) and back, with a step that is compiled
(``fullgraph=True``), captured in a CUDA graph, and AOT-saved and reloaded in a fresh process.

The model is a small decoder in the style of Gemma-3n with fixed random weights: a token
embedding; N layers of RMSNorm, grouped-query attention over a paged KV cache (a block table,
16 tokens per block) and a gated MLP; and a per-layer embedding (PLE) added in every layer, one
table ``[vocab, layers x ple_dim]`` looked up once per step. The PLE table is served by one of
two transports: ``process`` (``ple_ops.OffloadRuntime``: a CPU process computes the rows, the
graph waits on a flag and pulls them) or ``gather`` (``ple_ops.gather_from_host``: the table sits
in page-locked host memory and one zero-copy kernel in the graph gathers the rows).

What it checks, exiting non-zero on any mismatch:

* the run with KV memory pressure (sequences preempted to the ``kv_ops.OffloadEngine`` and
  loaded back into other GPU blocks) and the run of the AOT artifact in a fresh process give
  logits bitwise equal to the run without pressure, for every sequence at every position. A
  preempted sequence's blocks are stored, and a resumed one's loaded, by the step itself, first
  thing (``kv_ops.StepTransfers``: the scheduler only writes their ids, while the step before
  runs); and for the report, once stored by the engine and loaded layer by layer by the step
  that first reads them (``kv_ops.LayerwiseLoads``: every layer waits only for its own blocks),
  once stored and loaded by the engine, each flushed, before the step;
* every layer's ``kv_ops.wait_layer`` ran at every host run of the compiled (or loaded) step;
* the same model with its PLE table on the GPU gives the same tokens (the largest logit
  difference is reported: Inductor may round a fused table lookup differently);
* every other transport asked for gives the same tokens.

Usage::

    python examples/decode_loop.py                          # small on CPU, Gemma-3n widths on a GPU
    python examples/decode_loop.py --ple-transport gather   # one transport only
    python examples/decode_loop.py --disk /nvme/kv          # preempt through the disk tier too
    python examples/decode_loop.py --resume flush           # process B stores and loads by call and flush

The last line is ``decode loop: tokens match`` or ``decode loop: MISMATCH ...``.

This file is the driver: it builds each transport's model, engine and step, decodes the workload
with and without pressure, runs process B and checks. The pieces it drives, one file each:

* ``decode_model.py``: the model, its widths and ``decode_step``, the function compiled;
* ``decode_graph.py``: the step as compiled, captured and replayed, with the PLE transaction;
* ``decode_scheduler.py``: the sequences, the block pool, preemption and resumption;
* ``decode_report.py``: the tables of step times, KV traffic and resume steps.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

import torch

import kv_ops
import kv_ops.tools.aot
import ple_ops

from decode_graph import Step, StepBuffer
from decode_model import CONFIGS, LOADS, TRANSFERS, Config, DecoderLM, decode_step, make_model
from decode_report import report
from decode_scheduler import Run, Scheduler, blocks_needed, make_sequences, pressure_blocks

RESUME_MODES = ("layerwise", "flush", "step")
WARM_REPEATS = 10  # replays of a run's stores for their back-to-back baseline (warm_stores)

# --- a run --------------------------------------------------------------------------------------


def decode(
    step: Step,
    caches,
    cfg: Config,
    gpu_blocks: int,
    engine=None,
    loads=None,
    transfers=None,
    keep_logits=False,
    compare_to=None,
    label="",
):
    """Decode the workload with ``step``; with ``compare_to``, check every row bitwise as it comes.
    With ``loads``, resumed sequences are loaded layer by layer by the step itself; with
    ``transfers``, preempted blocks are stored and resumed ones loaded by the step, first thing,
    and each step is planned and staged while the step before runs."""
    for cache in caches.values():
        cache.zero_()  # finite bytes in every block, whatever ran before
    seqs = make_sequences(cfg)
    sched = Scheduler(cfg, seqs, gpu_blocks, engine, loads, transfers)
    logits_rows: dict[tuple[int, int], torch.Tensor] = {}
    mismatches: list[tuple[int, int]] = []
    times = []
    total = sum(s.total - 1 for s in seqs)
    shown = 0
    ahead = transfers is not None
    step.take_host_times()  # this run's only
    inputs = sched.plan()
    if ahead and inputs is not None:
        sched.load_resumed()
    while inputs is not None:
        start = time.perf_counter()
        resumed = sched.load_resumed() if not ahead else sched.staged[1] > 0  # ahead: staged already
        staged = sched.staged
        stepped = time.perf_counter()
        step.launch(inputs)
        if ahead:
            # While the step runs: account for it, plan the next one and stage its transfers (the
            # stage waits only until this step has read the last ids, its first op). The sampled
            # tokens are filled in once they are on the host.
            ran = sched.advance(None)
            if (inputs := sched.plan()) is not None:
                sched.load_resumed()
        logits, next_tokens = step.finish()
        end = time.perf_counter()  # next_tokens are on the host: the step has finished
        times.append(end - stepped)
        if ahead:
            sched.fill(next_tokens)
            sched.traffic.step_transfers.append((*staged, end - stepped))
        if resumed:
            sched.traffic.resume_step_times.append(end - (stepped if ahead else start))
        sched.collect()
        if not ahead:
            ran = sched.advance(next_tokens)
            inputs = sched.plan()
        if keep_logits or compare_to is not None:
            for seq, pos in ran:
                row = logits[seq]
                if keep_logits:
                    logits_rows[(seq, pos)] = row.clone()
                if compare_to is not None and not torch.equal(row, compare_to[(seq, pos)]):
                    mismatches.append((seq, pos))
        done = sum(s.done for s in seqs)
        if done * 10 // total > shown:  # a plain progress line every tenth
            shown = done * 10 // total
            print(f"  {label}: {done}/{total} tokens", file=sys.stderr, flush=True)
    sched.finish()
    if mismatches:
        raise Mismatch(f"{label}: {len(mismatches)} logits rows differ from the reference, first {mismatches[:3]}")
    return Run([s.tokens for s in seqs], logits_rows, times, sched.traffic, step.take_host_times())


class Mismatch(Exception):
    pass


def make_engine(caches, cfg: Config, disk: str | None) -> kv_ops.OffloadEngine:
    """An engine with room for every block of the workload, warmed up as a server would at start:
    the first transfer of each direction compiles its copy kernel (a tenth of a second), and each
    new size of id list costs a page-locked allocation. The caches hold nothing yet (a run zeroes
    them before it starts), so any blocks will do."""
    num_blocks = next(iter(caches.values())).shape[1]
    block_bytes = kv_ops.block_bytes(kv_ops.infer_regions(caches, num_blocks))
    engine = kv_ops.OffloadEngine(caches, num_blocks, capacity_bytes=blocks_needed(cfg) * block_bytes, disk_dir=disk)
    for count in range(1, cfg.max_blocks + 1):
        ids = list(range(1, count + 1))
        engine.store(ids, [i - 1 for i in ids])
        engine.flush()
        engine.load([i - 1 for i in ids], ids)
        engine.flush()
    return engine


# --- transports: building the model each one needs --------------------------------------------


class Built(NamedTuple):
    model: DecoderLM
    caches: dict[str, torch.Tensor]
    runtime: ple_ops.OffloadRuntime | None
    engine: kv_ops.OffloadEngine  # host memory: the pressure runs' and the LayerwiseLoads'
    loads: kv_ops.LayerwiseLoads  # named LOADS: every run's waits resolve to it
    transfers: kv_ops.StepTransfers  # named TRANSFERS: every step's own stores and loads
    shared: bool = False  # caches, engine, loads and transfers are another Built's (build's share=)

    def close(self) -> None:
        if not self.shared:
            self.transfers.close()
            self.loads.close()
            self.engine.close()
        if self.runtime is not None:
            self.runtime.close()


def build(transport: str, cfg: Config, device: torch.device, share: Built | None = None) -> Built:
    """``process``: PLE table in an offload process; ``gather``: in page-locked host memory;
    ``gpu``: on the GPU (the local model, the reference for tokens).

    Every model gets a host-memory engine, the LayerwiseLoads its layers wait on and the
    StepTransfers its step runs, made before the step is compiled, warmed up and captured: the
    ops need a live instance of their name in every run (with nothing started or staged they
    wait for nothing and move nothing), and a captured graph reads the flags and id words of the
    instances live at its capture. With ``share`` the model takes that Built's caches, engine,
    LayerwiseLoads and StepTransfers (one instance of a name may live at a time), for steps run
    in turn with its own (``alternate``)."""
    runtime = None
    if transport == "process":
        runtime = ple_ops.OffloadRuntime(functools.partial(make_model, cfg), max_tokens=cfg.batch, device=device)
        model = runtime.model
    elif transport == "gather":
        model = ple_ops.gather_from_host(make_model(cfg), device)
    else:
        model = make_model(cfg).to(device)
    if share is not None:
        caches = model.attach_kv_cache(blocks_needed(cfg) + 1, device, shared=share.caches)
        return Built(model, caches, runtime, share.engine, share.loads, share.transfers, shared=True)
    caches = model.attach_kv_cache(blocks_needed(cfg) + 1, device)
    try:
        engine = make_engine(caches, cfg, None)
        loads = kv_ops.LayerwiseLoads(engine, LOADS)  # one layer per cache tensor: layers.0, layers.1, ...
        transfers = kv_ops.StepTransfers(engine, TRANSFERS)
    except BaseException:
        if runtime is not None:
            runtime.close()
        raise
    for count in range(1, cfg.max_blocks + 1):  # as make_engine's warm-up, for the layer-wise path
        loads.start(list(range(count)), list(range(1, count + 1)))
    engine.flush()
    return Built(model, caches, runtime, engine, loads, transfers)


def compiled_step(built: Built, cfg: Config, device: torch.device, save_to: str | None = None) -> Step:
    example = StepBuffer(cfg, device).inputs
    if save_to is None:
        fn = torch.compile(decode_step, fullgraph=True)
    else:
        fn = kv_ops.tools.aot.compile_step(decode_step, built.model, *example)
        fn.save_compiled_function(save_to)
    return Step(fn, built.model, cfg, device, built.runtime)


def alternate(primary: str, model_step: Step, model: Built, cfg: Config, device, rounds: int, tokens, failures):
    """Step times of the table in the model and of ``primary``'s step, decoding the workload with
    each in turn, ``rounds`` times: ``{"gpu": [round's step seconds, ...], primary: [...]}``.

    Each placement's own run above is minutes from the other's, and the host's speed drifts
    between such phases by more than what the PLE step costs (README); decoded in turn, both
    meet the same phases. ``primary`` gets a fresh model (its own offload process) over the
    model's caches, engine and LayerwiseLoads; between its rounds its offload process is idle.
    """
    built = build(primary, cfg, device, share=model)
    try:
        steps = {"gpu": model_step, primary: compiled_step(built, cfg, device)}
        times: dict[str, list[list[float]]] = {name: [] for name in steps}
        for r in range(rounds):
            for name, step in steps.items():
                run = decode(step, model.caches, cfg, blocks_needed(cfg), label=f"{name}, in turn {r + 1}/{rounds}")
                if run.tokens != tokens:
                    failures.append(f"{name}, in turn: tokens differ from the {primary} transport's")
                times[name].append(run.step_seconds)
    finally:
        built.close()
    return times


# --- the two processes ---------------------------------------------------------------------------


def pressure_runs(step: Step, built: Built, cfg: Config, runs, disk: str | None, compare_to, label: str):
    """Decode under KV pressure once per ``(tier, mode)`` of ``runs``, every row checked bitwise;
    returns ``(tier, mode, Run)`` each, with the engine paths that run used."""
    out = []
    for tier, mode in runs:
        # The disk tier loads, flushes, then steps: LayerwiseLoads reads a host-memory engine's
        # mirror and refuses a disk engine (ValueError).
        engine = make_engine(built.caches, cfg, disk) if tier == "disk" else built.engine
        try:
            before = dict(engine.path_counts)
            run = decode(
                step,
                built.caches,
                cfg,
                pressure_blocks(cfg),
                engine,
                built.loads if mode == "layerwise" else None,
                built.transfers if mode == "step" else None,
                compare_to=compare_to,
                label=f"{label}, KV pressure, {tier}, resume {mode}",
            )
            run.traffic.paths = {k: n - before.get(k, 0) for k, n in engine.path_counts.items()}
            warm_stores(engine, run.traffic)
        finally:
            if engine is not built.engine:
                engine.close()
        out.append((tier, mode, run))
    return out


def warm_stores(engine: kv_ops.OffloadEngine, traffic, repeats: int = WARM_REPEATS) -> None:
    """Replay the run's stores (same ids, same engine, same process) back to back, each flushed,
    ``repeats`` times: the host time of a store when nothing runs between calls, the same-run
    baseline for the in-loop stores (which come between steps, scheduler work and syncs). Run
    after the decode, when every host block is free again; a store only reads the GPU blocks."""
    for _ in range(repeats):
        for gpu, host in traffic.stores:
            start = time.perf_counter()
            engine.store(gpu, host)
            called = time.perf_counter()
            report = engine.flush()
            traffic.warm_store_flush_times.append(time.perf_counter() - start)
            traffic.warm_store_call_times.append(called - start)
            if report.failed:
                raise RuntimeError(f"replayed store failed: {report.failed}")


def pressure_plan(args, both: bool) -> list[tuple[str, str]]:
    """The pressure runs: host memory resuming by ``--resume`` (and by the other modes too, for
    the report's comparison, when ``both``), then the disk tier if asked for."""
    modes = [args.resume] + ([m for m in RESUME_MODES if m != args.resume] if both else [])
    return [("host memory", m) for m in modes] + ([("disk", "flush")] if args.disk else [])


def check_waits(built: Built, step: Step) -> tuple[str, bool]:
    """Whether every layer's wait ran at every host run of the step (so the compiled or loaded
    graph, and the capture, kept a wait in each layer), and a line that says so."""
    waits = built.loads.waits.tolist()
    ok = waits == [step.host_runs] * len(waits)
    verdict = "every layer's wait ran at each" if ok else "MISMATCH: not every layer's wait ran at each"
    return f"layer-wise waits: {verdict} of the step's {step.host_runs} host runs (waits per layer {waits})", ok


def reload_and_decode(args, cfg: Config, device: torch.device) -> int:
    """Process B: a fresh runtime and engine, its own LayerwiseLoads and StepTransfers of the same
    names (the loaded graph carries only the names), the AOT artifact, the pressure runs, bitwise
    check."""
    reference = torch.load(args.expect)
    expected = {key: row.to(device) for key, row in reference["logits"].items()}
    built = build(args.ple_transport[0], cfg, device)
    try:
        step = Step(kv_ops.tools.aot.load_step(args.artifact), built.model, cfg, device, built.runtime)
        runs = pressure_runs(step, built, cfg, pressure_plan(args, both=False), args.disk, expected, "B, AOT-loaded")
        waits, waits_ok = check_waits(built, step)
    except Mismatch as e:
        print(f"AOT reload: MISMATCH {e}", flush=True)
        return 1
    finally:
        built.close()
    ok = waits_ok
    for tier, mode, run in runs:
        same = run.tokens == reference["tokens"]
        ok = ok and same
        print(
            f"AOT reload in a fresh process ({tier}, resume {mode}): {len(reference['logits'])} logits rows bitwise "
            f"equal, {run.traffic.preemptions} preemptions, {run.traffic.paths.get('layerwise', 0)} layer-wise "
            f"loads, tokens {'match' if same else 'MISMATCH'}",
            flush=True,
        )
    print(f"AOT reload: {waits}", flush=True)
    return 0 if ok else 1


def existing_dir(text: str) -> str:
    """``--disk``'s type: a usage error at parse time, since the engine that refuses a bad
    disk_dir is built only after every transport was compiled and captured."""
    if not os.path.isdir(text):
        what = "is not a directory" if os.path.exists(text) else "does not exist"
        raise argparse.ArgumentTypeError(f"{text!r} {what} (pass an existing directory for the disk tier)")
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), help="default: gemma on a GPU, small on the CPU")
    parser.add_argument(
        "--ple-transport",
        choices=["process", "gather"],
        action="append",
        help="PLE transports to run (repeatable); the first one also runs the pressure and "
        "AOT checks. Default: process, then gather",
    )
    parser.add_argument(
        "--disk",
        type=existing_dir,
        help="also preempt KV blocks to a file in this directory (resumed by load, flush, then step)",
    )
    parser.add_argument(
        "--resume",
        choices=RESUME_MODES,
        default="step",
        help="how a preempted sequence's blocks go to host memory and come back: stored and loaded by the "
        "step itself, first thing (default); stored by the engine and flushed, then loaded layer by layer "
        "inside the step that reads them; or stored, then loaded, each flushed, before the step. Process B "
        "runs this one; the main process runs all three, this one first, for the report",
    )
    parser.add_argument(
        "--alternate",
        type=int,
        default=3,
        metavar="ROUNDS",
        help="decode with the table in the model and with the first PLE transport in turn, ROUNDS times "
        "each, for a step-time ratio from one stretch of the host's time (default 3; 0 skips)",
    )
    parser.add_argument("--role", choices=["main", "load"], default="main", help=argparse.SUPPRESS)
    parser.add_argument("--artifact", help=argparse.SUPPRESS)
    parser.add_argument("--expect", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.alternate < 0:
        parser.error(f"--alternate must be 0 (skip) or a number of rounds, got {args.alternate}")
    args.ple_transport = args.ple_transport or ["process", "gather"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = CONFIGS[args.config or ("gemma" if device.type == "cuda" else "small")]
    torch.set_grad_enabled(False)  # inference: compiled and loaded steps run without autograd
    # TF32 matmuls on a GPU: the step's speed is what the PLE transports are measured against.
    # The checks still hold bitwise: every run computes on the same inputs with the same kernels.
    torch.set_float32_matmul_precision("high")
    if device.type == "cpu":
        import warnings

        warnings.filterwarnings("ignore", message=".*CUDA is not available.*")  # pinned_empty's fallback
    if args.role == "load":
        return reload_and_decode(args, cfg, device)
    return run_demo(args, cfg, device)


def run_demo(args, cfg: Config, device: torch.device) -> int:
    primary = args.ple_transport[0]
    print(
        f"decode loop on {device}: {cfg.layers} layers, hidden {cfg.hidden}, {cfg.batch} sequences of "
        f"{cfg.total[0]}-{cfg.total[1]} tokens, PLE table {cfg.vocab} x {cfg.layers * cfg.ple_dim}",
        flush=True,
    )
    failures: list[str] = []
    results: dict[str, Run] = {}
    with tempfile.TemporaryDirectory(prefix="decode-loop-") as tmp:
        artifact, expect = os.path.join(tmp, "step.aot"), os.path.join(tmp, "reference.pt")

        # 1. The primary transport: compiled ahead of time and saved, then the reference run (no
        #    pressure) and the runs with preemption, all bitwise: in host memory resuming layer by
        #    layer and by load-then-step (the report compares them), then the disk tier if asked.
        built = build(primary, cfg, device)
        pressured: list[tuple[str, str, Run]] = []
        try:
            start = time.perf_counter()
            step = compiled_step(built, cfg, device, save_to=artifact)
            print(
                f"compiled, saved and captured the {primary}-transport step in {time.perf_counter() - start:.0f} s",
                flush=True,
            )
            reference = decode(
                step, built.caches, cfg, blocks_needed(cfg), keep_logits=True, label=f"{primary}, no pressure"
            )
            results[primary] = reference
            torch.save(
                {"logits": {k: v.cpu() for k, v in reference.logits.items()}, "tokens": reference.tokens}, expect
            )
            plan = pressure_plan(args, both=True)
            for tier, mode, run in pressure_runs(step, built, cfg, plan, args.disk, reference.logits, primary):
                kv = run.traffic
                print(
                    f"KV pressure ({pressure_blocks(cfg)} of {blocks_needed(cfg)} blocks, {tier}, resume {mode}): "
                    f"{kv.preemptions} preemptions, {kv.resumptions} resumptions, {kv.paths.get('layerwise', 0)} "
                    "layer-wise loads, every logits row bitwise equal",
                    flush=True,
                )
                if run.tokens != reference.tokens:  # implied by the logits; checked all the same
                    failures.append(f"KV pressure, {tier}, resume {mode}: tokens differ")
                pressured.append((tier, mode, run))
            waits, waits_ok = check_waits(built, step)
            print(waits, flush=True)
            if not waits_ok:
                failures.append(f"{primary}: {waits}")
        except Mismatch as e:
            failures.append(str(e))
        finally:
            built.close()

        # 2. Process B: a fresh process loads the artifact and decodes under pressure.
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--role",
            "load",
            "--artifact",
            artifact,
            "--expect",
            expect,
            "--config",
            next(k for k, v in CONFIGS.items() if v == cfg),
            "--ple-transport",
            primary,
        ]
        cmd += ["--resume", args.resume] + (["--disk", args.disk] if args.disk else [])
        if subprocess.run(cmd, timeout=1800).returncode != 0:
            failures.append("the AOT-loaded step in a fresh process did not reproduce the reference")

    # 3. The PLE table on the GPU, and the other transports: same tokens. Then the table on the
    #    GPU and the primary transport in turn, for the step-time comparison.
    max_diff = 0.0
    alternated = None
    for transport in ["gpu"] + args.ple_transport[1:]:
        built = build(transport, cfg, device)
        try:
            step = compiled_step(built, cfg, device)
            run = decode(
                step,
                built.caches,
                cfg,
                blocks_needed(cfg),
                keep_logits=transport == "gpu",
                label=f"{transport} transport" if transport != "gpu" else "PLE table on the GPU",
            )
            waits, waits_ok = check_waits(built, step)
            if transport == "gpu" and args.alternate:
                alternated = alternate(primary, step, built, cfg, device, args.alternate, reference.tokens, failures)
        finally:
            built.close()
        if not waits_ok:
            failures.append(f"{transport}: {waits}")
        results[transport] = run
        if run.tokens != reference.tokens:
            failures.append(f"{transport}: tokens differ from the {primary} transport's")
        if transport == "gpu":
            max_diff = max((run.logits[k] - v).abs().max().item() for k, v in reference.logits.items())
    report(cfg, device, results, pressured, max_diff, alternated)
    if failures:
        print("decode loop: MISMATCH " + "; ".join(failures))
        return 1
    print("decode loop: tokens match")
    return 0


if __name__ == "__main__":
    sys.exit(main())
