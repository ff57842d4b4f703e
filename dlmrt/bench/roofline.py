"""The roofline of a step: each row's bytes and FLOPs, counted from the step graph itself on meta
tensors, and the floor they set on a GPU.

    model = meta_model("llada-8b", "bfloat16")
    roofline = count_step(model, StepCase(batch=1, input_len=512, output_len=32, block_length=32, cache="dual"))
    roofline.floor_s(gpu("h200"))

A row's floor is the longer of moving its bytes at the GPU's bandwidth and computing its FLOPs at the
peak rate of their dtype; the step's floor is the sum of its rows' floors (rows run one after another,
each at its own bound). The weights floor is the weight bytes the step reads, at the bandwidth: what no
kernel fusion can remove. Rows and their counting rules: `step_scopes`, `op_costs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dlmrt.bench.hardware import Gpu
from dlmrt.bench.meta_kernels import check_moe_dtype, fused_attention, moe_layers
from dlmrt.bench.op_costs import Cost, OpCosts
from dlmrt.bench.step_case import StepCase, step_graph, step_inputs, step_shapes
from dlmrt.bench.step_scopes import GroupScopes, row_name
from dlmrt.core.errors import ArgumentError
from dlmrt.models import Denoiser
from dlmrt.runtime import fp8_linear
from dlmrt.runtime.fp8_linear import Fp8Linear


@dataclass(frozen=True)
class Roofline:
    model: str
    dtype: torch.dtype
    case: StepCase
    rows: dict[str, Cost]  # in the order the step first runs them
    weights_bytes: int  # every weight's bytes, once
    top_k: int | None  # experts a token chooses (MoE models)
    precision: str = ""  # "fp8" where the blocks' linears run in FP8 (dlmrt/runtime/fp8_linear.py), else ""

    @property
    def label(self) -> str:
        """The model's dtype, and the linears' precision where it differs."""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{dtype}, {self.precision} linears" if self.precision else dtype

    @property
    def total(self) -> Cost:
        total = Cost()
        for cost in self.rows.values():
            total.ops += cost.ops
            total.bytes_read += cost.bytes_read
            total.bytes_written += cost.bytes_written
            total.weight_bytes += cost.weight_bytes
            total.flops += cost.flops
        return total

    @staticmethod
    def row_floor_s(cost: Cost, gpu: Gpu) -> float:
        compute = sum(flops / gpu.flop_rate(dtype) for dtype, flops in (cost.flops_by_dtype or {}).items())
        return max((cost.bytes_read + cost.bytes_written) / gpu.bandwidth, compute)

    def floor_s(self, gpu: Gpu) -> float:
        return sum(self.row_floor_s(cost, gpu) for cost in self.rows.values())

    def weights_floor_s(self, gpu: Gpu) -> float:
        return self.total.weight_bytes / gpu.bandwidth


def count_step(model: Denoiser, case: StepCase) -> Roofline:
    """The roofline of `case`'s step of `model`, a module tree on the meta device (`meta_model`)."""
    if model.device.type != "meta":
        raise ValueError(f"count_step runs the step on meta tensors: build {model.name} on the meta device")
    shapes = step_shapes(model, case)
    graph = step_graph(model, shapes, case.block_length)
    inputs = step_inputs(model, case, shapes, "meta")
    layers = moe_layers(model)
    top_k = layers[0][1].gate.top_k if layers else None
    scopes = GroupScopes(graph)
    check_moe_dtype(model)
    with torch.no_grad(), fused_attention(), scopes:
        with OpCosts(lambda op: row_name(scopes.current, op), list(model.state_dict().values()), top_k or 1) as costs:
            graph(**inputs)
    stored = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in model.state_dict().values()}
    precision = "fp8" if any(isinstance(m, Fp8Linear) for m in model.modules()) else ""
    return Roofline(model.name, model.dtype, case, dict(costs.rows), sum(stored.values()), top_k, precision)


def in_precision(model: Denoiser, precision: str | None) -> Denoiser:
    """`model` (on the meta device, or one a profile measures) with its blocks' linears in `precision`: None
    leaves it as it is, fp8 swaps them in place for FP8 linears (`fp8_linear.quantize_model`)."""
    if precision is None:
        return model
    if precision != "fp8":
        raise ArgumentError(f"unknown precision {precision!r} for a roofline: give fp8, or none for the model's dtype")
    if moe_layers(model):
        raise ArgumentError(f"the fp8 roofline counts dense models: {model.name}'s routed experts run as bfloat16 "
                            f"grouped GEMMs here; drop --precision fp8")
    fp8_linear.quantize_model(model, "scaled_mm" if model.device.type == "meta" else None)
    return model
