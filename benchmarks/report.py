"""The benchmarks' results: the CSV file and the figure the scripts write, and README's Performance
section, regenerated from ``benchmarks/results/``.

``python benchmarks/report.py`` rewrites the section between README's two marker comments;
``--check`` only compares, and exits 1 when README's section is not what the results give.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path


def columns(rows: list[dict], first: list[str] | tuple[str, ...] = ()) -> list[str]:
    """``first``, then every other key of ``rows`` in the order it first appears."""
    return list(first) + [k for k in dict.fromkeys(k for r in rows for k in r) if k not in first]


def write_csv(
    path: Path, rows: list[dict], fieldnames: list[str], digits: int | None = None, ignore_extra: bool = False
) -> None:
    """Write ``rows`` under ``fieldnames``; floats rounded to ``digits`` when given. A key not in
    ``fieldnames`` raises, unless ``ignore_extra`` (a script whose rows carry working fields)."""
    if digits is not None:
        rows = [{k: round(v, digits) if isinstance(v, float) else v for k, v in r.items()} for r in rows]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fieldnames, extrasaction="ignore" if ignore_extra else "raise")
        w.writeheader()
        w.writerows(rows)


def can_plot(path: Path) -> bool:
    """Whether matplotlib is there to draw ``path``; says so when it is not (the CSV and the table
    are the results, the figure only helps to read them)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"matplotlib is not installed: no {path.name}", flush=True)
        return False
    return True


def figure(ncols: int, figsize: tuple[float, float], **subplots):
    """``(fig, axes)``: one row of ``ncols`` axes, drawn with Agg (the scripts run on machines with
    no display). Call :func:`can_plot` first: this imports matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=figsize, **subplots)


def save_figure(fig, path: Path) -> None:
    """Lay out ``fig``, write it to ``path`` and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
BEGIN = "<!-- performance: written by benchmarks/report.py from benchmarks/results/; do not edit by hand -->"
END = "<!-- performance: end -->"
# The machine the results in benchmarks/results/ were measured on (the scripts record the GPU and
# torch, not the link or the driver). hf_offload.csv names each row's GPU: its sweep is split over
# processes, which may run on different cards.
LINK = "PCIe Gen5 x16, driver 580, torch 2.11, triton 3.6, CUDA 13"
MACHINE = f"NVIDIA H200 ({LINK})"


def _rows(name: str) -> list[dict]:
    with open(RESULTS / name, newline="") as f:
        return list(csv.DictReader(f))


def card(gpu: str | None) -> str:
    """The GPU's short name ("NVIDIA H100 80GB HBM3": "H100"); each shape's row keeps its own run's
    card, since a sweep split over several processes may run on more than one kind."""
    if not gpu:
        return "?"
    words = gpu.split()
    return words[1] if words[0] == "NVIDIA" and len(words) > 1 else gpu


def _cards(rows: list[dict]) -> str:
    """The sentence naming the GPU of a results file's rows, where the file names it."""
    cards = sorted({card(r["gpu"]) for r in rows if r.get("gpu")})
    return f" Measured on {' and '.join(cards)}." if cards else ""


def _size(n: int | str) -> str:
    n = int(n)
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _f(value: str, digits: int = 2) -> str:
    return "-" if value in ("", None) else f"{float(value):.{digits}f}"


def _table(head: list[str], align: str, rows: list[list[str]]) -> list[str]:
    """A markdown table; ``align`` has one letter per column, ``l`` or ``r``."""
    rule = ["---" if a == "l" else "---:" for a in align]
    return [f"| {' | '.join(line)} |" for line in (head, rule, *rows)]


def _links(stem: str) -> str:
    names = [f"{stem}.{ext}" for ext in ("csv", "png", "md", "txt") if (RESULTS / f"{stem}.{ext}").exists()]
    return ", ".join(f"[{n}](benchmarks/results/{n})" for n in names)


def block_copy() -> list[str]:
    rows = [r for r in _rows("block_copy.csv") if r["blocks"] == "2048"]
    cells = {(r["block_bytes"], r["direction"], r["method"]): r for r in rows}
    sizes = [s for s in sorted({int(r["block_bytes"]) for r in rows}) if s <= 256 << 10]

    def both(size, method, column, digits=2):
        return " / ".join(
            _f(cells.get((str(size), d, method), {}).get(column), digits) for d in ("gpu_to_host", "host_to_gpu")
        )

    body = [
        [_size(s), both(s, "memcpy", "gbps", 1)]
        + [both(s, m, "ratio_to_memcpy") for m in ("kernel", "naive", "per_block")]
        for s in sizes
    ]
    head = ["block", "memcpy GB/s", "`copy_blocks`", "index_select + one DMA", "one memcpy per block"]
    return [
        "### Block copy: `kv_ops.copy_blocks`",
        "2048 random blocks between one GPU region and one page-locked host region, GPU to host / host to GPU, as a "
        f"ratio to contiguous pinned memcpy of the same bytes. Results: {_links('block_copy')}.",
        "",
        *_table(head, "rrrrr", body),
    ]


def _md_card(stem: str) -> str:
    """The sentence naming the GPU of a results file whose CSV does not, from the first line of its
    printed tables (``NVIDIA H100 80GB HBM3, torch ...``)."""
    path = RESULTS / f"{stem}.md"
    first = path.read_text().split(",", 1)[0] if path.exists() else ""
    return f" Measured on {card(first)}." if first.startswith("NVIDIA") else ""


def engine() -> list[str]:
    rows = _rows("engine.csv")
    cells = {(r["packed_bytes"], r["ids"], r["direction"], r["path"]): r for r in rows if r["kind"] == "bandwidth"}
    keys = sorted({(int(k[0]), k[1]) for k in cells}, key=lambda k: (k[0], k[1] != "random"))
    body = []
    for packed, ids in keys:

        def get(d, p, packed=packed, ids=ids):
            return cells.get((str(packed), ids, d, p), {}).get("ratio")

        body.append(
            [_size(packed), ids]
            + [f"{_f(get('store', p))} / {_f(get('load', p))}" for p in ("kernel", "staged", "dma", "auto")]
            + [_f(cells.get((str(packed), ids, "duplex", "kernel"), {}).get("memcpy_duplex_ratio"))]
            + [_f(get("duplex", p)) for p in ("kernel", "staged", "auto")]
        )
    beside = "; ".join(
        f"`{r['path']}` {float(r['slowdown']) * 100:+.1f}% at {_f(r['duplex_ratio'])}"
        for r in rows
        if r["kind"] == "overlap" and r["path"] != "none"
    )
    head = ["packed row", "ids", "kernel", "staged", "dma", "auto", "both: memcpy", "kernel", "staged", "auto"]
    return [
        "### The offload engine: `OffloadEngine.store` / `load`",
        "An 8-layer K/V-first cache (16 regions per block id); 8 calls of 64 MiB back to back, clock stopped when "
        "`flush()` returns, as a ratio to contiguous pinned memcpy: store / load, then both directions at once (2.0 at "
        f"most). Beside twenty bf16 8192^3 matmuls, the matmuls' slowdown and the paths' duplex rate: {beside}."
        f"{_md_card('engine')} Results: {_links('engine')}.",
        "",
        *_table(head, "rlrrrrrrrr", body),
    ]


def host_cost() -> list[str]:
    rows = [r for r in _rows("host_cost.csv") if not r["regime"] and r["status"] == "ok"]

    def line(label, call, path, ids, checks):
        found = {
            r["blocks"]: r for r in rows if (r["call"], r["path"], r["ids"], r["checks"]) == (call, path, ids, checks)
        }
        cells = [found.get(b, {}) for b in ("1", "4", "16", "64")]
        paired = [c.get("host_vs_paired_copy") for c in cells]
        return [
            label,
            " / ".join(_f(c.get("host_p50_us"), 1) for c in cells),
            " / ".join(_f(p) for p in paired) if any(paired) else "-",
            " / ".join(_f(c.get("bw_vs_copy")) for c in cells),
        ]

    body = [
        line("`store`, auto, list ids", "store", "auto", "list", "engine"),
        line("`store`, auto, GPU-tensor ids", "store", "auto", "gpu", "engine"),
        line("`load`, auto, list ids", "load", "auto", "list", "engine"),
        line("`store`, kernel path, list ids", "store", "kernel", "list", "engine"),
        line("`store`, staged path, list ids", "store", "staged", "list", "engine"),
        line("`store`, dma path, list ids", "store", "dma", "list", "engine"),
        line("eager `copy_blocks`, GPU ids, checks off", "copy_blocks", "-", "gpu", "off"),
    ]
    ple = {(r["call"], r["ids"]): r for r in rows if r["family"] == "ple"}
    captured = " / ".join(
        _f(ple.get((c, "replay"), {}).get("host_p50_us"), 1) for c in ("prepare", "replay", "release", "step")
    )
    return [
        "### Host cost per call",
        "Host time of one call (p50 of 40, idle device), 1 MiB per block id, fresh random ids, against a bare "
        "`copy_(non_blocking=True)` of the same bytes timed right before it; call to flush as a ratio of the bare "
        f"`copy_`'s time. A captured 8-layer PLE step: `prepare` / replay / `release(enqueue=False)` / all {captured} us "
        f"of host time. Results: {_links('host_cost')}.",
        "",
        *_table(["call (1 / 4 / 16 / 64 blocks)", "host p50 us", "ratio to `copy_`", "call to flush"], "lrrr", body),
    ]


def layerwise() -> list[str]:
    rows = _rows("layerwise.csv")
    cells = {(r["blocks"], r["hosts"], r["copies"]): r for r in rows}
    mechanisms = [c for c in ("kernel", "staged", "dma", "auto") if any(r["copies"] == c for r in rows)]

    def vs_target(r: dict) -> str:
        if not r:
            return "-"
        return f"{float(r['layerwise_us']) / max(float(r['compute_us']), float(r['layerwise_copies_us'])):.2f}"

    body = []
    for blocks in sorted({int(r["blocks"]) for r in rows}):

        def get(h, c, blocks=blocks):
            return cells.get((str(blocks), h, c), {})

        body.append(
            [str(blocks), _f(get("run", "kernel").get("load_gbps"), 1)]
            + [" / ".join(vs_target(get(h, c)) for c in mechanisms) for h in ("run", "random")]
            + [" / ".join(get(h, "auto").get("picked") or "-" for h in ("run", "random"))]
            + ["yes" if all(r["bitwise"] == "True" for r in rows if r["blocks"] == str(blocks)) else "NO"]
        )
    head = [
        "blocks of 2 MiB",
        "load alone GB/s",
        "host ids in runs",
        "random host ids",
        "auto picked (runs / random)",
        "bitwise",
    ]
    return [
        "### Layer-wise loads: `LayerwiseLoads` + `wait_layer`",
        "A prefill-like step, 32 layers of Llama-3-8B's matmuls over 2048 tokens in bf16, compiled and captured. "
        "Each cell is the layer-wise step's time over max(step alone, layer-wise copies alone), by `copies=` "
        f"{' / '.join(mechanisms)}: 1.00 hides the faster half entirely behind the slower.{_cards(rows)} "
        f"Results: {_links('layerwise')}.",
        "",
        *_table(head, "rrrrll", body),
        "",
        *layerwise_parts(),
    ]


def layerwise_parts() -> list[str]:
    rows = [r for r in _rows("layerwise_parts.csv") if r["hosts"] == "random"]
    cells = {(r["blocks"], r["case"]): r for r in rows}
    # Every case but the three the target is made of, in the script's order.
    cases = [c for c in dict.fromkeys(r["case"] for r in rows) if c not in ("step", "copies", "one launch")]
    body = [
        [r_blocks] + [_f(cells.get((r_blocks, c), {}).get("vs_target")) for c in cases]
        for r_blocks in dict.fromkeys(r["blocks"] for r in rows)
    ]
    return [
        "Where the kernel copies' time goes (`benchmarks/layerwise_parts.py`, random host ids; each case's later end "
        "over the same target, on GPU events): the copies beside the step without waits already cost most of what the "
        "layer-wise step loses, so most of the loss is SM sharing, not the waits or the per-layer launches. "
        "The copy kernel holds 8 SMs, and the step's persistent cuBLAS matmuls, one CTA per SM, then run their "
        "last CTAs in a second wave: captured with the matmuls on cuBLASLt targeting that many SMs fewer "
        "(`torch._C._set_sm_carveout_experimental`, the last two columns), the step alone costs more, and the "
        "layer-wise step with the most blocks loses least. "
        f"Results: {_links('layerwise_parts')}.",
        "",
        *_table(["blocks of 2 MiB", *cases], "r" * (len(cases) + 1), body),
    ]


def ple_latency() -> list[str]:
    rows = _rows("ple_latency.csv")
    what = {
        ("ping_pong", "0"): "flag ping-pong (the floor)",
        ("wait_copy", "1"): "wait + pull, 1 row",
        ("wait_copy", "8"): "wait + pull, 8 rows",
        ("wait_copy_watched", "1"): "watched wait + pull (the runtime's protocol), 1 row",
        ("wait_copy_release_watched", "1"): "watched wait + pull + release, 1 row",
    }
    latency = "; ".join(
        f"{what[r['what'], r['rows']]} {float(r['p50_us']):.1f} ({float(r['p99_us']):.1f}) us, {_f(r['ratio'])}"
        for r in rows
        if r["kind"] == "latency" and (r["what"], r["rows"]) in what
    )
    pulls = {r["rows"]: r for r in rows if r["kind"] == "bandwidth"}
    pull = "; ".join(
        f"{_size(r['bytes'])} {_f(r['ratio'])}"
        for n, r in pulls.items()
        if n in ("1", "16", "128", "256", "1024", "8192")
    )
    steps = {r["what"]: r for r in rows if r["kind"] == "decode_step"}
    on_gpu, offloaded = steps.get("tables_on_gpu", {}), steps.get("offloaded", {})
    return [
        "### PLE latency and pulls: `ple_ops`",
        "From the CPU raising a host-mapped flag to the CPU seeing the flag the stream raises after its work (eager, "
        f"rows of 16 KiB, p50 (p99) of 300, and the ratio to the bare ping-pong): {latency}. A captured pull (`wait_copy` in a CUDA "
        f"graph), as a ratio to memcpy of the same bytes: {pull}. A 3-layer toy decode step: {_f(offloaded.get('p50_us'), 1)} "
        f"us with the tables offloaded against {_f(on_gpu.get('p50_us'), 1)} on the GPU ({_f(offloaded.get('ratio'))}x: "
        "nothing hides the offload process's work in so short a step; the decode loop below is the figure that counts). "
        f"Results: {_links('ple_latency')}.",
    ]


def _md_tables(text: str) -> list[list[str]]:
    """The markdown tables of a results text file, in order."""
    tables, current = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    return tables + ([current] if current else [])


def decode_loop() -> list[str]:
    text = (RESULTS / "decode_loop.txt").read_text()
    first = text.splitlines()[0]
    placements, in_turn, resume = _md_tables(text)[:3]
    phases = []
    for line in placements[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        phases.append(f"{cells[0]} {cells[1]} us ({cells[3]})")
    stores = [
        f"{run}: {ratios}"
        for run, ratios in re.findall(
            r"^KV pressure, [^,]*, ([^:]*):.*?as a ratio to the link doctor measured \([^)]*\): ([^\n]*)",
            text,
            re.M | re.S,
        )
    ]
    last = text.strip().splitlines()[-1]
    return [
        "### The decode loop: `examples/decode_loop.py`",
        f"The run: {first}; `{last}`. The PLE cost is read from the two placements decoding in turn, three rounds "
        "each over one stretch of the host's time. Each placement's own phase, minutes apart, step p50 (ratio): "
        f"{', '.join(phases)}. KV stores and "
        f"loads under pressure, as a ratio to the link (resume step: the bytes over what a step that moves them takes "
        f"beyond the median step): {'; '.join(stores)}. Results: {_links('decode_loop')}.",
        "",
        *in_turn,
        "",
        *resume,
    ]


def gemma(model: str, title: str) -> list[str]:
    """The section of ``examples/{model}_transformers.py``'s report (``{model}.txt``): its header, the
    memory each offload freed, and each run's decode rate (a row's leading cells name the run)."""
    text = (RESULTS / f"{model}.txt").read_text()
    lines = text.splitlines()
    table = _md_tables(text)[0]
    rows = ([x.strip() for x in line.strip("|").split("|")] for line in table[2:])
    rates = ", ".join(f"{' with '.join(c[:-2])} {c[-2]} tokens/s ({c[-1]})" for c in rows)
    freed = "; ".join(line for line in lines if "memory freed" in line)
    spread = next(line for line in lines if line.startswith("best of"))
    return [
        f"### Stock transformers {title}: `examples/{model}_transformers.py`",
        f"{lines[0]}; compiled `generate()`. Decode: {rates}; {spread}. {freed}; `{lines[-1]}`. "
        f"Results: {_links(model)}.",
    ]


def _call_vs_floor(row: dict) -> str:
    call, floor = row.get("call_ms"), row.get("floor_ms")
    return f"{float(call) / float(floor):.2f}" if call not in (None, "") and float(floor) > 0 else "-"


def hf_offload() -> list[str]:
    rows = _rows("hf_offload.csv")
    shape = ("layers", "batch", "sequence", "context")
    cells = {(*(r[k] for k in shape), r["cache"], r["mode"]): r for r in rows}
    body = []
    for key in dict.fromkeys(tuple(r[k] for k in shape) for r in rows):
        layers, batch, sequence, context = key
        offload = max(
            (float(r["decode_tok_s"]) for k, r in cells.items() if k[:4] == key and k[4].startswith("offloaded")),
            default=None,
        )
        # The cache as users run it, and under a budget; the load-ahead and carveout comparisons stay in
        # hf_offload.md.
        for cache in ("HostOffloadedCache", "HostOffloadedCache, half resident"):
            for mode in dict.fromkeys(r["mode"] for r in rows):
                ours = cells.get((*key, cache, mode))
                if ours is None or (cache != "HostOffloadedCache" and mode == "eager"):
                    continue
                static = cells.get((*key, "static", mode), {})
                update = "-"
                if ours.get("update_host_us"):
                    update = f"{float(ours['update_host_us']):.0f} ({float(static['static_update_host_us']):.0f})"
                name = "" if cache == "HostOffloadedCache" else cache.split(", ", 1)[1]
                body.append(
                    [card(ours.get("gpu")), f"{layers} x {batch} x {int(sequence) // 1024}k, {int(context) // int(sequence)}x", mode, name,
                     _f(static.get("decode_tok_s"), 0), "-" if offload is None else f"{offload:.0f}",
                     _f(ours["decode_tok_s"], 0), _f(ours["vs_best_transformers_offload"]), _f(ours["step_ms"]),
                     _f(ours["floor_ms"]), _f(ours["step_vs_target"]), _call_vs_floor(ours),
                     f"{float(ours['kv_gpu_saved_mib']):.0f}", update]
                )  # fmt: skip
    head = [
        "GPU", "layers x batch x sequence, max_cache_len", "mode", "variant", "static tok/s", "best transformers offload tok/s",
        "HostOffloadedCache tok/s", "vs offload", "step ms", "floor ms", "step / target", "call / floor", "GPU MiB saved",
        "update us (static)",
    ]  # fmt: skip
    return [
        "### transformers `generate()` with `HostOffloadedCache`: `benchmarks/hf_offload.py`",
        "A random-weight Llama at Llama-3-8B widths, bf16, greedy, sdpa attention, `max_cache_len` a multiple of the "
        "sequence as a static cache is sized; decode tokens/s against transformers' on-GPU `static` cache at the "
        "same `max_cache_len` and the better of its `offloaded` and `offloaded_static` caches (eager: neither keeps "
        "CUDA graphs). Floor: the bytes HostOffloadedCache moves per step (positions in use of the streamed layers) "
        "at the same run's pinned memcpy rate; target: max(floor, static's step in the same mode); update us: host "
        "time of one eager layer update, StaticCache's in brackets; call / floor: with CUDA graphs, the compiled "
        "step's call alone (from before its launch to its end on the GPU, without generate()'s work between steps) "
        "over the floor. Variant: `max_gpu_bytes` for half the layers (half resident), with CUDA graphs. hf_offload.md has "
        "its eager rows, each eager step over StaticCache's of the same turn (paired; where a run has it), the same run with `load_ahead=True` (where a run has it), with the matmuls leaving the copy kernels their SMs (cuBLASLt's SM "
        "carveout), one step's loads timed alone, and where each step's GPU time went (`--timeline`, where a run has it). "
        f"Each row's GPU is named in its first column ({LINK}). Results: {_links('hf_offload')}.",
        "",
        *_table(head, "llllrrrrrrrrrr", body),
    ]


def section() -> str:
    """README's Performance section, from benchmarks/results/."""
    parts = [
        "## Performance",
        f"Measured on {MACHINE}, except where a benchmark names another. Every figure is a ratio to a baseline measured in the same run "
        "(contiguous pinned memcpy for bandwidth, the flag ping-pong for latency, a bare `copy_` for host time). "
        "How each benchmark measures: [docs/measurements.md](docs/measurements.md). On a GPU machine `bash .ci/gpu` "
        "runs them all, with the `gpu` tests and `compute-sanitizer` (its header says how to narrow it); "
        "`python benchmarks/report.py` rewrites this section from `benchmarks/results/`.",
    ]
    for make in (
        block_copy,
        engine,
        host_cost,
        layerwise,
        ple_latency,
        decode_loop,
        lambda: gemma("gemma3n", "Gemma 3n"),
        lambda: gemma("gemma4", "Gemma 4"),
        hf_offload,
    ):
        parts += ["", *make()]
    return "\n".join(parts) + "\n"


def render(readme: str) -> str:
    """``readme`` with its Performance section (between the markers) regenerated."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md lacks the markers {BEGIN!r} ... {END!r}")
    return readme[: start + len(BEGIN)] + "\n" + section() + readme[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if README's section differs; write nothing")
    args = parser.parse_args(argv)
    old = README.read_text()
    new = render(old)
    if args.check:
        if new != old:
            print("README.md's Performance section differs from benchmarks/results/: run python benchmarks/report.py")
            return 1
        print("README.md's Performance section matches benchmarks/results/")
        return 0
    README.write_text(new)
    print(f"wrote README.md's Performance section ({section().count(chr(10))} lines)")
    return 0


__all__ = ["can_plot", "columns", "figure", "render", "save_figure", "section", "write_csv"]

if __name__ == "__main__":
    sys.exit(main())
