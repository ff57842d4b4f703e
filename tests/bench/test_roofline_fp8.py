"""The roofline with the blocks' linears in FP8 (`--precision fp8`): each linear reads one byte a weight
and its scales, computes the float product's FLOPs at the fp8 rate, and LLaDA-8B's step reads about 8 GB."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from dlmrt.bench.hardware import GPUS
from dlmrt.bench.models import meta_model
from dlmrt.bench.roofline import count_step, in_precision
from dlmrt.bench.step_case import StepCase
from dlmrt.cli.commands import main
from dlmrt.core.errors import ArgumentError

CASE = StepCase(batch=2, input_len=16, output_len=16, block_length=8, cache="dual")


def test_an_fp8_linear_reads_a_byte_a_weight_and_its_scales_at_the_float_flops():
    floats = count_step(meta_model(None, "float32"), CASE)
    model = in_precision(meta_model(None, "float32"), "fp8")
    fp8 = count_step(model, CASE)
    assert fp8.precision == "fp8" and floats.precision == ""
    blocks = model.config.n_layers
    q = model.blocks()[0].q_proj
    out_features, in_features = q.weight_fp8.shape
    row = fp8.rows["transformer.blocks.*.q_proj"]
    # e4m3 weights, a float32 scale per output channel
    assert row.weight_bytes == blocks * (out_features * in_features + 4 * out_features)
    assert row.flops == floats.rows["transformer.blocks.*.q_proj"].flops
    assert set(row.flops_by_dtype) == {torch.float8_e4m3fn}
    # the head stays in the model's dtype
    assert fp8.rows["transformer.ff_out"].weight_bytes == floats.rows["transformer.ff_out"].weight_bytes


def test_llada_8b_in_fp8_reads_about_8_gb_a_step_and_floors_at_about_1_9_ms_on_an_h200():
    case = StepCase(batch=1, input_len=32, output_len=32, block_length=32, cache="dual")
    roofline = count_step(in_precision(meta_model("llada-8b", "bfloat16"), "fp8"), case)
    assert 7.9e9 < roofline.total.weight_bytes < 8.1e9
    assert 1.85e-3 < roofline.weights_floor_s(GPUS["h200"]) < 1.95e-3


def test_a_moe_model_and_an_unknown_precision_are_refused():
    with pytest.raises(ArgumentError, match="counts dense models"):
        in_precision(meta_model("llada2-moe-small", "bfloat16"), "fp8")
    with pytest.raises(ArgumentError, match="unknown precision 'int3'"):
        in_precision(meta_model(None, "float32"), "int3")


def bench(*args):
    return CliRunner().invoke(main, ["bench", *map(str, args)])


def test_the_command_counts_fp8_and_says_so(tmp_path):
    out = tmp_path / "roofline.json"
    result = bench("--roofline", "--precision", "fp8", "--input-len", 16, "--output-len", 16, "--block-length", 8,
                   "--output-json", out)
    assert result.exit_code == 0, result.output
    assert "fp8 linears" in result.output
    assert json.loads(out.read_text())["precision"] == "fp8"


def test_precision_without_the_roofline_is_refused():
    result = bench("--precision", "fp8")
    assert result.exit_code == 2 and "--precision applies to --roofline" in result.output
