"""Decoding on two gloo ranks gives the tokens of one process: tensor parallelism (TP) for the tiny LLaDA, its
ORL variant and the tiny DiffusionGemma, expert parallelism (EP) for a random LLaDA2-MoE and the tiny
DiffusionGemma, both together, eager with and without a K/V cache, and compiled (TP). A step moves O(B·W) values
between ranks, never the logits; a rank that dies ends every rank with one error."""

from __future__ import annotations

import time

import pytest
import torch

import jobs_tp
from dlmrt.parallel.launch import RankFailure, run_ranks
from dlmrt.parallel.plan import ParallelPlan
from dlmrt.parallel.vocab import step_exchange_bytes
from dlmrt.runtime import Fixed, GenerationSettings, Threshold
from dlmrt.runtime.uniform_policy import EntropyBound

TP, EP, BOTH = ParallelPlan(tp=2), ParallelPlan(ep=2), ParallelPlan(tp=2, ep=2)
MASKED = [GenerationSettings(16, 8, Threshold(0.9), cache="none"),
          GenerationSettings(16, 8, Threshold(0.9), cache="prefix"),
          GenerationSettings(16, 8, Fixed(8), cache="dual", temperature=1.0, seed=3)]
BLOCK_CAUSAL = MASKED[:2] + [GenerationSettings(16, 8, Fixed(8), cache="prefix", temperature=1.0, seed=3)]
UNIFORM = [GenerationSettings(16, 16, EntropyBound()), GenerationSettings(16, 16, EntropyBound(), seed=5)]

EAGER_CASES = [
    (jobs_tp.tiny_llada, TP, "eager", MASKED),
    (jobs_tp.tiny_orl, TP, "eager", MASKED),
    (jobs_tp.random_llada2, TP, "eager", BLOCK_CAUSAL),
    (jobs_tp.random_llada2, EP, "eager", BLOCK_CAUSAL),
    (jobs_tp.random_llada2, BOTH, "eager", BLOCK_CAUSAL),
    (jobs_tp.tiny_diffusion_gemma, TP, "eager", UNIFORM),
    (jobs_tp.tiny_diffusion_gemma, EP, "eager", UNIFORM),
]
# Compiling costs tens of seconds a graph on two cores, twice (each rank compiles its own), so one compiled
# case: TP's all-reduces and the vocabulary-parallel statistics inside a compiled step. EP's exchange compiled
# is held by tests/parallel/test_expert_parallel.py, and the parity matrix compiles every family in one process.
COMPILED_CASES = [(jobs_tp.tiny_llada, TP, "compile", MASKED[:1])]


def case_id(case) -> str:
    make_model, plan, mode, _ = case
    return f"{make_model.__name__}-tp{plan.tp}-ep{plan.ep}-{mode}"


def check_same_tokens(cases):
    # The reference is one process, eager (the parity matrix holds compiled steps to eager's tokens).
    alone = jobs_tp.generated_tokens(None, [(make, plan, "eager", settings) for make, plan, _, settings in cases])
    ranks = run_ranks(jobs_tp.generated_tokens, 2, (cases,))
    for case, expected in zip(cases, alone):
        for rank, results in enumerate(ranks):
            for settings, want, got in zip(case[3], expected["tokens"], results[cases.index(case)]["tokens"]):
                assert torch.equal(got, want), f"{case_id(case)} rank {rank} {settings}"
    return ranks


@pytest.mark.slow
def test_two_ranks_decode_the_tokens_of_one_process_eager():
    ranks = check_same_tokens(EAGER_CASES)
    # The first call of the tiny LLaDA (threshold, no cache): each step gathers 8 float64 statistics per
    # block position from each rank, the formula of docs/parallelism.md, and never a logit.
    first = ranks[0][0]
    gathers = [size for op, size in first["calls"] if op == "all_gather"]
    batch, block, vocab = 4, 8, jobs_tp.tiny_llada().vocab_size  # 3 prompts run in the bucket of 4 rows
    assert len(gathers) == first["forwards"]
    assert set(gathers) == {step_exchange_bytes(batch, block, 2)}
    assert step_exchange_bytes(batch, block, 2) == 64 * batch * block < batch * block * vocab * 4
    reduces = [op for op, _ in first["calls"] if op == "all_reduce"]
    assert len(reduces) == 2 * 4 * first["forwards"]  # after attention and after the MLP, in each of 4 layers


@pytest.mark.slow
def test_two_ranks_decode_the_tokens_of_one_process_compiled():
    check_same_tokens(COMPILED_CASES)


@pytest.mark.slow
def test_a_rank_that_dies_mid_generate_ends_every_rank_with_one_error():
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_ranks(jobs_tp.dies_mid_generate, 2, (jobs_tp.tiny_llada, MASKED[0]))
    assert time.monotonic() - start < 30
    assert str(failure.value) == "rank 1 was killed by SIGKILL; every rank of 2 was stopped"
