"""Jobs the tensor-parallel tests run on each rank (module-level, so that spawned ranks can unpickle them).

A model is given as a picklable recipe (`make_model()`), so every rank and the one-process reference build
the same weights."""

from __future__ import annotations

import dlmrt
import torch

import helpers
import qwen_testing
from dlmrt.parallel.plan import ParallelPlan
from dlmrt.runtime import Generator
from dlmrt.runtime.torch_backend import TorchBackend


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
    """This rank's logits (its vocabulary slice under TP), the whole model's, eager and compiled, and the
    collectives one eager forward issued."""
    expected = make_model().denoise(ids).logits
    model = plan.apply(make_model(), ranks)
    rows = model.vocab_shard.rows if model.vocab_shard is not None else slice(None)
    with torch.no_grad():
        ranks.log.clear()
        eager = model.denoise(ids).logits
        calls = list(ranks.log.calls)
        compiled = torch.compile(model.denoise, fullgraph=True, dynamic=False)(ids).logits
    return {"eager": eager, "compiled": compiled, "expected": expected[..., rows], "calls": calls}


def generated_tokens(ranks, make_model, prompts, settings_list, mode, plan: ParallelPlan):
    """The tokens of each settings, on this rank, with `make_model()` split by `plan`; and the collectives
    of the first call (eager)."""
    model = make_model()
    if ranks is not None:
        plan.apply(model, ranks)
        ranks.log.clear()
    generator = Generator(TorchBackend(model, mode=mode))
    tokens, calls = [], None
    for settings in settings_list:
        tokens.append(generator.generate(prompts, settings).tokens)
        if calls is None and ranks is not None:
            calls = list(ranks.log.calls)
    return {"tokens": tokens, "calls": calls}


def dies_mid_generate(ranks, make_model, prompts, settings):
    """Rank 1 kills itself (SIGKILL: no goodbye to the others) after its first block; the others go on."""
    import os
    import signal

    model = plan_model(ranks, make_model, ParallelPlan(tp=ranks.world))
    run = Generator(TorchBackend(model, mode="eager")).stream(prompts, settings)
    for number, _ in enumerate(run):
        if ranks.rank == 1 and number == 0:
            os.kill(os.getpid(), signal.SIGKILL)
    return run.result.tokens


def plan_model(ranks, make_model, plan: ParallelPlan):
    return plan.apply(make_model(), ranks)
