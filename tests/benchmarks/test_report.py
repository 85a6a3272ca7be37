"""benchmarks/report.py, on fake rows: the CSV the scripts write, and the figure that is skipped
with one line when matplotlib is absent; and every script that uses it imports, its table
functions running on fake rows."""

import csv
import importlib
import importlib.util
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the scripts import their neighbours by name, as when run

report = importlib.import_module("report")
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def test_columns_put_the_given_first_then_keys_as_they_first_appear():
    rows = [{"kind": "a", "x": 1}, {"kind": "b", "y": 2, "x": 3}, {"z": 4}]
    assert report.columns(rows) == ["kind", "x", "y", "z"]
    assert report.columns(rows, ["z", "kind"]) == ["z", "kind", "x", "y"]


def test_write_csv_round_trips_and_rounds_floats_when_asked(tmp_path):
    rows = [{"kind": "bandwidth", "gbps": 51.123456789, "blocks": 16}, {"kind": "memcpy", "gbps": 1 / 3}]
    path = tmp_path / "plain.csv"
    report.write_csv(path, rows, report.columns(rows))
    with open(path, newline="") as f:
        back = list(csv.DictReader(f))
    assert back == [
        {"kind": "bandwidth", "gbps": "51.123456789", "blocks": "16"},
        {"kind": "memcpy", "gbps": str(1 / 3), "blocks": ""},
    ]
    report.write_csv(path, rows, ["kind", "gbps", "blocks"], digits=4)
    assert path.read_text().splitlines() == ["kind,gbps,blocks", "bandwidth,51.1235,16", "memcpy,0.3333,"]
    assert rows[0]["gbps"] == 51.123456789  # the caller's rows are left as they were


def test_write_csv_refuses_a_key_outside_the_columns_unless_told(tmp_path):
    rows = [{"call": "store", "working": object()}]
    with pytest.raises(ValueError, match="working"):
        report.write_csv(tmp_path / "strict.csv", rows, ["call"])
    report.write_csv(tmp_path / "loose.csv", rows, ["call"], ignore_extra=True)
    assert (tmp_path / "loose.csv").read_text().splitlines() == ["call", "store"]


@pytest.mark.skipif(HAS_MATPLOTLIB, reason="matplotlib is installed: the figure is drawn")
def test_without_matplotlib_the_figure_is_skipped_with_the_scripts_message(tmp_path, capsys):
    assert report.can_plot(tmp_path / "engine.png") is False
    assert capsys.readouterr().out == "matplotlib is not installed: no engine.png\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed")
def test_with_matplotlib_the_figure_is_saved(tmp_path):
    assert report.can_plot(tmp_path / "fig.png")
    fig, axes = report.figure(2, (4, 2), sharey=True)
    axes[0].plot([1, 2], [3, 4])
    report.save_figure(fig, tmp_path / "fig.png")
    assert (tmp_path / "fig.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_block_copy_table_from_fake_rows():
    block_copy = importlib.import_module("block_copy")
    rows = [
        {"block_bytes": 4096, "blocks": 2048, "direction": d, "method": m, "gbps": 50.0, "ratio_to_memcpy": r}
        for d in ("gpu_to_host", "host_to_gpu")
        for m, r in (("memcpy", 1.0), ("kernel", 0.95), ("naive", 0.5))
    ]
    assert block_copy.markdown(rows).splitlines() == [
        "| block | direction | memcpy GB/s | kernel | naive (no host scatter) | per-block memcpy |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
        "| 4 KiB | gpu to host | 50.0 | 0.95 | 0.50 | - |",
        "| 4 KiB | host to gpu | 50.0 | 0.95 | 0.50 | - |",
    ]


def test_layerwise_table_from_fake_rows():
    layerwise = importlib.import_module("layerwise")
    row = dict.fromkeys(layerwise.COLUMNS, 1.0) | {"blocks": 16, "hosts": "run", "copies": "kernel", "bitwise": True}
    row["queued_start_us"] = 3.0
    once = dict.fromkeys(
        ["compute_us", "zero_block_us", "zero_block_ratio", "zero_block_gpu_ratio", "per_wait_us"]
        + ["short_step_us", "short_step_waits_us"],
        2.0,
    ) | {"zero_block_queued_ratio": 1.5}
    args = SimpleNamespace(layers=4, tokens=8, hidden=16, mlp=32)
    lines = layerwise.markdown([row], once, args).splitlines()
    assert lines[0].startswith(
        "Step: 4 layers of Llama-3-8B's matmuls (hidden 16, QKV, output, gated MLP 32), 8 tokens, bf16"
    )
    assert "1.500 on GPU time with the launch hidden" in lines[0]
    assert lines[-1] == "| 16 | run | kernel | 1 | 1, 1.0 | 1, 1.0 | 1 | 1 | 1.00 | 1.00 | 1.00 | 1 | 1 / 3 | yes |"
    auto = row | {"copies": "auto", "picked": "staged", "step_vs_target": 1.25}
    assert layerwise.markdown([auto], once, args).splitlines()[-1].startswith("| 16 | run | auto (staged) | 1 |")
    assert "| 1.00 | 1.25 | 1 | 1 / 3 | yes |" in layerwise.markdown([auto], once, args)


def test_readmes_layerwise_section_names_the_gpu_its_rows_ran_on(tmp_path, monkeypatch):
    layerwise = importlib.import_module("layerwise")
    row = dict.fromkeys(layerwise.COLUMNS, 1.0) | {"blocks": 16, "hosts": "run", "copies": "kernel", "bitwise": True}
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    report.write_csv(tmp_path / "layerwise_parts.csv", [], ["blocks", "hosts", "case", "vs_target"])
    for gpu, says in (("NVIDIA H100 80GB HBM3", " Measured on H100. "), (None, " slower. Results")):
        report.write_csv(tmp_path / "layerwise.csv", [row | {"gpu": gpu}], layerwise.COLUMNS)
        assert says in report.layerwise()[1]


def test_layerwise_parts_table_from_fake_rows():
    parts = importlib.import_module("layerwise_parts")
    rows = [
        {"blocks": 512, "hosts": "random", "case": "step", "copy_ms": float("nan"), "step_ms": 36.5, "vs_target": 1.0},
        {
            "blocks": 512,
            "hosts": "random",
            "case": "layer-wise step",
            "copy_ms": 21.0,
            "step_ms": 44.8,
            "vs_target": 1.2274,
        },
    ]
    lines = parts.markdown(rows).splitlines()
    assert lines[4] == "| blocks (2 MiB) | host ids | case | copies end (ms) | step end (ms) | vs target |"
    assert lines[-2:] == [
        "| 512 | random | step | - | 36.50 | 1.00 |",
        "| 512 | random | layer-wise step | 21.00 | 44.80 | 1.23 |",
    ]


def hf_row(hf, cache, mode, capacity, rate, **values):
    row = dict.fromkeys(hf.COLUMNS)
    row.update(
        gpu="NVIDIA H100 80GB HBM3",
        layers=8,
        batch=4,
        sequence=2048,
        capacity=capacity,
        context=2048 * capacity,
        cache=cache,
        mode=mode,
    )
    row.update(memcpy_gbs=rate, decode_tok_s=400.0, step_ms=10.0, floor_ms=4.25, target_ms=9.5, kv_gpu_mib=256.0)
    row.update(kv_gpu_saved_mib=0.0, peak_gpu_gib=2.5, mib_per_step=222.0, vs_best_transformers_offload=1.05)
    row.update(values)
    return row


def eager_pair(hf, capacity, static_us, ours_us, parts, **ours):
    """Static's and ours' eager rows of one shape: the update's host times and ours' pieces."""
    return [
        hf_row(hf, "static", "eager", capacity, 54.4, static_update_host_us=static_us),
        hf_row(hf, "HostOffloadedCache", "eager", capacity, 54.4, update_host_us=ours_us, **parts, **ours),
    ]


def test_hf_offload_tables_from_fake_rows_and_a_merged_earlier_run(tmp_path):
    pytest.importorskip("transformers")
    hf = importlib.import_module("hf_offload")
    parts = dict(part_layer_us=40.5, part_check_us=1.25, part_wait_us=3.0, part_issue_us=12.0, streamed_layers=7)
    earlier = eager_pair(hf, 1, 42.7, 90.5, parts, step_vs_target=1.13)
    earlier[1].update(loads_alone_ms=4.0, loads_alone_mib=200.0)
    path = tmp_path / "hf_offload.csv"
    report.write_csv(path, earlier, hf.COLUMNS)
    assert hf.read_rows(path) == earlier  # typed back as written: ints, floats, strings, None
    now = [
        hf_row(hf, "static", "cudagraphs", 8, 55.1, step_ms=4.0, call_ms=2.0, between_ms=1.9),
        hf_row(hf, "HostOffloadedCache", "cudagraphs", 8, 55.1, step_vs_target=1.11, call_ms=4.5, between_ms=2.0),
    ]
    now[0].update(kernels_span_ms=3.9, copies_busy_ms=0.0, others_busy_ms=3.5, both_busy_ms=0.0)
    now[1].update(kernels_span_ms=4.4, copies_busy_ms=4.44, others_busy_ms=3.85, both_busy_ms=2.0, loads_span_ms=4.3)
    lines = hf.markdown(hf.read_rows(path) + now).splitlines()
    assert "memcpy 54.4-55.1 GB/s, measured in each shape's own run" in lines[2]
    update = lines.index("| 8 | 4 | 2048 | 42.7 | 90.5 | 40.5 | 1.2 | 3.0 | 12.0 | 7 | 47.8 |")
    # The loads alone: 200 MiB in 4 ms, 52.4 GB/s, over the run's 54.4.
    assert lines[update + 6] == "| 8 | 4 | 2048 | 200 | 4.00 | 52.4 | 0.96 |"
    split = update + 7
    # The split: only the CUDA-graph rows; ours over its floor (4.25 ms) and over static's call.
    assert lines[split + 5 : split + 7] == [
        "| 8 | 4 | 16384 | static | 4.00 | 2.00 | 1.90 | 4.25 | - | - |",
        "| 8 | 4 | 16384 | HostOffloadedCache | 10.00 | 4.50 | 2.00 | 4.25 | 1.06 | 2.25 |",
    ]
    # The kernels' time, only the profiled rows: 222 MiB copied in 4.44 ms busy is 52.4 GB/s, 0.95
    # of the run's 55.1; the model's kernels busy 3.85 ms against static's 3.5; 4.4 - 4.3 ms with no load.
    assert lines[split + 12 :] == [
        "| 8 | 4 | 16384 | static | cudagraphs | 3.90 | 0.00 | - | - | 3.50 | 0.00 | - | 1.00 |",
        "| 8 | 4 | 16384 | HostOffloadedCache | cudagraphs | 4.40 | 4.44 | 4.30 | 0.10 | 3.85 | 2.00 | 0.95 | 1.10 |",
    ]
    assert (
        "| H100 | 8 | 4 | 2048 | 16384 | HostOffloadedCache | cudagraphs | 400 | 10.00 | 1.05 | 4.25 | 1.11 |"
        in "\n".join(lines)
    )


def test_hf_offload_keeps_each_shape_done_and_orders_a_merged_table_by_shape(tmp_path, monkeypatch):
    """A run over shapes writes the CSV after each, so one stopped later (here the second shape
    fails) leaves the first for ``--merge``; a merged run's table reads in the shapes' order."""
    pytest.importorskip("transformers")
    hf = importlib.import_module("hf_offload")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # stands in the GPU the script asks for
    monkeypatch.setattr(hf, "memcpy_rate", lambda: 54.4)

    def shape_rows(layers, batch, sequence, capacity, *rest):
        if batch == 16:
            raise RuntimeError("stopped")
        rows = [hf_row(hf, cache, "eager", capacity, 54.4, layers=layers) for cache in ("static", "offloaded")]
        return [dict(r, batch=batch) for r in rows]

    monkeypatch.setattr(hf, "shape_rows", shape_rows)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="stopped"):
        hf.main(["--out", str(out), "--shapes", "32x4x2048x4,8x16x2048x4", "--graph-shapes", ""])
    done = hf.read_rows(out / "hf_offload.csv")
    assert [(r["layers"], r["batch"], r["cache"]) for r in done] == [(32, 4, "static"), (32, 4, "offloaded")]
    assert not (out / "hf_offload.md").exists()  # the table only when every shape ran
    hf.main(
        [
            "--out",
            str(out),
            "--shapes",
            "8x4x2048x8,8x4x2048x1",
            "--graph-shapes",
            "",
            "--merge",
            str(out / "hf_offload.csv"),
        ]
    )
    rows = hf.read_rows(out / "hf_offload.csv")
    assert [(r["layers"], r["context"], r["cache"]) for r in rows] == [
        (8, 2048, "static"), (8, 2048, "offloaded"), (8, 16384, "static"), (8, 16384, "offloaded"),
        (32, 8192, "static"), (32, 8192, "offloaded"),
    ]  # fmt: skip
    table = [line for line in (out / "hf_offload.md").read_text().splitlines() if line.startswith("| H100 |")]
    assert [line.split(" | ")[1:5] for line in table[::2]] == [
        ["8", "4", "2048", "2048"], ["8", "4", "2048", "16384"], ["32", "4", "2048", "8192"]
    ]  # fmt: skip


def test_hf_offload_update_excess_is_the_paired_one_where_a_run_has_it(tmp_path):
    """A run that paired each step of ours with static's reports that p50 (here 11.3 us per layer,
    not the 60.0 - 40.0 of the two p50s); a row from before that falls back to the difference."""
    pytest.importorskip("transformers")
    hf = importlib.import_module("hf_offload")
    parts = dict(part_layer_us=39.0, part_check_us=1.5, part_wait_us=2.0, part_issue_us=7.0, streamed_layers=7)
    rows = eager_pair(hf, 8, 40.0, 60.0, parts, update_excess_us=11.3) + eager_pair(hf, 4, 40.0, 60.0, parts)
    path = tmp_path / "hf_offload.csv"
    report.write_csv(path, rows, hf.COLUMNS)
    lines = hf.markdown(hf.read_rows(path)).splitlines()
    assert "| 8 | 4 | 16384 | 40.0 | 60.0 | 39.0 | 1.5 | 2.0 | 7.0 | 7 | 11.3 |" in lines
    assert "| 8 | 4 | 8192 | 40.0 | 60.0 | 39.0 | 1.5 | 2.0 | 7.0 | 7 | 20.0 |" in lines


def test_readmes_hf_table_keeps_the_default_and_budget_rows_and_leaves_the_comparisons_out(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    hf = importlib.import_module("hf_offload")
    rows = [
        hf_row(hf, "static", "cudagraphs", 4, 55.0, decode_tok_s=900.0),
        hf_row(hf, "offloaded", "eager", 4, 55.0, decode_tok_s=300.0),
        hf_row(hf, "HostOffloadedCache", "cudagraphs", 4, 55.0, decode_tok_s=700.0, step_vs_target=1.2),
        hf_row(hf, "HostOffloadedCache, half resident", "cudagraphs", 4, 55.0, decode_tok_s=800.0),
        hf_row(hf, "HostOffloadedCache, load ahead", "cudagraphs", 4, 55.0, decode_tok_s=500.0),
        hf_row(hf, f"HostOffloadedCache{hf.CARVEOUT}", "cudagraphs", 4, 55.0, decode_tok_s=600.0),
        hf_row(hf, "HostOffloadedCache, half resident", "eager", 4, 55.0, decode_tok_s=250.0),
    ]
    report.write_csv(tmp_path / "hf_offload.csv", rows, hf.COLUMNS)
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    table = [line for line in report.hf_offload() if line.startswith("| H100 | 8 x 4 x 2k, 4x")]
    assert [line.split(" | ")[3:7] for line in table] == [
        ["", "900", "300", "700"],
        ["half resident", "900", "300", "800"],
    ]


class HostEvent:
    """A CUDA event's interface on the host clock, for the CPU."""

    records = 0

    def record(self):
        self.at = time.perf_counter()
        HostEvent.records += 1

    def elapsed_time(self, end) -> float:
        return (end.at - self.at) * 1e3

    def synchronize(self):
        pass


def tiny_llama(layers: int, batch: int, length: int, seed: int):
    """hf_offload, and its tiny Llama on the CPU with a random prompt: (hf_offload, config, model, ids)."""
    hf = importlib.import_module("hf_offload")
    cfg = hf.config("tiny", layers)
    model = hf.build(cfg, torch.device("cpu"), torch.float32)
    return (
        hf,
        cfg,
        model,
        torch.randint(1, cfg.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed)),
    )


def test_hf_offload_splits_each_compiled_step_of_a_real_generate_from_the_work_between():
    pytest.importorskip("transformers")
    from transformers import CompileConfig, GenerationConfig, StaticCache

    hf, cfg, model, ids = tiny_llama(layers=2, batch=1, length=5, seed=3)
    compiled = CompileConfig(fullgraph=True, backend="eager")
    compiled._compile_all_devices = True
    gen = GenerationConfig(
        max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None, compile_config=compiled
    )
    cache = StaticCache(config=cfg, max_cache_len=16)
    HostEvent.records = 0
    call, between = hf.step_split(model, ids, cache, gen, event=HostEvent)
    assert call > 0 and between > 0
    # Two events around each compiled call: every decode step (5), and the prefill where the
    # transformers version runs it compiled too.
    assert HostEvent.records in (2 * 5, 2 * 6)
    assert "get_compiled_call" not in vars(model)  # generate() compiles as before afterwards
    eager = GenerationConfig(**{**gen.to_dict(), "compile_config": None, "disable_compile": True})
    with pytest.raises(RuntimeError, match="called a compiled step 0 times"):
        hf.step_split(model, ids, cache, eager, event=HostEvent)
    assert "get_compiled_call" not in vars(model)


def test_hf_offload_times_one_steps_loads_alone_and_every_load_moves_its_bytes():
    pytest.importorskip("transformers")
    from kv_ops.integrations.transformers import HostOffloadedCache

    hf, cfg, model, ids = tiny_llama(layers=6, batch=2, length=7, seed=4)
    cache = HostOffloadedCache(config=cfg, max_cache_len=64)
    per_position = 2 * 2 * cfg.num_key_value_heads * cfg.head_dim * 4  # K and V, batch 2, float32
    moved, load_now = [], cache.loads.load_now

    def counted(*args):
        before = cache.loads.moved
        load_now(*args)
        moved.append(cache.loads.moved - before)

    cache.loads.load_now = counted  # the prefill's loads come first, then loads_alone's
    seconds, nbytes = hf.loads_alone(model, ids, cache, reps=2, event=HostEvent)
    streamed = len(cache.loads.plan.streamed)
    assert seconds > 0 and nbytes == streamed * ids.shape[1] * per_position
    # Three reps (the first untimed) of every streamed layer's load, none skipped by its claim:
    # each timed rep moves the step's bytes, no write-back left.
    ours = moved[-3 * streamed :]
    assert len(moved) >= 3 * streamed and sum(ours[streamed:]) == 2 * nbytes


def test_hf_offload_eager_runs_take_turns_and_a_failing_one_drops_out(capsys):
    pytest.importorskip("transformers")
    hf, common = importlib.import_module("hf_offload"), importlib.import_module("common")
    calls, steps = [], {"static": [0.012, 0.009, 0.011], "ours": [0.010, 0.013, 0.008], "bad": [0.005]}

    def timer(name):
        def once():
            calls.append(name)
            if not steps[name]:
                raise RuntimeError(f"{name} broke")
            return steps[name].pop(0)

        return once

    failures = len(common.FAILURES)
    turns = {}
    try:
        best = hf.best_in_turns({name: timer(name) for name in ("static", "ours", "bad")}, 3, turns=turns)
        assert common.FAILURES[failures:] == ["bad"]
    finally:
        del common.FAILURES[failures:]
    assert best == {"static": 0.009, "ours": 0.008}
    assert calls == ["static", "ours", "bad", "static", "ours", "bad", "static", "ours"]
    assert "bad broke" in capsys.readouterr().err
    assert turns == {"static": [0.012, 0.009, 0.011], "ours": [0.010, 0.013, 0.008], "bad": [0.005]}
    # Paired turn by turn: ours over static 0.833, 1.444, 0.727 -> 0.833 (the best of each gives 0.889);
    # a timer that dropped out pairs only the turns it ran.
    ratios = hf.paired(turns, "static")
    assert ratios["ours"] == pytest.approx(0.010 / 0.012) and ratios["bad"] == pytest.approx(0.005 / 0.012)
    assert set(ratios) == {"ours", "bad"} and hf.paired(turns, None) == {}


def test_hf_offload_markdown_shows_the_paired_ratios_only_where_a_run_kept_them(tmp_path):
    pytest.importorskip("transformers")
    hf = importlib.import_module("hf_offload")
    # A CSV from before the column reads with no paired figure, and draws no table.
    with open(report.RESULTS / "hf_offload.csv", newline="") as f:
        old = [{k: v for k, v in row.items() if k != "paired_vs_static"} for row in csv.DictReader(f)]
    with open(tmp_path / "old.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(old[0]))
        writer.writeheader()
        writer.writerows(old)
    rows = hf.read_rows(tmp_path / "old.csv")
    assert "Eager, paired" not in hf.markdown(rows)
    shape = (rows[0]["layers"], rows[0]["batch"], rows[0]["context"])
    of_shape = [dict(r) for r in rows if (r["layers"], r["batch"], r["context"]) == shape]
    for r in of_shape:
        r["paired_vs_static"] = 1.25 if r["cache"] == "HostOffloadedCache" and r["mode"] == "eager" else None
    text = hf.markdown(of_shape)
    assert "Eager, paired" in text
    line = next(x for x in text.splitlines() if x.endswith("|") and "| HostOffloadedCache | 1.250 |" in x)
    static = next(r["step_ms"] for r in of_shape if r["cache"] == "static" and r["mode"] == "eager")
    ours = next(r["step_ms"] for r in of_shape if r["cache"] == "HostOffloadedCache" and r["mode"] == "eager")
    assert line.endswith(f"| {ours / static:.3f} |")


@pytest.mark.parametrize("script", ["block_copy", "engine", "host_cost", "layerwise", "layerwise_parts", "ple_latency"])
def test_every_script_writes_and_plots_through_report(script):
    # Directly or through common.save: no script has a CSV writer or a figure of its own.
    module = importlib.import_module(script)
    for name in ("write_csv", "figure", "save_figure"):
        assert getattr(module, name, getattr(report, name)) is getattr(report, name), name
    assert sys.modules["common"].write_csv is report.write_csv
    assert "import csv" not in Path(module.__file__).read_text()


def test_readme_performance_section_is_what_the_results_give():
    readme = report.README.read_text()
    assert report.BEGIN in readme and report.END in readme
    assert report.render(readme) == readme, "README.md's Performance section is stale: run python benchmarks/report.py"
    assert report.main(["--check"]) == 0


def test_the_section_has_a_table_and_links_for_every_benchmark():
    section = report.section()
    for name in ("block_copy", "engine", "host_cost", "layerwise", "layerwise_parts", "ple_latency", "hf_offload"):
        assert f"(benchmarks/results/{name}.csv)" in section and f"(benchmarks/results/{name}.png)" in section, name
    for name in ("decode_loop", "gemma3n", "gemma4"):
        assert f"(benchmarks/results/{name}.txt)" in section, name
    assert section.count("### ") == 9 and section.count("| --- ") + section.count("| ---: ") >= 7


def test_render_replaces_only_between_the_markers_and_check_fails_on_a_stale_section(tmp_path, monkeypatch, capsys):
    stale = f"# intro\n\n{report.BEGIN}\nold figures\n{report.END}\n\n## after\n"
    fresh = report.render(stale)
    assert fresh.startswith(f"# intro\n\n{report.BEGIN}\n## Performance\n") and fresh.endswith(
        f"{report.END}\n\n## after\n"
    )
    assert "old figures" not in fresh and report.render(fresh) == fresh
    path = tmp_path / "README.md"
    path.write_text(stale)
    monkeypatch.setattr(report, "README", path)
    assert report.main(["--check"]) == 1 and path.read_text() == stale
    assert report.main([]) == 0 and path.read_text() == fresh
    assert report.main(["--check"]) == 0
    with pytest.raises(ValueError, match="markers"):
        report.render("# no markers\n")
