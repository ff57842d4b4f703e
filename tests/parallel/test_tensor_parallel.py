"""Tensor parallelism on two gloo ranks: each rank's logits are its vocabulary slice of the one-process
model's, with one all-reduce after attention and one after the MLP (compiled steps: test_parallel_generate);
the split's arithmetic by hand; what does not split is refused before any rank starts."""

from __future__ import annotations

import pytest
import torch

import jobs_tp
from dlmrt.core.errors import ArgumentError
from dlmrt.models.checkpoint import structure
from dlmrt.parallel.launch import run_ranks
from dlmrt.parallel.plan import ParallelPlan
from dlmrt.parallel.tensor_parallel import HeadSplit, check_tensor_split, split_heads, tp_sizes, vocab_split

# Partial sums over ranks add in another order than one matmul: float32 logits agree to rounding, relative
# to their size.
RELATIVE = 1e-5


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().item()
    assert (actual - expected).abs().max().item() <= RELATIVE * max(scale, 1.0)


# -- the split, by hand ----------------------------------------------------------------------------------
def test_heads_split_and_kv_heads_replicate_when_fewer_than_ranks():
    assert split_heads(4, 2, 2, 0) == HeadSplit(range(0, 2), range(0, 1))
    assert split_heads(4, 2, 2, 1).kv == range(1, 2)
    # 4 ranks, 2 K/V heads: query heads 0, 1 read K/V head 0; query heads 2, 3 read K/V head 1
    assert [split_heads(4, 2, 4, rank).kv for rank in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    assert [split_heads(4, 2, 4, rank).query for rank in range(4)] == [range(r, r + 1) for r in range(4)]
    assert [split_heads(8, 8, 4, rank).kv for rank in range(4)] == [range(2 * r, 2 * r + 2) for r in range(4)]


def test_vocabulary_split_covers_every_token_once():
    assert [vocab_split(43, 2, r) for r in range(2)] == [slice(0, 22), slice(22, 43)]
    slices = [vocab_split(10, 4, r) for r in range(4)]
    assert slices == [slice(0, 3), slice(3, 6), slice(6, 8), slice(8, 10)]


def test_a_split_that_does_not_fit_is_refused_naming_the_sizes_that_do():
    tiny = structure(jobs_tp.dlmrt.TINY_MODEL_DIR)  # 4 query heads, 2 K/V heads, MLP 512, vocabulary 43
    assert tp_sizes(tiny) == [1, 2, 4]
    with pytest.raises(ArgumentError, match=r"--tp 3 does not fit tiny-llada: 4 query heads do not split over 3 "
                                            r"ranks.*\(--tp values that fit: 1, 2, 4\)"):
        check_tensor_split(tiny, 3)
    with pytest.raises(ArgumentError, match="has no tensor- or expert-parallel path"):
        ParallelPlan(tp=2).check_backend("ort")
    with pytest.raises(ArgumentError, match="must be equal"):
        ParallelPlan(tp=2, ep=4).check(tiny)


# -- two ranks against one process -----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("make_model, per_layer, per_forward", [
    (jobs_tp.tiny_llada, 2, 0), (jobs_tp.random_llada2, 2, 0), (jobs_tp.random_dream, 2, 0),
    # DiffusionGemma norms the attention's, the dense MLP's and the experts' outputs apart: three per layer,
    # and one for the self-conditioning MLP
    (jobs_tp.tiny_diffusion_gemma, 3, 1)],
    ids=["llada", "llada2_moe", "dream", "diffusion_gemma"])
def test_two_ranks_give_the_vocabulary_slices_of_the_one_process_logits(make_model, per_layer, per_forward):
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    results = run_ranks(jobs_tp.sharded_logits, 2, (make_model, ids, ParallelPlan(tp=2)))
    model = make_model()
    slices = []
    for rank, result in enumerate(results):
        assert_logits_close(result["logits"], result["expected"])
        slices.append(result["logits"].shape[-1])
        # one all-reduce of the hidden states [B, T, H] after attention, one after the MLP or MoE
        hidden = 2 * 12 * model.hidden_size * 4
        assert result["calls"] == [("all_reduce", hidden)] * (per_layer * model.num_layers + per_forward)
    assert sum(slices) == model.vocab_size
