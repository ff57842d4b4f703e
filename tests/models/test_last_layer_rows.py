"""The last layer runs its MLP on the wanted positions alone (`Denoiser.denoise` with a logits range or
index): the logits are those of the whole forward, sliced; an ORL model, whose next residual needs every
position, keeps them all."""

from __future__ import annotations

import pytest
import torch

import dlmrt
from dlmrt import models
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


def test_llada_projects_only_the_wanted_queries_and_its_logits_match_over_padding_and_a_cached_prefix():
    from dlmrt.models import PastKV

    model = models.create(LLADA, tokens=TASK_TOKENS, seed=2).eval()
    ids = torch.randint(0, model.vocab_size - 8, (2, 16), generator=torch.Generator().manual_seed(3))
    key_mask = torch.ones(2, 16, dtype=torch.bool)
    key_mask[1, :5] = False  # the second row is left-padded
    positions = (key_mask.cumsum(1) - 1).clamp(min=0)
    seen = []
    hook = model.blocks()[-1].q_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    with torch.no_grad():
        whole = model.denoise(ids, positions=positions, key_mask=key_mask, return_kv=True)
        ranged = model.denoise(ids, positions=positions, key_mask=key_mask, logits_range=(10, 14)).logits
        past = PastKV(whole.kv[..., :8, :], positions[:, :8])
        window = model.denoise(ids[:, 8:], positions=positions[:, 8:], key_mask=key_mask, past=past,
                               logits_index=torch.tensor([1, 6])).logits
    hook.remove()
    assert seen == [16, 4, 2]
    torch.testing.assert_close(ranged, whole.logits[:, 10:14], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(window, whole.logits[:, [9, 14]], rtol=1e-5, atol=1e-5)


def test_query_rows_selects_the_query_axis_and_leaves_a_broadcast_table():
    from dlmrt.models.layers import query_rows

    table = torch.arange(2 * 1 * 5 * 3).view(2, 1, 5, 3)
    broadcast = torch.ones(2, 1, 1, 3)
    def keep(t, dim=1):
        return t.narrow(dim, 1, 2)

    assert torch.equal(query_rows(table, keep), table[:, :, 1:3])
    assert query_rows(broadcast, keep) is broadcast
