"""Logprobs: each committed token's log-probability is `log_softmax` of the logits of the step that
committed it, at its position, taken at the token; and a batch in which no row asks does no logprob
work at all.

The reference is the model's own forward, run here on the canvas each step saw (the step's inputs as
the backend's `observe` hands them over), with `log_softmax` written out in the test.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import dlmrt
from dlmrt.bench.counted import count_work
from dlmrt.runtime import GenerationSettings, Generator, LLaDA21, Threshold, text
from dlmrt.runtime import device_step
from dlmrt.runtime.batches import open_batch
from dlmrt.runtime.buckets import Bucket
from dlmrt.runtime.device_state import DeviceState
from dlmrt.runtime.model_spec import ModelSpec
from dlmrt.runtime.torch_backend import TorchBackend

SETTINGS = GenerationSettings(16, 8, Threshold(0.9), logprobs=5)  # temperature 0, cache none: whole-canvas steps


@pytest.fixture(scope="module")
def model():
    return dlmrt.load()


@pytest.fixture(scope="module")
def prompts(model):
    return [text.encode(model, "12+7="), text.encode(model, "34+5=")]


class StepRecorder:
    """The inputs of every step, as the step read them."""

    def __init__(self):
        self.steps: list[dict[str, torch.Tensor]] = []

    def __call__(self, inputs) -> None:
        self.steps.append({name: inputs[name].clone() for name in ("ids", "positions", "key_mask", "block_index")})


def reference_logprobs(model, step: dict[str, torch.Tensor], grid: int | None) -> torch.Tensor:
    """`[B, block, V]`: log_softmax of the model's logits on the step's canvas, at the block's positions
    (`grid`: a block-causal model's block length)."""
    with torch.no_grad():
        logits = model.denoise(step["ids"], positions=step["positions"], key_mask=step["key_mask"],
                               block_length=grid).logits.double()
    logits = logits[:, step["block_index"]]
    return logits - logits.exp().sum(-1, keepdim=True).log()


def committing_step(steps, row: int, position: int, token: int) -> tuple[dict, int]:
    """The step that put `token` at `position` (a row's position count) for good: the last one that saw
    something else there (a mask, or a token a later edit replaced); and its index in that step's block."""
    for step in reversed(steps):
        found = (step["positions"][row] == position).nonzero()
        if len(found) and step["ids"][row, int(found[-1])] != token:
            return step, int((step["block_index"] == int(found[-1])).nonzero()[0])
    raise AssertionError(f"no step put token {token} at position {position} of row {row}")


def check_against_model(model, steps, prompts, tokens_of_row, logprobs_of_row, atol: float,
                        grid: int | None = None) -> int:
    """Every committed token's logprob and top alternatives against the reference; returns how many."""
    checked = 0
    for row, prompt in enumerate(prompts):
        tokens, logprobs = tokens_of_row[row], logprobs_of_row[row]
        assert len(tokens) == len(logprobs) > 0
        for index, (token, found) in enumerate(zip(tokens, logprobs)):
            step, j = committing_step(steps, row, len(prompt) + index, token)
            expected = reference_logprobs(model, step, grid)[row, j]
            # rel: float32's precision at logprobs of -10 and below (the CPU's oneDNN matmuls sum in their own order)
            assert found.logprob == pytest.approx(float(expected[token]), rel=1e-5, abs=atol)
            without_mask = expected.clone()
            without_mask[model.tokens.mask_id] = float("-inf")
            top = without_mask.topk(len(found.top))
            assert [t for t, _ in found.top] == top.indices.tolist()
            assert [v for _, v in found.top] == pytest.approx(top.values.tolist(), rel=1e-5, abs=atol)
            checked += 1
    return checked


def stream_with_logprobs(generator: Generator, prompts, settings):
    tokens, logprobs = [[] for _ in prompts], [[] for _ in prompts]
    for update in generator.stream(prompts, settings):
        tokens[update.row] += update.token_ids
        logprobs[update.row] += update.logprobs
    return tokens, logprobs


def test_torch_logprob_is_log_softmax_of_the_committing_step(model, prompts):
    recorder = StepRecorder()
    generator = Generator(TorchBackend(model, mode="eager", observe=recorder))
    tokens, logprobs = stream_with_logprobs(generator, prompts, SETTINGS)
    assert check_against_model(model, recorder.steps, prompts, tokens, logprobs, atol=1e-5) >= 4
    # more than one token a step (each takes its own position's logits), and more than one step a block (each
    # token takes its own step's)
    assert len(recorder.steps) < sum(len(t) for t in tokens)
    assert len(recorder.steps) > len({int(step["block_index"][0]) for step in recorder.steps})


def test_an_edited_token_has_the_logprob_of_the_step_that_wrote_it_last():
    """LLaDA2.1's token editing overwrites committed tokens: the logprob is the last writing step's."""
    model = dlmrt.load(Path(__file__).parents[1] / "data" / "llada21")
    settings = GenerationSettings(12, 4, LLaDA21(threshold=0.3, edit_threshold=0.2, max_post_steps=2), logprobs=2)
    recorder, prompts = StepRecorder(), [[17, 5, 42, 30]]
    generator = Generator(TorchBackend(model, mode="eager", observe=recorder))
    tokens, logprobs = stream_with_logprobs(generator, prompts, settings)
    assert check_against_model(model, recorder.steps, prompts, tokens, logprobs, atol=1e-5, grid=4) >= 4
    edited = 0  # tokens whose last writer overwrote a token, not a mask
    for index, token in enumerate(tokens[0]):
        step, j = committing_step(recorder.steps, 0, len(prompts[0]) + index, token)
        edited += int(step["ids"][0, step["block_index"][j]] != model.tokens.mask_id)
    assert edited > 0


def test_asking_changes_no_token(model, prompts):
    plain = Generator(model, mode="eager").generate(prompts, dataclasses.replace(SETTINGS, logprobs=None)).tokens
    asked = Generator(model, mode="eager").generate(prompts, SETTINGS).tokens
    assert torch.equal(plain, asked)


def test_rows_that_do_not_ask_get_none_beside_one_that_does(model, prompts):
    batch = open_batch(TorchBackend(model, mode="eager"))
    batch.add("asks", prompts[0], dataclasses.replace(SETTINGS, logprobs=2), seed=0)
    batch.add("not", prompts[1], dataclasses.replace(SETTINGS, logprobs=None), seed=0)
    updates = []
    while batch.active:
        updates += batch.run_block()
    asks = [u for u in updates if u.row == "asks"]
    assert all(u.logprobs is None for u in updates if u.row == "not")
    assert all(len(u.logprobs) == len(u.token_ids) and all(len(lp.top) == 2 for lp in u.logprobs) for u in asks)
    assert sum(len(u.token_ids) for u in asks) > 0


def test_a_step_that_no_row_asks_for_does_no_logprob_work(model, prompts):
    """The counted aten ops of a step (dlmrt.bench.counted) are those of a step without logprobs exactly when no
    row asks; asking adds exactly the ops of `token_logprobs` and `record_logprobs`, and nothing else."""
    settings = GenerationSettings(16, 8, Threshold(0.9), cache="dual")
    plain = count_work("torch:eager", model, prompts, settings)
    asked = count_work("torch:eager", model, prompts, dataclasses.replace(settings, logprobs=3))
    state = DeviceState.allocate(ModelSpec.of_model(model), Bucket(batch=2, canvas=32, block=8))
    state.allocate_logprobs(3)
    recording = RecordedOps()
    with recording:
        found = device_step.token_logprobs(torch.zeros(2, 8, model.vocab_size), state.canvas[:, :8], 3,
                                           state.mask_id)
        device_step.record_logprobs(state, found, torch.zeros(2, 8, dtype=torch.bool))
    assert asked.aten_ops_per_step - plain.aten_ops_per_step == recording.count > 0
    assert (plain.nfe, plain.host_reads) == (asked.nfe, asked.host_reads - asked.blocks * 3)


class RecordedOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def needs_onnxruntime():
    pytest.importorskip("onnxruntime", reason="the ort backend needs the 'onnx' extra")


def test_ort_logprob_is_log_softmax_of_the_committing_step(model, prompts, tiny_export):
    needs_onnxruntime()
    from dlmrt.runtime.ort_backend import OrtBackend

    recorder = StepRecorder()
    backend = OrtBackend(tiny_export, observe=lambda graph, inputs: recorder(inputs))
    tokens, logprobs = stream_with_logprobs(Generator(backend), prompts, SETTINGS)
    assert check_against_model(model, recorder.steps, prompts, tokens, logprobs, atol=1e-4) >= 4
    torch_tokens, _ = stream_with_logprobs(Generator(model, mode="eager"), prompts, SETTINGS)
    assert tokens == torch_tokens


def reference_scores(model, ids: list[int], block: int) -> list[float]:
    """Each token's log_softmax with its block masked, from the model's forward on the text alone."""
    scores = []
    for start in range(0, len(ids), block):
        masked = torch.tensor([ids])
        masked[0, start:start + block] = model.tokens.mask_id
        with torch.no_grad():
            logits = model.denoise(masked).logits[0, start:start + block].double()
        logp = logits - logits.exp().sum(-1, keepdim=True).log()
        scores += [float(logp[j, token]) for j, token in enumerate(ids[start:start + block])]
    return scores


@pytest.mark.parametrize("backend_name", ["torch", "ort"])
def test_scoring_a_text_is_log_softmax_with_its_block_masked(model, request, backend_name):
    from dlmrt.runtime.scoring import Scorer

    if backend_name == "ort":
        needs_onnxruntime()
        from dlmrt.runtime.ort_backend import OrtBackend

        backend = OrtBackend(request.getfixturevalue("tiny_export"))
    else:
        backend = TorchBackend(model, mode="eager")
    ids = text.encode(model, "add:762+139=901")  # 15 tokens: the last block of 4 runs past the text
    scorer = Scorer(backend)
    for _ in range(2):  # the second text of the same length runs on the state and binding of the first
        entries = scorer.score(ids, 4, alternatives=3)
        assert [e.logprob for e in entries] == pytest.approx(reference_scores(model, ids, 4), abs=1e-4)
        assert all(len(e.top) == 3 and model.tokens.mask_id not in dict(e.top) for e in entries)
        ids = ids[::-1]
    assert len(scorer._bound) == 1


def test_an_export_made_before_the_logits_output_refuses_logprobs_and_scoring():
    needs_onnxruntime()
    from dlmrt.core.errors import ArgumentError
    from dlmrt.runtime.ort_backend import OrtBackend
    from dlmrt.runtime.scoring import Scorer

    backend = OrtBackend(Path(__file__).parents[1] / "data" / "export-v1")
    assert not backend.spec.supports_logprobs
    with pytest.raises(ArgumentError, match=r"^logprobs: .* exported before .* re-export it"):
        Generator(backend).generate([[5, 6, 7]], GenerationSettings(12, 4, Threshold(0.3), logprobs=0))
    with pytest.raises(ArgumentError, match=r"exported before .* re-export it"):
        Scorer(backend).score([5, 6, 7], 4, 0)
