"""Expert parallelism (`dlmrt.parallel.experts`) on 2 gloo ranks: LLaDA2-MoE (shared experts,
group-limited routing) and DiffusionGemma (stacked experts, the routed sum normed after the
all-reduce). Each rank's EP-sharded model gives the unsharded model's outputs within 1e-5 (float32;
the experts are summed in another order), in eager and compiled, while holding half the experts, with
one all-reduce of N x H x 4 bytes per MoE layer and forward.

Two spawns in all: one eager job (~15 s) and one compiled job (slow: inductor on the CPU)."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest

from dlmrt.core.errors import ArgumentError
from dlmrt import models
from dlmrt.parallel.experts import allowed_expert_worlds, check_expert_split, shard_experts
from dlmrt.parallel.launch import run_ranks
from dlmrt.parallel.ranks import Ranks
from parallel.jobs_experts import build, compiled_job, eager_job, gemma_config

WORLD = 2
FAMILIES = ("llada2_moe", "diffusion_gemma")
TOLERANCE = 1e-5
FLOAT32 = 4


@pytest.fixture(scope="module")
def eager():
    """Each rank's eager results, in rank order."""
    return run_ranks(eager_job, WORLD, (FAMILIES,), timeout=timedelta(seconds=120))


@pytest.fixture(scope="module")
def compiled():
    return run_ranks(compiled_job, WORLD, (FAMILIES,), timeout=timedelta(seconds=600))


@pytest.mark.parametrize("family", FAMILIES)
def test_eager_outputs_match_the_unsharded_model_on_every_rank(eager, family):
    ranks = [result[family] for result in eager]
    for rank in ranks:
        assert rank["eager_difference"] <= TOLERANCE, rank["eager_difference"]
        assert rank["logits_spread"] > 0.1  # logits that vary, so that a wrong sum shows
        # the check means something: tokens whose chosen experts lie on both ranks
        assert 0 < rank["split_choices"] < rank["choices"]
    np.testing.assert_allclose(ranks[0]["logits"], ranks[1]["logits"], atol=TOLERANCE, rtol=0)


def test_a_rank_whose_experts_no_token_chose_still_joins_the_sum(eager):
    """LLaDA2 with every router biased onto rank 0's experts: rank 1 computes nothing (it adds no shared
    experts either), yet issues the same all-reduces, and the output is still the unsharded one."""
    for result in eager:
        rank = result["llada2_moe"]
        assert rank["idle_difference"] <= TOLERANCE, rank["idle_difference"]
        assert rank["idle_calls"] == rank["calls"]


def test_shared_experts_split_by_tp_are_added_by_every_rank_before_the_one_all_reduce(eager):
    """The contract with TP: with LLaDA2's shared experts split across the ranks (gate/up by rows, down
    by columns) and `shared_is_partial` set, every rank adds its part, still in one all-reduce per layer."""
    for result in eager:
        rank = result["llada2_moe"]
        assert rank["split_shared_difference"] <= TOLERANCE, rank["split_shared_difference"]
        assert rank["split_shared_calls"] == rank["calls"]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_keeps_only_its_slice_of_the_experts(eager, family):
    for index, result in enumerate(eager):
        rank = result[family]
        experts, layers = rank["num_experts"], rank["moe_layers"]
        part = experts // WORLD
        assert rank["kept_experts"] == [list(range(index * part, (index + 1) * part))] * layers
        assert rank["kept_match"] and rank["kept_own_storage"]  # the right weights, not views of the full stacks
        # the other experts' weights are freed: of the full model's expert parameters, only the kept live on
        assert rank["old_expert_parameters_alive"] == 0
        assert rank["expert_parameters"] * WORLD == rank["full_expert_parameters"]
        assert rank["parameters"] == rank["full_parameters"] - rank["full_expert_parameters"] // WORLD
        if family == "llada2_moe":  # the full model's names, for this rank's experts only
            kept = {name.split(".experts.")[1].split(".")[0] for name in rank["kept_names"]}
            assert kept == {str(e) for e in range(index * part, (index + 1) * part)}
            assert set(rank["kept_names"]) < set(rank["full_names"])


@pytest.mark.parametrize("family", FAMILIES)
def test_one_all_reduce_of_tokens_x_hidden_per_moe_layer(eager, family):
    """The docstring's formula: L all_reduce calls of N x H x b bytes per forward; DiffusionGemma's
    step here is an encode of the prompt then a denoise of the canvas, each through every layer."""
    for result in eager:
        rank = result[family]
        hidden, layers = rank["hidden_size"], rank["moe_layers"]
        expected = [("all_reduce", tokens * hidden * FLOAT32) for tokens in rank["tokens"].values()
                    for _ in range(layers)]
        assert rank["calls"] == expected


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_outputs_match_the_unsharded_model_on_every_rank(compiled, family):
    ranks = [result[family] for result in compiled]
    for rank in ranks:
        assert rank["difference"] <= TOLERANCE, rank["difference"]  # against the unsharded eager step
    np.testing.assert_allclose(ranks[0]["logits"], ranks[1]["logits"], atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_experts_that_do_not_split_evenly_are_refused_in_one_line(family):
    model = build(family)  # 8 experts in each MoE layer
    check_expert_split(model, 4)
    for world in (3, 16):
        with pytest.raises(ArgumentError) as error:
            check_expert_split(model, world)
        message = str(error.value)
        assert "\n" not in message
        assert f"--ep {world}" in message and "8 experts" in message
        assert message.endswith("allowed --ep values: 1, 2, 4, 8")
    with pytest.raises(ArgumentError, match="--ep 3"):  # before any collective: no process group here
        shard_experts(model, Ranks(0, 3))
    assert allowed_expert_worlds(128) == [1, 2, 4, 8, 16, 32, 64, 128]


def test_the_split_is_checked_on_a_module_tree_without_weights():
    """The CLI can check --ep before any rank starts and before any weight is read: on the meta-device
    tree that `models.build` makes from config.json (here 128 experts, as DiffusionGemma 26B-A4B has)."""
    raw = gemma_config()
    raw["text_config"]["num_experts"] = 128
    model = models.build(raw, "config.json", None, device="meta")
    check_expert_split(model, 8)
    allowed = "1, 2, 4, 8, 16, 32, 64, 128"
    with pytest.raises(ArgumentError, match=rf"^--ep 6 does not divide the 128 experts .*: {allowed}$"):
        check_expert_split(model, 6)


def test_a_model_without_experts_is_refused_for_ep_above_one():
    from helpers import LLADA, random_model

    model = random_model(LLADA)
    check_expert_split(model, 1)
    with pytest.raises(ArgumentError, match="no MoE layers"):
        check_expert_split(model, 2)
