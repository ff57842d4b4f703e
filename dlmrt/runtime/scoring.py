"""Scoring a given text with the denoiser: each token's log-probability, without generating.

    scorer = Scorer(backend)
    entries = scorer.score(ids, block_length=32, alternatives=5)   # one TokenLogprob per id

A diffusion model has no left-to-right factorization to read a text's likelihood from. dlmrt scores
a text as its decoding first sees each block: block by block, the block's tokens masked and every
other token of the text visible, each masked token's log-probability is `log_softmax` of that
forward's logits at its position, taken at the text's token (with the `alternatives` most likely
tokens there, the mask aside). Blocks lie on the grid of positions 0, block, 2 * block, ... of the
text, so a block-causal model scores each block as it would generate it.

One forward per block, through the backend's own step graph (the same logits a step commits from),
on a canvas of the text alone. A scorer keeps a state and a bound graph per canvas length (whole
blocks up to the ladder's largest canvas), so it binds, and on ONNX Runtime over CUDA captures, each
shape once. It runs on the thread that owns the backend: the server's scheduler runs it between two
blocks (`Scheduler.run_between_blocks`). Docs: docs/logprobs.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dlmrt.core.errors import ArgumentError
from dlmrt.runtime.backend import Backend
from dlmrt.runtime.buckets import Bucket
from dlmrt.runtime.device_state import DeviceState
from dlmrt.runtime.device_step import StepKind, gather
from dlmrt.runtime.model_spec import ModelSpec
from dlmrt.runtime.running_batch import TokenLogprob


def check_scorable(spec: ModelSpec) -> None:
    """Whether the model behind a backend scores text at all."""
    if spec.noise == "uniform" or spec.mask_id is None:
        raise ArgumentError(f"{spec.name} is a uniform-noise model: it has no mask token to score a text with")
    if spec.vocab_ranks > 1:
        raise ArgumentError("scoring a text is not built for a model split over ranks (its other ranks replay the "
                            "server's batches only): score it on a server without --tp")
    if not spec.supports_logprobs:
        raise ArgumentError(f"{spec.name} was exported before the step graph returned its logits: re-export it "
                            f"with this dlmrt (`dlmrt export`) to score text, or use the torch backend")


def check_text(backend: Backend, ids: list[int]) -> None:
    """Whether `ids` is a text the backend scores."""
    spec = backend.spec
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


class Scorer:
    """Scores texts on `backend`, with a state and a bound step graph of its own per canvas length."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self._bound: dict[Bucket, tuple[DeviceState, StepKind, Callable]] = {}

    @torch.no_grad()
    def score(self, ids: list[int], block_length: int, alternatives: int) -> list[TokenLogprob]:
        """Each token of `ids` scored with its block masked and the rest of the text visible, with its
        `alternatives` most likely tokens."""
        check_scorable(self.backend.spec)
        check_text(self.backend, ids)
        spec, length = self.backend.spec, len(ids)
        state, kind, run = self._state_for(length, min(block_length, length))
        block = state.bucket.block
        text = torch.tensor(ids, dtype=torch.long, device=spec.device)
        state.key_mask[0].fill_(False)
        state.key_mask[0, :length] = True  # the padding after the text is seen by no position
        state.prompt_lengths.fill_(length)
        entries = []
        for start in range(0, length, block):
            end = min(start + block, length)
            state.canvas[0, :length] = text
            state.canvas[0, start:end] = spec.mask_id
            state.block_start.fill_(start)
            gather(state, kind)
            logp = torch.log_softmax(run().logits[0, :end - start].float(), dim=-1)
            chosen = logp.gather(-1, text[start:end, None]).squeeze(-1).tolist()
            logp[:, spec.mask_id] = float("-inf")
            top = logp.topk(min(alternatives, spec.vocab_size - 1), dim=-1)
            for j, value in enumerate(chosen):
                entries.append(TokenLogprob(value, tuple(zip(top.indices[j].tolist(), top.values[j].tolist()))))
        return entries

    def _state_for(self, length: int, block: int) -> tuple[DeviceState, StepKind, Callable]:
        """The state, kind and bound step graph of a text of `length` scored in blocks of `block`: a canvas
        of whole blocks, the positions after the text padding."""
        canvas = -(-length // block) * block
        longest = min(self.backend.spec.max_positions, self.backend.ladder.max_canvas)
        if canvas > longest:
            raise ArgumentError(f"a text of {length} tokens in blocks of {block} needs a canvas of {canvas} positions, "
                                f"more than the {longest} this backend takes: use a block_length that divides "
                                f"{length}, or score a shorter text")
        bucket = Bucket(batch=1, canvas=canvas, block=block)
        if bucket not in self._bound:
            spec = self.backend.spec
            state = DeviceState.allocate(spec, bucket)
            state.reset(0.0)
            state.positions[0].copy_(torch.arange(canvas, device=spec.device))
            state.schedule.zero_()  # commit nothing: only the logits are read
            state.threshold.fill_(float("inf"))
            kind = StepKind(canvas, 0, logprobs=True)
            graph = kind.bind(self.backend, state)
            results = []

            def run_once():
                results.append(graph())
            run = self.backend.around_steps(run_once)  # on the backend's own stream, where it has one

            def run_graph():
                results.clear()
                run()
                return results[0]
            self._bound[bucket] = state, kind, run_graph
        return self._bound[bucket]
