"""The last layer runs its MLP on the wanted positions alone (`Denoiser.denoise` with a logits range or
index): the logits are those of the whole forward, sliced; an ORL model, whose next residual needs every
position, keeps them all."""

from __future__ import annotations

import pytest
import torch

import dlmrt
from dlmrt.export import models
from helpers import LLADA, LLADA2
from helpers import TOKENS as TASK_TOKENS
from qwen_testing import DREAM, SDAR
from qwen_testing import TOKENS as QWEN_TOKENS

CASES = {"llada": (LLADA, TASK_TOKENS), "llada2_moe": (LLADA2, TASK_TOKENS), "Dream": (DREAM, QWEN_TOKENS),
         "sdar": (SDAR, QWEN_TOKENS)}


def rows_into_the_last_mlp(model, run) -> int:
    block = model.blocks()[-1]
    norm = block.ff_norm if hasattr(block, "ff_norm") else block.post_attention_layernorm
    seen = []
    hook = norm.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    try:
        run()
    finally:
        hook.remove()
    return seen[-1]


@pytest.mark.parametrize("family", list(CASES))
def test_the_last_mlp_runs_on_the_wanted_positions_and_the_logits_are_the_whole_forwards(family):
    raw, tokens = CASES[family]
    model = models.create(raw, tokens=tokens, seed=1).eval()
    ids = torch.randint(0, model.vocab_size - 8, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model.denoise(ids).logits
        found = {}
        rows = rows_into_the_last_mlp(
            model, lambda: found.setdefault("range", model.denoise(ids, logits_range=(8, 12))))
        index = torch.tensor([3, 9, 10])
        indexed = model.denoise(ids, logits_index=index).logits
    assert rows == 4
    torch.testing.assert_close(found["range"].logits, whole[:, 8:12], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(indexed, whole[:, index], rtol=1e-5, atol=1e-5)


def test_an_orl_model_keeps_every_position_for_its_next_residual():
    model = dlmrt.load(dlmrt.TINY_ORL_MODEL_DIR)
    ids = torch.full((1, 12), model.tokens.mask_id)
    with torch.no_grad():
        rows = rows_into_the_last_mlp(model, lambda: model.denoise(ids, logits_range=(4, 8)))
    assert rows == 12
