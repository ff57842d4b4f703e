"""Scoring a given text with the denoiser: each token's log-probability, without generating.

    entries = score(backend, ids, block_length=32, alternatives=5)   # one TokenLogprob per id

A diffusion model has no left-to-right factorization to read a text's likelihood from. dlmrt scores
a text as its decoding first sees each block: block by block, the block's tokens masked and every
other token of the text visible, each masked token's log-probability is `log_softmax` of that
forward's logits at its position, taken at the text's token (with the `alternatives` most likely
tokens there, the mask aside). One forward per block, through the backend's own step graph (the same
logits a step commits from), on a canvas of the text alone. Blocks lie on the grid of positions 0,
block, 2 * block, ... of the text, so a block-causal model scores each block as it would generate
it. Docs: docs/logprobs.md.
"""

from __future__ import annotations

import torch

from dlmrt.core.errors import ArgumentError
from dlmrt.runtime.backend import Backend
from dlmrt.runtime.device_state import Bucket, DeviceState
from dlmrt.runtime.device_step import StepKind, gather, graph_inputs
from dlmrt.runtime.running_batch import TokenLogprob


def check_scoring(backend: Backend, ids: list[int]) -> None:
    """Every check `score` would fail, before any compute."""
    spec = backend.spec
    if spec.noise == "uniform" or spec.mask_id is None:
        raise ArgumentError(f"{spec.name} is a uniform-noise model: it has no mask token to score a text with")
    if not spec.supports_logprobs:
        raise ArgumentError(f"{spec.name} was exported before the step graph returned its logits: re-export it "
                            f"with this dlmrt (`dlmrt export`) to score text, or use the torch backend")
    if not ids:
        raise ArgumentError("the text to score is empty")
    bad = [t for t in ids if not 0 <= t < spec.vocab_size or t == spec.mask_id]
    if bad:
        raise ArgumentError(f"the text to score holds ids outside the vocabulary [0, {spec.vocab_size}) or the "
                            f"mask id {spec.mask_id}: {bad[:5]}")
    longest = min(spec.max_positions, backend.ladder.max_canvas)
    if len(ids) > longest:
        raise ArgumentError(f"the text to score has {len(ids)} tokens, more than the {longest} positions "
                            f"{spec.name} takes here: score a shorter text")


@torch.no_grad()
def score(backend: Backend, ids: list[int], block_length: int, alternatives: int) -> list[TokenLogprob]:
    """Each token of `ids` scored with its block masked and the rest of the text visible."""
    check_scoring(backend, ids)
    spec, length = backend.spec, len(ids)
    block = min(block_length, length)
    canvas = -(-length // block) * block  # whole blocks: the last may run past the text, into padding
    state = DeviceState.allocate(spec, Bucket(batch=1, canvas=canvas, block=block))
    state.reset(0.0)
    text = torch.tensor(ids, dtype=torch.long, device=spec.device)
    state.key_mask[0].fill_(False)
    state.key_mask[0, :length] = True  # the padding after the text is seen by no position
    state.positions[0].copy_(torch.arange(canvas, device=spec.device))
    state.prompt_lengths.fill_(length)
    state.schedule.zero_()  # commit nothing: only the logits are read
    state.threshold.fill_(float("inf"))
    kind = StepKind(canvas, 0, logprobs=True)
    run = backend.step_graph(state, kind)
    entries = []
    for start in range(0, length, block):
        end = min(start + block, length)
        state.canvas[0, :length] = text
        state.canvas[0, start:end] = spec.mask_id
        state.block_start.fill_(start)
        gather(state, kind)
        logp = torch.log_softmax(run(graph_inputs(state, kind)).logits[0, :end - start].float(), dim=-1)
        chosen = logp.gather(-1, text[start:end, None]).squeeze(-1).tolist()
        logp[:, spec.mask_id] = float("-inf")
        top = logp.topk(min(alternatives, spec.vocab_size - 1), dim=-1)
        for j, value in enumerate(chosen):
            entries.append(TokenLogprob(value, tuple(zip(top.indices[j].tolist(), top.values[j].tolist()))))
    return entries
