"""The roofline (dlmrt.bench.roofline): the op counter against shapes counted by hand, the weights a
step reads against the model's own tensors, MoE experts against the uniform-routing expectation, the
floors against the GPU table, the profile's rows against the roofline's, and the command's errors."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

import dlmrt
from dlmrt.bench.counted import flop_counter
from dlmrt.bench.hardware import GPUS
from dlmrt.bench.meta_kernels import fused_attention
from dlmrt.bench.models import RANDOM_CONFIGS, meta_model, random_model
from dlmrt.bench.op_costs import Cost, OpCosts, expected_experts
from dlmrt.bench.roofline import Roofline, count_step
from dlmrt.bench.step_case import StepCase
from dlmrt.bench.step_profile import profile_step
from dlmrt.cli.commands import main

BF16 = dict(dtype=torch.bfloat16, device="meta")


def one_row(run, weights=(), top_k=1) -> Cost:
    """The cost of everything `run` dispatches, in one row."""
    with OpCosts(lambda op: "all", weights, top_k) as costs:
        run()
    return costs.rows["all"]


def test_a_linear_reads_its_input_and_weight_and_writes_its_output():
    batch, tokens, hidden, out = 2, 5, 64, 48
    x, weight = torch.empty(batch, tokens, hidden, **BF16), torch.empty(out, hidden, **BF16)
    cost = one_row(lambda: F.linear(x, weight), weights=[weight])
    assert cost.bytes_read == (batch * tokens * hidden + hidden * out) * 2
    assert cost.bytes_written == batch * tokens * out * 2
    assert cost.weight_bytes == hidden * out * 2
    assert cost.flops == 2 * batch * tokens * hidden * out
    assert cost.flops_by_dtype == {torch.bfloat16: cost.flops}


def test_views_are_free_and_a_gather_reads_only_what_it_gathers():
    x = torch.empty(4, 6, 8, **BF16)
    with OpCosts(lambda op: op, []) as costs:
        x.view(24, 8).transpose(0, 1).reshape(8, 24)[:, :3].unsqueeze(0).expand(5, 8, 3)
    assert dict(costs.rows) == {}
    table, ids = torch.empty(1000, 16, **BF16), torch.empty(3, 7, dtype=torch.long, device="meta")
    cost = one_row(lambda: F.embedding(ids, table), weights=[table])
    assert cost.bytes_read == 3 * 7 * 16 * 2 + 3 * 7 * 8
    assert cost.weight_bytes == 3 * 7 * 16 * 2
    assert cost.bytes_written == 3 * 7 * 16 * 2


def test_a_broadcast_tensor_counts_its_distinct_elements_and_one_tensor_counts_once():
    x, row = torch.empty(64, 32, **BF16), torch.empty(1, 32, **BF16)
    cost = one_row(lambda: x * row.expand(64, 32))
    assert cost.bytes_read == (64 * 32 + 32) * 2
    cost = one_row(lambda: x * x)
    assert cost.bytes_read == 64 * 32 * 2 and cost.bytes_written == 64 * 32 * 2


def test_attention_runs_as_one_fused_kernel_with_the_sdpa_flops():
    batch, heads, queries, keys, dim = 2, 4, 8, 24, 16
    q = torch.empty(batch, heads, queries, dim, **BF16)
    k, v = (torch.empty(batch, heads, keys, dim, **BF16) for _ in range(2))
    mask = torch.empty(batch, 1, queries, keys, dtype=torch.bool, device="meta")
    with fused_attention(), OpCosts(lambda op: op, []) as costs:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    fused = costs.rows["_scaled_dot_product_efficient_attention"]
    assert fused.flops == 4 * batch * heads * queries * keys * dim  # QK^T and PV, 2 * M * K * N each
    # q, k, v and the additive bias made from the mask (broadcast over the heads)
    assert fused.bytes_read == (batch * heads * (queries + 2 * keys) * dim + batch * queries * keys) * 2
    assert fused.bytes_written == batch * heads * queries * dim * 2 + 2 * 8  # and its two int64 RNG scalars


def test_expected_experts_at_hand_values():
    assert expected_experts(4, 1, 2) == 2.0  # one token touches exactly its k experts
    assert expected_experts(4, 2, 1) == pytest.approx(1.75)  # two draws of 4: 1 + 3/4 distinct
    assert expected_experts(256, 32, 8) == pytest.approx(256 * (1 - (248 / 256) ** 32))
    assert expected_experts(8, 1000, 2) == pytest.approx(8.0)


def test_a_grouped_gemm_reads_the_experts_its_rows_are_expected_to_touch():
    tokens, top_k, experts, hidden, inner = 3, 2, 8, 32, 16
    x = torch.empty(tokens * top_k, hidden, **BF16)
    w = torch.empty(experts, hidden, inner, **BF16)
    offs = torch.empty(experts, dtype=torch.int32, device="meta")
    cost = one_row(lambda: torch._grouped_mm(x, w, offs=offs), weights=[w], top_k=top_k)
    touched = experts * (1 - (1 - top_k / experts) ** tokens)
    assert cost.flops == 2 * tokens * top_k * hidden * inner
    assert cost.weight_bytes == pytest.approx(touched * hidden * inner * 2)
    assert cost.bytes_read == round(touched * hidden * inner * 2) + tokens * top_k * hidden * 2 + experts * 4
    with flop_counter() as counter:  # the bench gate's counter shares the formula
        torch._grouped_mm(x, w, offs=offs)
    assert counter.get_total_flops() == 2 * tokens * top_k * hidden * inner


def test_a_tiny_llada_step_reads_every_weight_once_and_of_the_embedding_its_rows():
    model = meta_model(None, "float32")
    case = StepCase(batch=2, input_len=16, output_len=16, block_length=8, cache="dual")
    roofline = count_step(model, case)
    weights = dict(model.named_parameters())
    embedding = weights["model.transformer.wte.weight"]
    window = case.block_length  # the dual cache's later steps run the block alone
    gathered = case.batch * window * model.hidden_size * 4
    assert roofline.total.weight_bytes == sum(w.nbytes for w in weights.values()) - embedding.nbytes + gathered
    assert roofline.weights_bytes == sum(w.nbytes for w in weights.values())
    blocks = model.config.n_layers
    q = weights["model.transformer.blocks.0.q_proj.weight"]
    assert roofline.rows["transformer.blocks.*.q_proj"].weight_bytes == blocks * q.nbytes
    assert roofline.rows["transformer.blocks.*.q_proj"].flops == 2 * case.batch * window * q.numel() * blocks
    assert roofline.rows["transformer.wte"].weight_bytes == gathered
    assert {"unmask", "denoiser", "transformer.blocks.* (attention)"} <= set(roofline.rows)


def test_moe_experts_count_their_expected_weights_and_the_dense_layers_all_of_theirs():
    model = meta_model("llada2-moe-small", "bfloat16")
    config = RANDOM_CONFIGS["llada2-moe-small"]
    case = StepCase(batch=2, input_len=16, output_len=16, block_length=8, cache="prefix")
    roofline = count_step(model, case)
    hidden, inner, experts, top_k = (config[k] for k in ("hidden_size", "moe_intermediate_size", "num_experts",
                                                         "num_experts_per_tok"))
    moe_layers = config["num_hidden_layers"] - config["first_k_dense_replace"]
    tokens = case.batch * case.block_length
    touched = experts * (1 - (1 - top_k / experts) ** tokens)
    for name in ("gate_proj", "up_proj", "down_proj"):
        row = roofline.rows[f"layers.*.mlp.experts.{name}"]
        assert row.weight_bytes == pytest.approx(moe_layers * touched * hidden * inner * 2)
        assert row.flops == moe_layers * 2 * tokens * top_k * hidden * inner
    dense = roofline.rows["layers.*.mlp.gate_proj"]  # the first layer's dense SwiGLU
    assert dense.weight_bytes == config["first_k_dense_replace"] * hidden * config["intermediate_size"] * 2


def test_a_row_floor_is_the_longer_of_moving_its_bytes_and_computing_its_flops():
    h200 = GPUS["h200"]
    moving = Cost(bytes_read=3_000_000_000, bytes_written=1_200_000_000, flops=1, flops_by_dtype={torch.bfloat16: 1})
    assert Roofline.row_floor_s(moving, h200) == pytest.approx(1e-3)
    computing = Cost(bytes_read=8, flops=989 * 10**9, flops_by_dtype={torch.bfloat16: 989 * 10**9})
    assert Roofline.row_floor_s(computing, h200) == pytest.approx(1e-3)
    single = Cost(flops=67 * 10**9, flops_by_dtype={torch.float32: 67 * 10**9})
    assert Roofline.row_floor_s(single, h200) == pytest.approx(1e-3)


@pytest.mark.parametrize("name", [None, "llada2-moe-small"])
def test_every_measured_row_joins_a_roofline_row(name):
    """The eager step on the CPU, its op times per row: the same rows as the count on meta tensors (the
    MoE's experts run as the family's own loop there, as grouped GEMMs here)."""
    case = StepCase(batch=2, input_len=16, output_len=16, block_length=8, cache="prefix" if name else "dual")
    roofline = count_step(meta_model(name, "bfloat16" if name else "float32"), case)
    model = dlmrt.load() if name is None else random_model(name)
    measured = profile_step(model, case, repeats=1, warmups=1)
    assert set(measured) <= set(roofline.rows)
    linears = [row for row in roofline.rows if roofline.rows[row].flops and "attention)" not in row]
    assert set(linears) <= set(measured)
    assert all(seconds > 0 for seconds in measured.values())


def bench(*args):
    return CliRunner().invoke(main, ["bench", *map(str, args)])


def test_the_command_prints_each_case_and_writes_the_json(tmp_path):
    out = tmp_path / "roofline.json"
    result = bench("--roofline", "--batch-size", "1,3", "--input-len", 16, "--output-len", 16, "--block-length", 8,
                   "--gpu", "h100", "--output-json", out)
    assert result.exit_code == 0, result.output
    assert "transformer.blocks.*.ff_proj" in result.output and "tokens/s ceiling" in result.output
    document = json.loads(out.read_text())
    assert [case["batch"] for case in document["cases"]] == [1, 3]
    assert document["gpu"]["bandwidth"] == GPUS["h100"].bandwidth
    for case in document["cases"]:
        assert case["floor_s"] == pytest.approx(sum(row["floor_s"] for row in case["rows"]))
        assert case["total"]["bytes_read"] == sum(row["bytes_read"] for row in case["rows"])


def test_the_command_refuses_a_bad_gpu_and_what_a_roofline_does_not_read():
    result = bench("--roofline", "--gpu", "h900")
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == ("Error: unknown GPU 'h900': give one of h100, h200, "
                                                      "h200-nominal, rtx5090, b200")
    result = bench("--roofline", "--num-iters", 3)
    assert result.exit_code == 2 and "--roofline counts one step of the model: drop --num-iters" in result.output
    result = bench("--batch-size", "1,8")
    assert result.exit_code == 2 and "a list of batch sizes needs --roofline" in result.output
    result = bench("--gpu", "h100")
    assert result.exit_code == 2 and "needs --roofline" in result.output
    result = bench("--roofline", "--model", "llada2-moe-small", "--dtype", "float32")
    assert result.exit_code == 2 and "give --dtype bfloat16" in result.output
