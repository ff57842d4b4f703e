"""Jobs the tensor-parallel tests run on each rank (module-level, so that spawned ranks can unpickle them).

A model is given as a picklable recipe (`make_model()`), so every rank and the one-process reference build
the same weights."""

from __future__ import annotations

import dlmrt
import torch

import helpers
import qwen_testing
from dlmrt.parallel.plan import ParallelPlan
from dlmrt.runtime import Generator, text
from dlmrt.runtime.torch_backend import TorchBackend


# The tiny models' own tasks. A prompt the model cannot read leaves it unsure, where the last bit of a logit
# (which the ranks' partial sums move) can flip a decision near its threshold, and the runs part ways.
PROMPTS = ["add:762+139=", "rev:hello=", "sort:dcba="]


def tiny_llada():
    return dlmrt.load(dlmrt.TINY_MODEL_DIR)


def tiny_orl():
    return dlmrt.load(dlmrt.TINY_MODEL_DIR.parent / "tiny-llada-orl")


def random_llada2():
    return helpers.random_model(helpers.LLADA2, seed=3)


def random_dream():
    return qwen_testing.make_model(qwen_testing.DREAM, seed=4)


def tiny_diffusion_gemma():
    return dlmrt.load(dlmrt.TINY_MODEL_DIR.parent / "tiny-diffusion-gemma")


def sharded_logits(ranks, make_model, ids, plan: ParallelPlan):
    """This rank's logits (its vocabulary slice under TP), the whole model's, and the collectives of the
    forward."""
    expected = make_model().denoise(ids).logits
    model = plan.apply(make_model(), ranks)
    rows = model.vocab_shard.rows if model.vocab_shard is not None else slice(None)
    with torch.no_grad():
        ranks.count()
        logits = model.denoise(ids).logits
    return {"logits": logits, "expected": expected[..., rows], "calls": list(ranks.log.calls)}


def generated_tokens(ranks, cases):
    """For each case (make_model, plan, mode, settings list): the tokens of each settings, with the model split
    by the plan on this rank (`ranks` None: one process, unsplit), and the collectives of the case's first call
    with its NFE."""
    results = []
    for make_model, plan, mode, settings_list in cases:
        model = make_model()
        if ranks is not None:
            plan.apply(model, ranks)
            ranks.count()
        generator = Generator(TorchBackend(model, mode=mode))
        prompts = [text.encode(model, prompt) for prompt in PROMPTS]
        tokens, first = [], None
        for settings in settings_list:
            result = generator.generate(prompts, settings)
            tokens.append(result.tokens)
            if first is None:
                first = {"calls": list(ranks.log.calls) if ranks is not None else [],
                         "forwards": result.metrics.forwards_executed}
        results.append({"tokens": tokens, **first})
    return results


def dies_mid_generate(ranks, make_model, settings):
    """Rank 1 kills itself (SIGKILL: no goodbye to the others) after its first block; the others go on."""
    import os
    import signal

    model = plan_model(ranks, make_model, ParallelPlan(tp=ranks.world))
    run = Generator(TorchBackend(model, mode="eager")).stream([text.encode(model, p) for p in PROMPTS], settings)
    for number, _ in enumerate(run):
        if ranks.rank == 1 and number == 0:
            os.kill(os.getpid(), signal.SIGKILL)
    return run.result.tokens


def plan_model(ranks, make_model, plan: ParallelPlan):
    return plan.apply(make_model(), ranks)
