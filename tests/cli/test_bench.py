"""`dlmrt bench`: cases side by side, the figures people compare, and one line for bad input."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from dlmrt.cli.commands import main


def bench(*args):
    return CliRunner().invoke(main, ["bench", *map(str, args)])


def test_backends_and_modes_side_by_side_give_the_same_tokens(tmp_path):
    pytest.importorskip("onnxruntime")
    out = tmp_path / "bench.json"
    # the shapes and cache of tests/test_bench_gate.py's suite, whose compiled graphs the session's cache may hold
    result = bench("--backend", "torch:eager,torch:compile,ort", "--batch-size", 2, "--input-len", 8, "--output-len",
                   16, "--block-length", 8, "--cache", "dual", "--num-iters", 2, "--output-json", out)
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    assert document["format_version"] == 1
    assert {"cpu", "threads", "torch", "onnxruntime"} <= set(document["environment"])
    run = document["scenarios"]["bench"]
    assert run["model"] == "tiny-llada"
    assert {k: run["scenario"][k] for k in ("batch_size", "input_len", "output_len", "seed")} == {
        "batch_size": 2, "input_len": 8, "output_len": 16, "seed": 0}
    cases = run["cases"]
    assert [c["setting"] for c in cases] == ["torch:eager", "torch:compile", "ort"]
    assert len({c["tokens_sha256"] for c in cases}) == 1 and all(c["same_tokens"] for c in cases)
    for case in cases:
        assert case["nfe"] > 0 and case["tpf"] >= 1
        assert 0 < case["latency_p50_s"] <= case["latency_p90_s"] and 0 < case["step_p50_s"] <= case["step_p90_s"]
        assert case["peak_memory_bytes"] > 0
    assert "torch:compile" in result.output and "tokens/s" in result.output


def test_onnx_runtime_runs_on_the_defaults(tmp_path):
    """Its export is sized for exactly the canvas of the default lengths, which fill the tiny model's context."""
    pytest.importorskip("onnxruntime")
    result = bench("--backend", "ort", "--num-iters", 1, "--num-iters-warmup", 0)
    assert result.exit_code == 0, result.output
    assert "input 32, output 32" in result.output


def test_the_cpu_quantized_exports_run_beside_the_float_one(tmp_path):
    """ort:int8 and ort:int8-dynamic run quantized copies of the ort case's export, in the same rounds."""
    pytest.importorskip("onnxruntime")
    out = tmp_path / "bench.json"
    result = bench("--backend", "ort,ort:int8,ort:int8-dynamic", "--batch-size", 2, "--input-len", 8,
                   "--output-len", 16, "--block-length", 8, "--num-iters", 1, "--output-json", out)
    assert result.exit_code == 0, result.output
    cases = json.loads(out.read_text())["scenarios"]["bench"]["cases"]
    assert [c["setting"] for c in cases] == ["ort", "ort:int8", "ort:int8-dynamic"]
    assert all(case["nfe"] > 0 for case in cases)


def test_a_named_random_config_needs_no_download(tmp_path):
    out = tmp_path / "bench.json"
    result = bench("--model", "llada2-moe-small", "--input-len", 8, "--output-len", 8, "--num-iters", 1,
                   "--num-iters-warmup", 0, "--policy", "llada2", "--output-json", out)
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())["scenarios"]["bench"]
    assert document["model"] == "llada2-moe-small" and document["settings"]["threshold"] == 0.95
    again = tmp_path / "again.json"
    assert bench("--model", "llada2-moe-small", "--input-len", 8, "--output-len", 8, "--num-iters", 1,
                 "--num-iters-warmup", 0, "--policy", "llada2", "--output-json", again).exit_code == 0
    repeated = json.loads(again.read_text())["scenarios"]["bench"]
    assert repeated["cases"][0]["tokens_sha256"] == document["cases"][0]["tokens_sha256"]


@pytest.mark.parametrize("args, message", [
    (["--backend", "tensorflow"], "unknown backend 'tensorflow'"),
    (["--backend", "torch:fast"], "unknown backend 'torch:fast'"),
    (["--backend", "ort:int3"], "unknown backend 'ort:int3': give torch[:eager|compile|cudagraph|auto][:fp8], "
                                "ort[:int8|int4|int8-dynamic] or reference"),
    (["--backend", "torch,torch:auto"], "names a backend twice"),
    (["--model", "llada-9000"], "is neither a model directory nor a random config"),
    (["--num-iters", "0"], "'--num-iters': 0 is not in the range"),
    (["--output-len", "12", "--block-length", "8"], "gen-length (12) must be divisible by block-length (8)"),
])
def test_bad_input_is_one_line(args, message):
    result = bench(*args)
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output, result.output


SUITE = """
format_version = 1
name = "test"

[defaults]
backends = ["reference", "torch:eager"]
num_iters = 3
num_iters_warmup = 1

[scenarios.tiny]
batch_size = 2
input_len = 8
output_len = 16
block_length = 8
policy = "threshold"
cache = "dual"
"""


@pytest.fixture
def suite(tmp_path):
    path = tmp_path / "suite.toml"
    path.write_text(SUITE)
    baseline = tmp_path / "baseline.json"
    result = bench("--suite", path, "--baseline", baseline, "--update-baseline")
    assert result.exit_code == 0, result.output
    return path, baseline


@pytest.mark.timing
def test_the_gate_passes_an_unchanged_tree_and_writes_its_summaries(suite, tmp_path):
    path, baseline = suite
    recorded = json.loads(baseline.read_text())
    case = recorded["scenarios"]["tiny"]["cases"]["torch:eager"]
    [timings] = recorded["timings"].values()  # this machine's class
    assert recorded["suite"] == "test" and {"tokens_sha256", "nfe", "tpf", "work"} <= set(case)
    assert {"ratio", "ratio_low", "ratio_high"} <= set(timings["tiny"]["cases"]["torch:eager"])
    summary, junit = tmp_path / "gate.md", tmp_path / "gate.xml"
    result = bench("--suite", path, "--baseline", baseline, "--check", "--summary", summary, "--junit", junit)
    assert result.exit_code == 0, result.output
    assert "| tiny | pass |" in summary.read_text() and 'failures="0"' in junit.read_text()
    assert json.loads(baseline.read_text()) == recorded  # --check never writes the baseline


@pytest.mark.timing
def test_the_gate_fails_a_slowdown_that_repeats(suite, monkeypatch, tmp_path):
    import time

    from dlmrt.runtime.executor import Executor

    path, baseline = suite
    run = Executor.run

    def slow_run(self, *args, **kwargs):  # redundant work on every step: a regression of the loop
        time.sleep(0.05)  # tens of times a tiny step: far beyond the noise of a loaded machine
        return run(self, *args, **kwargs)

    monkeypatch.setattr(Executor, "run", slow_run)
    junit = tmp_path / "gate.xml"
    result = bench("--suite", path, "--baseline", baseline, "--check", "--junit", junit)
    assert result.exit_code == 1, result.output
    assert "scenario tiny, torch:eager: speed vs reference is" in result.output
    assert "below the baseline's" in result.output and 'failures="1"' in junit.read_text()


def test_the_gate_fails_a_change_of_output(suite, monkeypatch):
    from dlmrt.models import step_graph

    path, baseline = suite
    unmask = step_graph.parallel_unmask

    def flipped_ties(logits, *args, **kwargs):  # near-ties broken the other way
        return unmask(logits + 0.05 * torch.arange(logits.shape[-1], dtype=logits.dtype), *args, **kwargs)

    monkeypatch.setattr(step_graph, "parallel_unmask", flipped_ties)
    result = bench("--suite", path, "--baseline", baseline, "--check")
    assert result.exit_code == 1, result.output
    assert "scenario tiny, torch:eager: tokens_sha256 is" in result.output and "it must not change" in result.output


@pytest.mark.parametrize("suite_text, message", [
    (SUITE.replace("batch_size = 2", "batch_sise = 2"), "unknown key 'batch_sise'"),
    (SUITE.replace("batch_size = 2", 'batch_size = "2"'), "batch_size must be int, got '2'"),
    (SUITE.replace("format_version = 1", "format_version = 2"), "format_version must be 1, got 2"),
    (SUITE.replace('backends = ["reference", "torch:eager"]', 'backends = "torch"'),
     "backends must be a non-empty list of strings"),
    (SUITE + "\n[scenarios.other]\nmodel = \"llada-9000\"\n", "is neither a model directory nor a random config"),
    ("name = [", "is not valid TOML"),
    (SUITE.replace("batch_size = 2", "batch_size = 2\nmargin = 0.2"), "margin must be a number from 0 to 0.15"),
])
def test_a_bad_suite_is_one_error_naming_the_field(tmp_path, suite_text, message):
    path = tmp_path / "suite.toml"
    path.write_text(suite_text)
    result = bench("--suite", path, "--baseline", tmp_path / "b.json", "--update-baseline")
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "b.json").exists()


def test_a_baseline_of_another_suite_or_version_or_corrupt_is_refused_and_kept(suite, tmp_path):
    path, baseline = suite
    recorded = json.loads(baseline.read_text())
    for edit, message in ((dict(recorded, suite="other"), "is the baseline of suite 'other', not 'test'"),
                          (dict(recorded, format_version=7), "has format_version 7")):
        baseline.write_text(json.dumps(edit))
        result = bench("--suite", path, "--baseline", baseline, "--check")
        assert result.exit_code == 2 and message in result.output, result.output
    baseline.write_text("{corrupt")
    result = bench("--suite", path, "--baseline", baseline, "--check")
    assert result.exit_code == 2 and "is not valid JSON" in result.output
    assert baseline.read_text() == "{corrupt"
    result = bench("--suite", path, "--scenario", "nope", "--baseline", baseline, "--update-baseline")
    assert result.exit_code == 2 and "has no scenario 'nope' (it has: tiny)" in result.output


def test_on_a_machine_class_without_timings_the_gate_checks_counted_figures_and_says_so(suite, monkeypatch):
    path, baseline = suite
    recorded = json.loads(baseline.read_text())
    [timings] = recorded["timings"].values()
    timings["tiny"]["cases"]["torch:eager"]["ratio"] = 100.0  # would fail on the class that recorded it
    baseline.write_text(json.dumps(dict(recorded, timings={"riscv64 OtherVendor DEFAULT": timings})))
    result = bench("--suite", path, "--baseline", baseline, "--check")
    assert result.exit_code == 0, result.output
    assert "the baseline has no timings for this machine class" in result.output
    assert "it has: riscv64 OtherVendor DEFAULT" in result.output


def test_suite_options_are_not_mixed_with_one_scenario_options(suite):
    path, baseline = suite
    result = bench("--suite", path, "--batch-size", 4)
    assert result.exit_code == 2 and "--suite sets every scenario's options: drop --batch-size" in result.output
    result = bench("--check")
    assert result.exit_code == 2 and "need --suite" in result.output


def test_every_run_appends_to_the_history_and_the_plot_draws_its_trend(suite, tmp_path):
    pytest.importorskip("matplotlib")
    path, baseline = suite
    history, plot = tmp_path / "history.jsonl", tmp_path / "trend.png"
    for _ in range(2):
        result = bench("--suite", path, "--baseline", baseline, "--check", "--history", history, "--plot", plot)
        assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in history.read_text().splitlines()]
    assert len(lines) == 2 and all(line["suite"] == "test" for line in lines)
    case = lines[-1]["scenarios"]["tiny"]["cases"]["torch:eager"]
    assert case["ratio"] > 0 and case["tokens_sha256"] == json.loads(baseline.read_text())[
        "scenarios"]["tiny"]["cases"]["torch:eager"]["tokens_sha256"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    history.write_text(history.read_text() + "{broken\n")
    result = bench("--suite", path, "--history", history)
    assert result.exit_code == 2 and "history.jsonl line 3 is not valid JSON" in result.output


def test_the_ort_case_without_the_onnx_extra_names_it(monkeypatch):
    import importlib.util
    import sys

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnx" else find_spec(name, *a))
    monkeypatch.setitem(sys.modules, "onnx", None)  # `import onnx` fails, as where it is not installed
    monkeypatch.delitem(sys.modules, "dlmrt.export.onnx_export", raising=False)
    result = bench("--backend", "torch:eager,ort", "--num-iters", 1)
    assert result.exit_code == 2 and "pip install 'dlmrt[onnx]'" in result.output, result.output


def realistic_rows() -> list[dict]:
    """Rows as measure() and run_scenario() give them, with long labels and wide numbers."""
    def row(setting, tokens_per_s, nfe, same_tokens):
        step_s = 32 / tokens_per_s / nfe
        return {"setting": setting, "tokens_per_s": tokens_per_s, "tokens_per_s_range": [0.9 * tokens_per_s,
                                                                                           1.2 * tokens_per_s],
                "speedup": tokens_per_s / 20298.4, "tpf": 32 / nfe, "nfe": nfe, "step_p50_s": step_s,
                "step_p90_s": 1.3 * step_s, "latency_p50_s": step_s * nfe, "latency_p90_s": 1.3 * step_s * nfe,
                "host_fraction": 0.004, "peak_memory_bytes": 401 << 20, "tokens_sha256": "13cc2d27c600a1b2",
                "same_tokens": same_tokens}
    return [row("torch:cudagraph", 20298.4, 5, True), row("torch:compile", 16844.1, 5, True),
            row("ort", 12623.9, 5, False), row("reference", 9.8, 1024, None)]


def test_the_table_fits_a_terminal_of_100_columns():
    import io

    from rich.console import Console

    from dlmrt.cli.bench import results_table
    from dlmrt.runtime import GenerationSettings, Threshold

    settings = GenerationSettings(1024, 32, Threshold(0.9), cache="dual")
    out = io.StringIO()
    Console(file=out, width=100).print(results_table(realistic_rows(), "bench: tiny-llada", 64, 512, settings,
                                                     {"correct": 75, "total": 80}))
    lines = out.getvalue().splitlines()
    assert max(map(len, lines)) <= 100, out.getvalue()
    assert "…" not in out.getvalue()
    body = [line for line in lines if line.startswith("│")]
    assert len(body) == 4, out.getvalue()  # one line a case: no cell wrapped
    for cells in (["torch:cudagraph", "20298.4", "1.00x", "6.40", "5", "yes"], ["reference", "9.8", "1024", "-"]):
        line = next(line for line in body if cells[0] in line)
        assert all(f" {cell} " in line for cell in cells), line


def test_the_printed_table_is_at_most_100_columns_wide():
    result = bench("--output-len", 8, "--block-length", 8, "--num-iters", 1, "--num-iters-warmup", 0)
    assert result.exit_code == 0, result.output
    assert "tokens/s" in result.output and max(map(len, result.output.splitlines())) <= 100, result.output


def test_the_quality_floor_is_an_exact_count_that_can_fall(tmp_path, monkeypatch):
    """The tiny model is scored at the length it was trained for (not the scenario's output_len, where it
    scores 0 and a fall could never show), as a count of right answers that the gate holds exactly."""
    path, baseline = tmp_path / "suite.toml", tmp_path / "baseline.json"
    path.write_text(SUITE.replace('policy = "threshold"\ncache = "dual"',
                                  'policy = "fixed"\ncache = "none"\nexact_match_per_task = 5'))
    assert bench("--suite", path, "--baseline", baseline, "--update-baseline").exit_code == 0
    recorded = json.loads(baseline.read_text())["scenarios"]["tiny"]["exact_match"]
    assert recorded["total"] == 20 and recorded["correct"] >= 17, recorded  # near all right: room to fall

    from dlmrt.core import tasks

    right = tasks.is_correct
    monkeypatch.setattr("dlmrt.eval.evaluation.is_correct",
                        lambda example, answer: example.task != "rev" and right(example, answer))
    result = bench("--suite", path, "--baseline", baseline, "--check")
    assert result.exit_code == 1, result.output
    assert f"exact_match is {{'correct': {recorded['correct'] - 5}, 'total': 20}}" in result.output
