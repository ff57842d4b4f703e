"""ORL training at small scale: what a rollout records, the objective, the loop's checkpoints, and
the errors of bad input."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import dlmrt
from dlmrt.core import hashing, tasks
from dlmrt.core.errors import ArgumentError, CheckpointError, UnsupportedFeatureError
from dlmrt import models
from dlmrt.models import checkpoint
from dlmrt.orl import objective, rollout, trainer
from dlmrt.orl.trainer import Run, TrainingConfig
from dlmrt.runtime import Fixed, GenerationSettings, Threshold, reference, text
from dlmrt.core.tasks import Example
from helpers import LLADA, ORL, config, random_model

SMALL = TrainingConfig(iterations=2, prompts=16, updates=3, batch_size=8, rollout_batch=16,
                       policy="threshold:threshold=0.7")


class Spy:
    """A model that records the ids and residual of every denoise call (the reference loop's steps)."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def denoise(self, ids, **kwargs):
        self.calls.append((ids.clone(), kwargs["residual"]))
        return self.model.denoise(ids, **kwargs)


@pytest.fixture(scope="module")
def loud_orl():
    """An ORL model whose adapter visibly changes each step's input."""
    model = random_model(config(LLADA, residual_context=ORL), seed=3)
    with torch.no_grad():
        model.residual_adapter().output_layer().weight.mul_(10)
    return model


def own_answers(model, prompts: list[str], settings: GenerationSettings) -> list[Example]:
    """Examples whose answer is what `model` decodes (so every row verifies), by the reference loop."""
    out = reference.generate(model, [text.encode(model, p) for p in prompts], settings)
    return [Example("own", prompt, text.decode(model, text.completion(row.tolist(), (*model.tokens.eos_ids,
                                                                                       model.tokens.mask_id))))
            for prompt, row in zip(prompts, out.tokens)]


def test_the_rollout_records_what_each_step_consumed(loud_orl):
    """The recorded canvas, z and certainty of each step are the reference loop's, step by step."""
    settings = GenerationSettings(gen_length=8, block_length=4, policy=Fixed(8), ignore_eos=True)
    [example] = own_answers(loud_orl, ["rev:abc="], settings)
    spy = Spy(loud_orl)
    reference.generate(spy, [text.encode(loud_orl, example.prompt)], settings)
    states = rollout.rollout(loud_orl, [example], settings, canvas=16, batch=2).states
    assert len(states) == len(spy.calls) == 8
    width = len(example.prompt) + 8
    for index, (ids, residual) in enumerate(spy.calls):
        assert torch.equal(states.ids[index, -width:], ids[0])
        if residual is None:
            assert not states.z[index].any() and not states.certainty[index].any()
        else:
            torch.testing.assert_close(states.z[index, -width:], residual.z[0])
            torch.testing.assert_close(states.certainty[index, -width:], residual.certainty[0])
    assert not states.key_mask[:, :-width].any()  # the rollout bucket's extra padding


def test_source_entropy_is_that_of_the_step_whose_residual_was_consumed(loud_orl):
    """certainty = 1 - H / log V of the previous step's prediction, so the two records agree."""
    settings = GenerationSettings(gen_length=8, block_length=4, policy=Fixed(8))
    examples = own_answers(loud_orl, ["rev:abc=", "sort:3141="], settings)
    states = rollout.rollout(loud_orl, examples, settings, canvas=24, batch=4).states
    first = states.source_entropy.isnan().all(1)
    assert first.sum() == 2 and not states.certainty[first].any()
    later = ~first
    real = states.key_mask[later]
    expected = (1 - states.certainty[later]) * math.log(loud_orl.vocab_size)
    torch.testing.assert_close(states.source_entropy[later][real], expected[real], atol=1e-4, rtol=1e-4)


def test_only_verified_rows_are_kept(loud_orl):
    settings = GenerationSettings(gen_length=8, block_length=4, policy=Fixed(8))
    right = own_answers(loud_orl, ["rev:abc=", "add:123+456="], settings)
    wrong = [replace(right[1], answer=right[1].answer + "0")]
    kept = rollout.rollout(loud_orl, right, settings, canvas=24, batch=4)
    mixed = rollout.rollout(loud_orl, [right[0], *wrong], settings, canvas=24, batch=4)
    assert kept.exact_match == 1.0 and mixed.exact_match == 0.5
    assert len(kept.states) == 16 and len(mixed.states) == 8
    assert torch.equal(mixed.states.ids, kept.states.ids[kept.states.targets[:, -8:].eq(
        kept.states.targets[0, -8:]).all(1)])


@pytest.mark.parametrize("next_h, source_h, unresolved, expected", [
    ([[1.0, 2.0]], [[2.0, 2.0]], [[True, True]], 0.0),  # 1.5 <= 0.75 * 2
    ([[3.0, 3.0]], [[2.0, 2.0]], [[True, True]], 2.25),  # (3 - 1.5)^2
    ([[3.0, 9.0]], [[2.0, 5.0]], [[True, False]], 2.25),  # resolved positions do not count
    ([[3.0, 1.0], [4.0, 4.0]], [[math.nan, math.nan], [4.0, 4.0]], [[True, True], [True, True]], 1.0),
])
def test_the_contraction_term_by_hand(next_h, source_h, unresolved, expected):
    value = objective.contraction(torch.tensor(next_h), torch.tensor(source_h), torch.tensor(unresolved), rho=0.25)
    assert value.item() == pytest.approx(expected)


def test_the_objective_is_cross_entropy_on_masked_positions_plus_the_weighted_term(loud_orl):
    settings = GenerationSettings(gen_length=8, block_length=4, policy=Fixed(8))
    examples = own_answers(loud_orl, ["rev:abc=", "sort:3141="], settings)
    states = rollout.rollout(loud_orl, examples, settings, canvas=24, batch=4).states
    loss = objective.orl_loss(loud_orl, states, rho=0.25, aec_weight=0.5)
    logits = loud_orl.denoise(states.ids, positions=states.positions, key_mask=states.key_mask,
                              residual=states.residual()).logits
    terms = [F.cross_entropy(logits[n, t], states.targets[n, t]) for n in range(len(states))
             for t in range(states.ids.shape[1]) if states.ids[n, t] == tasks.MASK_ID]
    assert loss.cross_entropy.item() == pytest.approx(torch.stack(terms).mean().item(), rel=1e-5)
    assert loss.total.item() == pytest.approx(loss.cross_entropy.item() + 0.5 * loss.contraction.item(), rel=1e-6)


def test_the_orl_run_starts_as_exactly_the_base():
    base = dlmrt.load()
    start = trainer.start_model(dlmrt.TINY_MODEL_DIR, SMALL)
    assert start.residual_config is not None and base.residual_config is None
    prompts = [text.encode(base, e.prompt) for e in tasks.examples("test", 4, seed=3)]
    settings = GenerationSettings(gen_length=16, block_length=8, policy=Threshold(0.7))
    from dlmrt.runtime import Generator

    assert torch.equal(Generator(start, mode="eager").generate(prompts, settings).tokens,
                       Generator(base, mode="eager").generate(prompts, settings).tokens)


def weights_hash(directory: Path) -> str:
    return hashing.sha256_of(directory / "model.safetensors")


def test_two_runs_with_one_seed_give_the_same_checkpoint(tmp_path):
    hashes = []
    for name in ("first", "second"):
        Run.start(dlmrt.TINY_MODEL_DIR, SMALL, tmp_path / name).train()
        hashes.append(weights_hash(tmp_path / name))
    assert hashes[0] == hashes[1]
    assert hashes[0] != hashing.sha256_of(dlmrt.TINY_MODEL_DIR / "model.safetensors")


@pytest.mark.parametrize("method", ["orl", "further"])
def test_an_interrupted_run_keeps_its_last_iteration_and_resumes_to_the_same_model(tmp_path, method):
    config = replace(SMALL, method=method)
    Run.start(dlmrt.TINY_MODEL_DIR, config, tmp_path / "whole").train()
    updates = []

    def stop_in_the_second_iteration():
        updates.append(1)
        if len(updates) == SMALL.updates + 2:
            raise KeyboardInterrupt

    run = Run.start(dlmrt.TINY_MODEL_DIR, config, tmp_path / "stopped")
    with pytest.raises(KeyboardInterrupt):
        run.train(on_update=stop_in_the_second_iteration)
    saved = json.loads((tmp_path / "stopped" / trainer.STATE_JSON).read_text())
    assert len(saved["history"]) == 1
    assert (checkpoint.load(tmp_path / "stopped").residual_config is not None) == (method == "orl")
    Run.resume(tmp_path / "stopped", config).train()
    assert weights_hash(tmp_path / "stopped") == weights_hash(tmp_path / "whole")
    assert weights_hash(tmp_path / "whole") != hashing.sha256_of(dlmrt.TINY_MODEL_DIR / "model.safetensors")


def test_the_adapter_can_learn_at_its_own_rate(tmp_path):
    slow = Run.start(dlmrt.TINY_MODEL_DIR, replace(SMALL, iterations=1, lr=1e-6), tmp_path / "slow")
    fast = Run.start(dlmrt.TINY_MODEL_DIR, replace(SMALL, iterations=1, lr=1e-6, adapter_lr=1e-2), tmp_path / "fast")
    assert [group["lr"] for group in fast.optimizer.param_groups] == pytest.approx([1e-6 / 100, 1e-2 / 100])  # warm-up
    slow.train(), fast.train()
    grown = [run.model.residual_adapter().output_layer().weight.abs().max().item() for run in (slow, fast)]
    assert grown[1] > 100 * grown[0] > 0


def test_the_control_trains_the_base_architecture(tmp_path):
    Run.start(dlmrt.TINY_MODEL_DIR, replace(SMALL, method="control", iterations=1), tmp_path / "control").train()
    assert checkpoint.load(tmp_path / "control").residual_config is None


def test_further_training_takes_the_base_objective_s_updates_without_rollouts(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer, "rollout", lambda *args, **kwargs: pytest.fail("further training rolled out"))
    history = Run.start(dlmrt.TINY_MODEL_DIR, replace(SMALL, method="further"), tmp_path / "further").train()
    assert [record.states for record in history] == [SMALL.updates * SMALL.batch_size] * SMALL.iterations
    assert all(record.rollout_exact_match is None and record.loss > 0 for record in history)
    assert checkpoint.load(tmp_path / "further").residual_config is None


# -- bad input ----------------------------------------------------------------------------------

def test_a_family_without_the_residual_pathway_is_refused(monkeypatch, tmp_path):
    class NoResidual(models.FAMILIES["llada"].model_class):
        supports_residual_context = False

    monkeypatch.setitem(models.FAMILIES, "llada", replace(models.FAMILIES["llada"], model_class=NoResidual))
    with pytest.raises(ArgumentError, match=r"the llada family has no residual pathway, so ORL cannot train it"):
        Run.start(dlmrt.TINY_MODEL_DIR, SMALL, tmp_path / "out")
    with pytest.raises(UnsupportedFeatureError, match=r"no residual pathway, but config.json sets residual_context"):
        models.create(config(LLADA, residual_context=ORL))
    assert not (tmp_path / "out").exists()


def test_an_orl_checkpoint_is_not_a_base(tmp_path):
    checkpoint.save(random_model(config(LLADA, residual_context=ORL)), tmp_path / "orl")
    with pytest.raises(ArgumentError, match=r"already has a residual pathway .* to continue an ORL run, resume it"):
        Run.start(tmp_path / "orl", SMALL, tmp_path / "out")


@pytest.mark.parametrize("change, message", [
    ({"adapter": "transformer"}, r"adapter 'transformer' is not registered \(registered: linear, mlp\)"),
    ({"tasks": ("rev", "div")}, r"unknown task 'div': tasks are rev, sort, add, same"),
    ({"tasks": ("rev", "psum")}, r"task 'psum' answers in up to 31 tokens, .* length of 32, got 16"),
    ({"policy": "greedy"}, r"unknown policy 'greedy'"),
    ({"updates": 0}, r"updates must be positive, got 0"),
    ({"method": "sft"}, r"method 'sft' is not one of orl, control, further"),
    ({"method": "control", "adapter_lr": 1e-3}, r"adapter-lr .* needs --method orl; got 0.001 with method control"),
])
def test_bad_settings_are_refused_before_anything_loads(tmp_path, change, message):
    with pytest.raises(ArgumentError, match=message):
        Run.start(tmp_path / "no-such-base", replace(SMALL, **change), tmp_path / "out")


def test_a_base_whose_context_cannot_hold_the_canvas_is_refused(tmp_path):
    long = replace(SMALL, tasks=("psum",), gen_length=32, block_length=32)
    with pytest.raises(ArgumentError, match=r"task 'psum' has prompts of up to 37 tokens: with 32 generated that "
                                            r"is 69, more than the model's context of 64"):
        Run.start(dlmrt.TINY_MODEL_DIR, long, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.fixture
def finished_iteration(tmp_path):
    out = tmp_path / "run"
    Run.start(dlmrt.TINY_MODEL_DIR, replace(SMALL, iterations=1), out).train()
    return out


@pytest.mark.parametrize("damage, message", [
    (lambda out: (out / "model.safetensors").write_bytes(b"\0" * 100), r"not a valid safetensors file"),
    (lambda out: (out / trainer.STATE_TENSORS).write_bytes(b"{}"), r"training_state.safetensors: not a valid "
                                                                   r"safetensors file.*start a new run"),
    (lambda out: (out / trainer.STATE_JSON).write_text("{\"format\": 1,"), r"training_state.json"),
    (lambda out: (out / trainer.STATE_JSON).unlink(), r"holds no training state"),
    (lambda out: (out / trainer.STATE_JSON).write_text(json.dumps(
        {**json.loads((out / trainer.STATE_JSON).read_text()), "optimizer": {"state": {}}})),
     r"the training state is corrupt"),
])
def test_resuming_from_a_damaged_checkpoint_says_what_is_wrong(finished_iteration, damage, message):
    damage(finished_iteration)
    with pytest.raises(CheckpointError, match=message):
        Run.resume(finished_iteration, SMALL)


def test_resuming_with_other_settings_names_them(finished_iteration):
    with pytest.raises(ArgumentError, match=r"these differ: lr \(saved 0.0003, given 0.001\)"):
        Run.resume(finished_iteration, replace(SMALL, lr=1e-3))


# -- the matched comparison ---------------------------------------------------------------------

def scored(label: str, mean: float, tpf: float):
    from dlmrt.eval.evaluation import EvalScore, SettingScore, parse_setting
    from dlmrt.runtime import GenerationMetrics

    metrics = GenerationMetrics(nfe=10, sequence_forwards=100, generated_tokens=round(100 * tpf), prompt_tokens=0,
                                batch_size=1, latency_s=1.0)
    return SettingScore(parse_setting(label), EvalScore({"t": mean}, metrics))


def test_tpf_at_matched_exact_match_by_hand():
    from dlmrt.orl import comparison

    base = [scored("fixed:steps=16", 0.90, 1.0), scored("threshold:threshold=0.9", 0.89, 2.0),
            scored("threshold:threshold=0.5", 0.70, 5.0)]
    orl = [scored("fixed:steps=16", 0.91, 1.0), scored("threshold:threshold=0.9", 0.90, 3.0),
           scored("threshold:threshold=0.5", 0.895, 4.5)]
    levels = comparison.targets([base])
    assert levels == pytest.approx([0.90, 0.89])
    points = {(p.model, round(p.target, 2)): p for p in comparison.matched({"base": [base], "orl": [orl]}, levels)}
    assert (points["base", 0.9].tpfs, points["base", 0.9].settings) == ((1.0,), ("fixed:steps=16",))
    assert (points["orl", 0.9].tpfs, points["orl", 0.9].settings) == ((3.0,), ("threshold:threshold=0.9",))
    assert points["base", 0.89].tpfs == (2.0,) and points["orl", 0.89].tpfs == (4.5,)
    assert comparison.fastest_at(base, 0.95) is None


def curve(*points: tuple[float, float]):
    """A seed's curve over a two-setting grid, from (exact-match, TPF) pairs."""
    return [scored(label, em, tpf) for label, (em, tpf) in zip(("threshold:threshold=0.9", "factor:factor=2"),
                                                                  points)]


def test_targets_come_from_the_reference_s_seeds_setting_by_setting():
    from dlmrt.orl import comparison

    # Setting 1's mean is 0.90 and setting 2's 0.85: the best single seed's 0.95 is not a target.
    seeds = [curve((0.95, 1.0), (0.80, 3.0)), curve((0.85, 1.0), (0.90, 3.0))]
    assert comparison.targets(seeds, (0.01, 0.03)) == pytest.approx([0.89, 0.87])


def test_a_gain_over_seeds_counts_only_where_the_ranges_do_not_overlap():
    from dlmrt.orl import comparison

    orl = [curve((0.9, 1.0), (0.9, tpf)) for tpf in (3.0, 4.0, 5.0)]
    control = [curve((0.9, 1.0), (0.9, 2.0)), curve((0.9, 1.0), (0.9, 2.5)), curve((0.9, 1.0), (0.8, 9.0))]
    close = [curve((0.9, 1.0), (0.9, tpf)) for tpf in (2.0, 3.5, 3.0)]
    points = {p.model: p for p in comparison.matched({"orl": orl, "control": control, "close": close}, [0.9])}
    assert points["orl"].mean == pytest.approx(4.0) and (points["orl"].low, points["orl"].high) == (3.0, 5.0)
    # The control's third seed reaches 0.9 only with its slow setting.
    assert points["control"].tpfs == (2.0, 2.5, 1.0) and points["control"].high == 2.5
    assert points["orl"].beats(points["control"]) and not points["control"].beats(points["orl"])
    assert not points["orl"].beats(points["close"]) and not points["close"].beats(points["orl"])
    unreached = comparison.matched({"x": [curve((0.5, 1.0), (0.5, 2.0)), curve((0.9, 1.0), (0.9, 6.0))]}, [0.9])[0]
    assert unreached.tpfs == (None, 6.0) and unreached.mean == 6.0 and unreached.low == 0.0
    assert not unreached.beats(points["control"])


def test_the_rules_split_the_grid_by_what_confident_means():
    from dlmrt.orl import comparison

    results = [scored("fixed:steps=16", 0.9, 1.0), scored("threshold:threshold=0.9", 0.9, 2.0),
               scored("threshold:threshold=0.9,confidence=entropy", 0.9, 3.0),
               scored("threshold:threshold=0.5", 0.8, 4.0)]
    split = comparison.by_rule({"orl": [results]})
    assert list(split) == ["fixed (prob)", "threshold (prob)", "threshold (entropy)"]
    assert [r.setting.label for r in split["threshold (prob)"]["orl"][0]] == ["threshold:threshold=0.9",
                                                                              "threshold:threshold=0.5"]


def test_the_evaluation_can_fail_a_zeroed_residual_scores_as_the_control():
    """The comparison finds no gain in a residual pathway that does nothing (the base with a zeroed
    adapter, against the base), and finds the shipped ORL model's gain, on the same prompts."""
    from dlmrt.eval.evaluation import evaluate_grid, parse_setting
    from dlmrt.orl import comparison

    zeroed = trainer.start_model(dlmrt.TINY_MODEL_DIR, TrainingConfig())
    assert zeroed.residual_config is not None
    assert all(not p.any() for p in zeroed.residual_adapter().output_layer().parameters())
    models = {"control": dlmrt.load(), "zeroed residual": zeroed, "orl": dlmrt.load(dlmrt.TINY_ORL_MODEL_DIR)}
    grid = [parse_setting(s) for s in ("fixed:steps=16", "threshold:threshold=0.9", "threshold:threshold=0.7",
                                       "threshold:threshold=0.5", "factor:factor=4", "fixed:steps=2")]
    examples = tasks.examples("test", 25, seed=1234)
    settings = GenerationSettings(gen_length=16, block_length=8, policy=Fixed())
    curves = {name: [evaluate_grid(model, examples, settings, grid, mode="eager")] for name, model in models.items()}
    assert [r.score.per_task for r in curves["zeroed residual"][0]] == [r.score.per_task for r in curves["control"][0]]
    points = comparison.matched(curves, comparison.targets(curves["control"], (0.0, 0.01, 0.03)))
    for target in dict.fromkeys(p.target for p in points):
        row = {p.model: p for p in points if p.target == target}
        assert row["zeroed residual"].tpfs == row["control"].tpfs
        assert not row["zeroed residual"].beats(row["control"])
    assert any(p.beats(q) for p in points if p.model == "orl" for q in points
               if q.model == "control" and q.target == p.target)


def test_the_comparison_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from dlmrt.eval.evaluation import write_comparison_plot

    curve = [scored("threshold:threshold=0.9", 0.9, 2.0), scored("factor:factor=2", 0.8, 3.0)]
    write_comparison_plot({"base": curve, "orl": curve}, tmp_path / "curves.png", "title")
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.parametrize("options, message", [
    (["--adapter", "transformer"], "adapter 'transformer' is not registered"),
    (["--tasks", "rev,div"], "unknown task 'div'"),
    (["--tasks", "psum"], "task 'psum' answers in up to 31 tokens"),
])
def test_the_script_prints_one_line_for_bad_input(tmp_path, options, message):
    import os
    import subprocess
    import sys

    script = Path(__file__).parents[2] / "scripts" / "train_orl.py"
    result = subprocess.run([sys.executable, str(script), "--base", str(dlmrt.TINY_MODEL_DIR), "--out",
                             str(tmp_path / "out"), *options], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "COLUMNS": "20"})
    assert result.returncode == 2 and "Traceback" not in result.stdout + result.stderr
    (line,) = result.stdout.splitlines()
    assert line.startswith("error: ") and message in line and not (tmp_path / "out").exists()


@pytest.mark.parametrize("options, message", [
    (["--model", "base"], "--model takes NAME=DIR"),
    (["--model", "base={model}", "--tasks", "psum"], "task 'psum' answers in up to 31 tokens"),
    (["--model", "base={model}", "--tasks", "psum", "--gen-length", "32", "--block-length", "32"],
     "more than the model's context of 64: use a model with a longer context"),
    (["--model", "base={model}", "--setting", "greedy"], "unknown policy 'greedy'"),
])
def test_the_curves_script_prints_one_line_for_bad_input(tmp_path, options, message):
    """One line, whatever the terminal's width and however long the model's path: it was wrapped at the
    width, so the test failed in a checkout at another path ("context of\n64")."""
    import os
    import subprocess
    import sys

    model = tmp_path / ("long-" * 30) / "tiny-llada"
    model.parent.mkdir()
    model.symlink_to(dlmrt.TINY_MODEL_DIR)
    script = Path(__file__).parents[2] / "scripts" / "orl_curves.py"
    result = subprocess.run([sys.executable, str(script), *(option.format(model=model) for option in options)],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "20"})
    assert result.returncode == 2 and "Traceback" not in result.stdout + result.stderr
    (line,) = result.stdout.splitlines()
    assert line.startswith("error: ") and message in line


@pytest.mark.parametrize("output, right", [("bbb", True), ("aaa", True), ("ccc", True), ("abc", False),
                                           ("zzz", False), ("aa", False), ("aaaa", False), ("", False),
                                           (None, False)])
def test_a_task_with_several_answers_is_scored_by_its_verifier(output, right):
    assert tasks.is_correct(Example("same", "same:abc=", "bbb"), output) is right


def test_other_tasks_are_scored_by_exact_match():
    assert tasks.is_correct(Example("add", "add:001+002=", "0003"), "0003")
    assert not tasks.is_correct(Example("add", "add:001+002=", "0003"), "3")
    assert not tasks.is_correct(Example("jsonl", "p", "ab"), "ba")


def test_observing_the_steps_needs_the_eager_mode():
    from dlmrt.runtime.torch_backend import TorchBackend

    with pytest.raises(ArgumentError, match=r"observing the step's inputs needs mode 'eager', not 'compile'"):
        TorchBackend(random_model(LLADA), mode="compile", observe=lambda inputs: None)
