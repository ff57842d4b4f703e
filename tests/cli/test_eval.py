"""`dlmrt eval` and dlmrt.eval.evaluation: setting specs, JSONL examples, the grid, the JSON and the plot."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

import dlmrt
from dlmrt.core import tasks
from dlmrt.cli.commands import main
from dlmrt.core.errors import ArgumentError
from dlmrt.eval.evaluation import default_grid, evaluate_grid, exact_match, load_jsonl, parse_setting
from dlmrt.models import checkpoint
from dlmrt.runtime import Factor, Fixed, GenerationSettings, LLaDA2, ResidualPolicy, Threshold
from dlmrt.core.tasks import Example
from helpers import LLADA, random_model

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CLI_SETTINGS = ("threshold:threshold=0.9", "fixed:steps=16")  # deliberately not sorted


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def tiny():
    return dlmrt.load()


@pytest.fixture(scope="module")
def random_model_dir(tmp_path_factory):
    model = random_model(LLADA)
    model.generation_config = {"gen_length": 8, "block_length": 4}
    return checkpoint.save(model, tmp_path_factory.mktemp("eval") / "model")


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """`dlmrt eval` on the tiny model: 5 examples per task, two settings, JSON and plot."""
    out = tmp_path_factory.mktemp("eval-out")
    args = ["eval", "--per-task", 5, "--mode", "eager", "--json", out / "results.json", "--plot", out / "curve.png"]
    for spec in CLI_SETTINGS:
        args += ["--setting", spec]
    result = run(*args)
    assert result.exit_code == 0, result.output
    return result, json.loads((out / "results.json").read_text()), (out / "curve.png").read_bytes()


# -- setting specs --------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, policy", [
    ("fixed", Fixed()),
    ("fixed:steps=16", Fixed(16)),
    ("fixed:steps=4,remasking=random", Fixed(4, "random")),
    ("threshold:threshold=0.7,confidence=margin", Threshold(0.7, "margin")),
    (" threshold : threshold = 0.8 ", Threshold(0.8)),
    ("factor:factor=2", Factor(2.0)),
    ("llada2:threshold=0.9,steps=8", LLaDA2(0.9, 8)),
    ("llada2:minimal-topk=2", LLaDA2(minimal_topk=2)),
    ("residual:threshold=0.9", ResidualPolicy(Threshold(0.9))),
    ("residual:factor=2", ResidualPolicy(Factor(2.0))),
])
def test_setting_specs_make_policies(spec, policy):
    setting = parse_setting(spec)
    assert setting.policy == policy
    assert setting.label == spec.strip()


@pytest.mark.parametrize("spec, message", [
    ("greedy:steps=4", "unknown policy 'greedy' (known: fixed, threshold, factor, llada2, llada21, dream, residual, "
                       "entropy_bound)"),
    ("fixed:threshold=0.9", "fixed takes steps, remasking; not 'threshold'"),
    ("threshold:steps=4", "threshold takes threshold, confidence; not 'steps'"),
    ("fixed:steps=four", "steps must be an integer, got 'four'"),
    ("factor:factor=big", "factor must be a number, got 'big'"),
    ("fixed:steps", "expected key=value after fixed:, got 'steps' (e.g. fixed:steps=...)"),
    ("fixed:", "expected key=value after fixed:, got '' (e.g. fixed:steps=...)"),
    ("fixed:steps=4,steps=8", "steps is given twice"),
    ("residual:threshold=0.9,factor=2", "residual takes a threshold or a factor, not both"),
])
def test_bad_setting_specs_give_one_clear_error(spec, message):
    with pytest.raises(ArgumentError) as error:
        parse_setting(spec)
    assert str(error.value) == f"setting {spec!r}: {message}"


def test_the_default_grid():
    assert [s.label for s in default_grid(16, 8)] == [
        "fixed:steps=16", "fixed:steps=8", "fixed:steps=4",
        *(f"threshold:threshold={t}" for t in ("0.5", "0.7", "0.8", "0.9", "0.95", "0.99")),
        "factor:factor=1", "factor:factor=2", "factor:factor=4", "factor:factor=8"]
    # 8 blocks: 4 steps cannot be spread over them
    assert [s.label for s in default_grid(16, 2) if s.policy.name == "fixed"] == ["fixed:steps=16", "fixed:steps=8"]


@pytest.mark.parametrize("spec, message", [
    ("threshold:threshold=1.5", "threshold must lie in (0, 1], got 1.5"),
    ("fixed:steps=3", "steps (3) must be divisible by the number of blocks"),
    ("threshold:confidence=certain", "confidence must be one of prob, margin, entropy"),
    ("residual:threshold=0.9", "policy 'residual' needs an ORL model"),
])
def test_every_setting_is_checked_before_any_compute(spec, message):
    model = random_model(LLADA)
    batches = []
    grid = [parse_setting("fixed"), parse_setting(spec)]
    with pytest.raises(ArgumentError, match=f"^setting {spec!r}: ") as error:
        evaluate_grid(model, [Example("rev", "rev:abc=", "cba")], GenerationSettings(8, 4), grid,
                      on_batch=lambda setting, n: batches.append(setting))
    assert message in str(error.value)
    assert batches == []


# -- JSONL examples -------------------------------------------------------------------------------

def test_jsonl_examples(tmp_path):
    path = tmp_path / "examples.jsonl"
    path.write_text('{"prompt": "rev:abc=", "answer": "cba"}\n\n'
                    '{"prompt": "add:001+002=", "answer": "0003", "task": "add", "id": 7}\n')
    assert load_jsonl(path) == [Example("jsonl", "rev:abc=", "cba"), Example("add", "add:001+002=", "0003")]


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "a", ', "not valid JSON"),
    ("[1, 2]", 'expected a JSON object with "prompt" and "answer", got list'),
    ('{"prompt": "a"}', "the object has no 'answer' field"),
    ('{"answer": "a"}', "the object has no 'prompt' field"),
    ('{"prompt": "a", "answer": 3}', "'answer' must be a string, got 3"),
    ('{"prompt": "a", "answer": "b", "task": null}', "'task' must be a string, got null"),
])
def test_a_bad_jsonl_line_is_named(tmp_path, line, message):
    path = tmp_path / "examples.jsonl"
    path.write_text(f'{{"prompt": "rev:abc=", "answer": "cba"}}\n{line}\n')
    with pytest.raises(ArgumentError) as error:
        load_jsonl(path)
    assert str(error.value).startswith(f"{path} line 2") and message in str(error.value)


def test_an_empty_or_missing_jsonl_file(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ArgumentError, match="holds no examples"):
        load_jsonl(tmp_path / "empty.jsonl")
    with pytest.raises(ArgumentError, match=r"missing.jsonl cannot be read \(No such file or directory\)"):
        load_jsonl(tmp_path / "missing.jsonl")


# -- dlmrt eval ---------------------------------------------------------------------------------

def test_eval_prints_a_table_in_the_order_given(cli_run):
    result, _, _ = cli_run
    positions = [result.output.index(spec) for spec in CLI_SETTINGS]
    assert positions == sorted(positions)
    for column in (*tasks.TASKS, "mean", "TPF", "tokens/s", "NFE"):
        assert column in result.output


def test_eval_writes_json_and_a_png(cli_run):
    _, document, png = cli_run
    assert png.startswith(PNG_SIGNATURE)
    assert document["model"] == "tiny-llada" and document["examples"] == 5 * len(tasks.TASKS)
    assert [r["setting"] for r in document["results"]] == list(CLI_SETTINGS)
    for entry in document["results"]:
        assert set(entry) == {"setting", "policy", "exact_match", "mean", "metrics"}
        assert set(entry["exact_match"]) == set(tasks.TASKS)
        assert all(0 <= value <= 1 for value in entry["exact_match"].values())
        assert entry["mean"] == pytest.approx(sum(entry["exact_match"].values()) / len(tasks.TASKS))
        assert entry["metrics"]["batch_size"] == 5 * len(tasks.TASKS) and entry["metrics"]["tpf"] > 0
    assert document["results"][0]["policy"] == {"name": "threshold", "threshold": 0.9, "confidence": "prob"}
    fixed = document["results"][1]["metrics"]
    assert fixed["tpf"] == 1.0 and fixed["nfe"] == 16  # one token per step, 2 blocks of 8 steps


def test_eval_scores_equal_exact_match(cli_run, tiny):
    _, document, _ = cli_run
    examples = tasks.examples("test", per_task=5, seed=0)
    for entry in document["results"]:
        settings = GenerationSettings(16, 8, parse_setting(entry["setting"]).policy)
        score = exact_match(tiny, examples, settings, mode="eager")  # as the CLI run: it is not about compile
        assert entry["exact_match"] == score.per_task
        assert entry["metrics"]["generated_tokens"] == score.metrics.generated_tokens
        assert entry["metrics"]["nfe"] == score.metrics.nfe


def test_eval_on_a_jsonl_file(tmp_path, random_model_dir):
    data = tmp_path / "examples.jsonl"
    data.write_text('{"prompt": "rev:abc=", "answer": "cba"}\n{"prompt": "sort:321=", "answer": "123"}\n')
    result = run("eval", "--model", random_model_dir, "--data", data, "--setting", "factor:factor=2",
                 "--json", tmp_path / "out.json", "--mode", "eager")
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / "out.json").read_text())
    assert document["examples"] == 2 and document["settings"]["gen_length"] == 8
    assert list(document["results"][0]["exact_match"]) == ["jsonl"]


@pytest.mark.parametrize("args, message", [
    (["--setting", "fixed:steps=x"], "setting 'fixed:steps=x': steps must be an integer, got 'x'"),
    (["--setting", "threshold:threshold=2"], "setting 'threshold:threshold=2': threshold must lie in (0, 1]"),
    (["--tasks", "rev,div"], "expected task names from rev, sort, add, same, psum, mul"),
    (["--data", "examples.jsonl", "--per-task", "3"], "--data replaces the task suite: drop --per-task"),
    (["--plot", "curve.svg"], "the plot is a PNG: give a path ending in .png"),
])
def test_bad_eval_input_gives_one_clear_line(random_model_dir, args, message):
    result = run("eval", "--model", random_model_dir, *args)
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_plot_without_matplotlib_fails_before_loading_the_model(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    result = run("eval", "--model", tmp_path / "no-such-model", "--plot", tmp_path / "curve.png")
    assert result.exit_code == 2
    assert "the plot needs matplotlib: pip install 'dlmrt[plot]'" in result.output
    assert not (tmp_path / "curve.png").exists()
