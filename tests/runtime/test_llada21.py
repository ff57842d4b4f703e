"""LLaDA2.1's token editing (policy `llada21`).

Expected tokens come from two independent sources:

- the public LLaDA2.1 model code itself: `tests/data/make_llada21.py` wrote a random llada2_moe
  checkpoint with that code's `save_pretrained` and recorded what that code's own `generate` returns
  (tokens with editing on and off, its forwards and edits), in `tests/data/llada21/expected.json`;
- `llada21_generate` below, a plain loop written from the algorithm's description (LLaDA2.1 tech
  report, Eq. 1-3, and the public sampler's documented rules), run on dlmrt's random models.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import dlmrt
from dlmrt.core.errors import ArgumentError
from dlmrt.runtime import GenerationSettings, Generator, LLaDA21, Threshold, make_policy
from helpers import TOKENS
from recorded import LLADA21, llada21_name, llada21_settings, until_eos

DATA = Path(__file__).parents[1] / "data"
PUBLIC = LLADA21
CASES = PUBLIC["cases"]
EDITING_CASES = [c for c in CASES if c["editing_threshold"] < 1]
case_id, settings_of = llada21_name, llada21_settings


@pytest.fixture(scope="module")
def public_model():
    return dlmrt.load(DATA / "llada21")


# -- against the public LLaDA2.1 generate ---------------------------------------------------------
def test_logits_match_the_public_model(public_model):
    expected = load_file(DATA / "llada21" / "expected_logits.safetensors")
    logits = public_model.denoise(expected["input_ids"], positions=expected["positions"], block_length=4).logits
    torch.testing.assert_close(logits, expected["logits"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_tokens_of_the_public_generate(public_model, loop, case):
    got = loop.run(public_model, [case["prompt"]], settings_of(case)).rows[0].token_ids
    assert got == until_eos(case["tokens"])


def test_editing_changes_tokens_and_off_gives_the_public_tokens_without_it(public_model):
    changed = [c for c in CASES if c["tokens"] != c["tokens_editing_off"]]
    assert len(changed) >= 3 and {len(c["prompt"]) % 4 for c in changed} >= {0, 2, 3}  # aligned and not
    generator = Generator(public_model, mode="eager")
    for case in changed:
        with_edits = generator.generate([case["prompt"]], settings_of(case)).rows[0]
        without = generator.generate([case["prompt"]], settings_of(case, editing=False)).rows[0]
        assert with_edits.token_ids == until_eos(case["tokens"]) != without.token_ids
        assert without.token_ids == until_eos(case["tokens_editing_off"])
        assert with_edits.metrics.edits > 0 and without.metrics.edits == 0


@pytest.mark.parametrize("case", EDITING_CASES, ids=case_id)
def test_forwards_and_edits_are_the_public_generates(public_model, case):
    """Decoding every block (the public generate does not stop at EOS), dlmrt runs the same forwards
    and makes the same edits: the per-step rule and the editing-only steps are the same."""
    result = Generator(public_model, mode="eager").generate([case["prompt"]], settings_of(case, ignore_eos=True))
    assert (result.metrics.nfe, result.metrics.edits) == (case["forwards"], case["edits"])


@pytest.mark.parametrize("cache", ["prefix"])
def test_the_block_cache_gives_the_public_tokens(public_model, cache):
    generator = Generator(public_model, mode="eager")
    for case in EDITING_CASES:
        got = generator.generate([case["prompt"]], settings_of(case, cache=cache)).rows[0].token_ids
        assert got == until_eos(case["tokens"]), case_id(case)


# -- against a reference of our own ----------------------------------------------------------------
@torch.no_grad()
def llada21_generate(model, prompt, gen_length, block_length, threshold, edit_threshold, max_post_steps,
                     eos: int | None = None) -> tuple[list[int], int]:
    """LLaDA2.1's decoding for one prompt over full forwards, from its description: blocks on the absolute
    grid; per step, commit the masks with p > threshold (else the single most confident) and overwrite the
    block's generated tokens whose argmax differs with p > edit_threshold; after the last mask, up to
    `max_post_steps` editing-only steps while they edit. Stops after the block holding EOS. Returns the
    completion and the number of edits. The mask token is never a candidate."""
    mask = model.tokens.mask_id
    n = len(prompt)
    num_blocks = -(-(n + gen_length) // block_length)
    x = list(prompt) + [mask] * (num_blocks * block_length - n)
    edits = 0
    for block in range(n // block_length, num_blocks):
        start, end = block * block_length, (block + 1) * block_length
        post_steps = 0
        while True:
            masked = [i for i in range(start, end) if x[i] == mask]
            if not masked:
                post_steps += 1
                if post_steps > max_post_steps:
                    break
            logits = model.denoise(torch.tensor([x[:end]]), positions=torch.arange(end)[None],
                                   block_length=block_length).logits[0].float()
            probs = F.softmax(logits, dim=-1)
            x0 = probs.index_fill(-1, torch.tensor([mask]), -1.0).argmax(-1).tolist()
            p = [float(probs[i, x0[i]]) for i in range(end)]
            chosen = [i for i in masked if p[i] > threshold] or sorted(masked, key=lambda i: (-p[i], i))[:1]
            edited = [i for i in range(max(start, n), end) if x[i] != mask and x[i] != x0[i] and p[i] > edit_threshold]
            for i in chosen + edited:
                x[i] = x0[i]
            edits += len(edited)
            if not masked and not edited:
                break
        if eos is not None and eos in x[n:end]:
            break
    out = x[n:n + gen_length]
    return (out[:out.index(eos)] if eos is not None and eos in out else out), edits


# a random model is unconfident: editing happens at low thresholds (all but the last setting edit)
GRID = [(0.2, 0.05, 16), (0.1, 0.03, 3), (0.5, 0.05, 0), (0.3, 0.2, 2)]
PROMPTS = [[5, 6, 7], [5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]


@pytest.mark.parametrize("threshold, edit_threshold, max_post_steps", GRID)
def test_llada21_policy_decodes_as_the_reference(llada2, loop, threshold, edit_threshold, max_post_steps):
    settings = GenerationSettings(12, 4, LLaDA21(threshold, edit_threshold, max_post_steps))
    edited = 0
    for prompt in PROMPTS:
        got = loop.run(llada2, [prompt], settings).rows[0]
        tokens, edits = llada21_generate(llada2, prompt, 12, 4, threshold, edit_threshold, max_post_steps,
                                         TOKENS.eos_ids[0])
        assert (got.token_ids, got.metrics.edits) == (tokens, edits), prompt
        edited += edits
    assert edited > 0 or threshold == 0.3


@pytest.mark.parametrize("cache", ["none", "prefix"])
def test_batched_rows_edit_at_their_own_pace_and_decode_as_alone(llada2, cache):
    settings = GenerationSettings(12, 4, LLaDA21(0.2, 0.05, 16), cache=cache)
    generator = Generator(llada2, mode="eager")
    batched = generator.generate(PROMPTS, settings).rows
    alone = [generator.generate([prompt], settings).rows[0] for prompt in PROMPTS]
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    assert [r.metrics.edits for r in batched] == [r.metrics.edits for r in alone]
    assert len({r.metrics.edits for r in alone}) > 1 and len({r.metrics.nfe for r in alone}) > 1


def test_editing_off_decodes_as_the_threshold_rule_without_editing_only_steps(llada2):
    """With editing off, llada21 is LLaDA2's rule with one commit per step: the tokens of a strict
    threshold, and no forward beyond the masks'."""
    generator = Generator(llada2, mode="eager")
    off = GenerationSettings(12, 4, LLaDA21(0.4, 1.0, 16))
    strict = GenerationSettings(12, 4, Threshold(torch.nextafter(torch.tensor(0.4), torch.tensor(1.0)).item()))
    for prompt in PROMPTS:
        a, b = generator.generate([prompt], off).rows[0], generator.generate([prompt], strict).rows[0]
        assert (a.token_ids, a.metrics.nfe) == (b.token_ids, b.metrics.nfe)


# -- exports made before editing -----------------------------------------------------------------
def test_an_export_made_before_editing_runs_every_other_policy(public_model):
    from dlmrt.runtime.ort_backend import OrtBackend
    old = Generator(OrtBackend(DATA / "export-v1"))
    assert not old.spec.supports_editing
    for policy in (Threshold(0.3), LLaDA21(0.3, 1.0, 16), make_policy("llada2", threshold=0.2, steps=4)):
        settings = GenerationSettings(12, 4, policy)
        for prompt in PROMPTS:
            assert old.generate([prompt], settings).rows[0].token_ids == \
                Generator(public_model, mode="eager").generate([prompt], settings).rows[0].token_ids


def test_an_export_made_before_editing_refuses_editing():
    from dlmrt.runtime.ort_backend import OrtBackend
    old = Generator(OrtBackend(DATA / "export-v1"))
    with pytest.raises(ArgumentError, match=r"exported before token editing .* re-export it"):
        old.generate([[5, 6, 7]], GenerationSettings(12, 4, LLaDA21()))


def test_the_preflight_refuses_an_export_made_before_editing(tmp_path):
    from dlmrt.engines import preflight
    from helpers import load_graphs, plan_for

    plan = plan_for(DATA / "export-v1", tmp_path, graphs=("full",))
    problems = [str(p) for p in preflight.check(plan, load_graphs(plan, DATA / "export-v1"))]
    assert any("has 10 inputs" in p and "re-export" in p for p in problems), problems


# -- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, message", [
    (LLaDA21(edit_threshold=0.0), r"editing-threshold must lie in \(0, 1\]"),
    (LLaDA21(edit_threshold=1.5), r"editing-threshold must lie in \(0, 1\]"),
    (LLaDA21(edit_threshold=float("nan")), r"editing-threshold must lie in \(0, 1\]"),
    (LLaDA21(max_post_steps=-1), r"max-post-steps must be an integer >= 0"),
    (LLaDA21(threshold=0.0), r"threshold must lie in \(0, 1\]"),
])
def test_bad_editing_parameters_get_one_clear_error(llada2, policy, message):
    with pytest.raises(ArgumentError, match=message):
        Generator(llada2, mode="eager").generate([[5, 6, 7]], GenerationSettings(12, 4, policy))


def test_presets_and_their_overrides():
    assert make_policy("llada21") == LLaDA21(0.95, 0.9, 16)
    assert make_policy("llada21", preset="quality") == LLaDA21(0.7, 0.5, 16)
    speed = make_policy("llada21", preset="speed", max_post_steps=4)
    assert speed == LLaDA21(0.5, 1.0, 4) and not speed.edits and speed.row_params()["max_post_steps"] == 0
    with pytest.raises(ArgumentError, match="unknown llada21 preset 'fast'"):
        make_policy("llada21", preset="fast")
    with pytest.raises(ArgumentError, match="belong to policy llada21, not 'threshold'"):
        make_policy("threshold", editing_threshold=0.5)


def test_generate_takes_llada21s_options(tmp_path):
    from click.testing import CliRunner

    from dlmrt.cli.commands import main
    case = next(c for c in EDITING_CASES if c["prompt"] == CASES[0]["prompt"] and c["threshold"] == 0.3
                and c["max_post_steps"] == 2)
    args = ["generate", "--model", str(DATA / "llada21"), "--prompt-ids", ",".join(map(str, case["prompt"])),
            "--gen-length", str(case["gen_length"]), "--block-length", "4", "--policy", "llada21", "--mode", "eager",
            "--threshold", str(case["threshold"]), "--max-post-steps", "2", "--json"]
    runner = CliRunner()
    done = runner.invoke(main, [*args, "--editing-threshold", str(case["editing_threshold"])])
    assert done.exit_code == 0, done.output
    result = json.loads(done.output)
    assert result["outputs"][0]["token_ids"] == until_eos(case["tokens"]) and result["metrics"]["edits"] > 0
    refused = runner.invoke(main, [*args, "--editing-threshold", "1.5"])
    assert refused.exit_code == 2 and "editing-threshold must lie in (0, 1]" in refused.output
    assert "Traceback" not in refused.output


def test_eval_settings_name_llada21_and_dream():
    from dlmrt.eval.evaluation import parse_setting
    from dlmrt.runtime import Dream
    assert parse_setting("llada21:preset=speed,max_post_steps=4").policy == LLaDA21(0.5, 1.0, 4)
    assert parse_setting("llada21:editing_threshold=0.5").policy == LLaDA21(0.95, 0.5, 16)
    assert parse_setting("dream:steps=8,confidence=entropy").policy == Dream(8, confidence="entropy")


def test_engines_built_for_the_op_before_editing_are_outdated():
    from dlmrt.engines import plugin_specs
    before = {"name": "ParallelUnmask", "namespace": "dlmrt", "version": "1"}
    assert plugin_specs.outdated([before]) == ["dlmrt::ParallelUnmask v1, this dlmrt has v2"]
    assert plugin_specs.outdated([dict(before, version="2")]) == []
