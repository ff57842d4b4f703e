"""The GPUs a roofline is drawn for: memory bandwidth and peak dense FLOP rates, from the vendor's
datasheets (sources beside each row). Rates are dense (no 2:4 sparsity), with float32 accumulation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dlmrt.core.errors import ArgumentError

T = 1e12


@dataclass(frozen=True)
class Gpu:
    name: str
    label: str
    bandwidth: float  # bytes/s of HBM (GDDR7 on the RTX 5090)
    bf16_flops: float  # FLOP/s of a bf16 or fp16 tensor-core matmul
    fp8_flops: float  # FLOP/s of an fp8 tensor-core matmul (torch._scaled_mm)
    fp32_flops: float  # FLOP/s of float32 without tensor cores (torch's default: TF32 off)

    def flop_rate(self, dtype: torch.dtype) -> float:
        """The peak rate of a matmul whose inputs are `dtype`."""
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return self.fp8_flops
        return self.fp32_flops if dtype in (torch.float32, torch.float64) else self.bf16_flops


GPUS = {gpu.name: gpu for gpu in (
    # NVIDIA H100 SXM datasheet: 3.35 TB/s, BF16 1979 / FP8 3958 TFLOPS with sparsity, FP32 67 TFLOPS.
    Gpu("h100", "H100 SXM", 3.35 * T, 989 * T, 1979 * T, 67 * T),
    # NVIDIA H200 SXM datasheet: 4.8 TB/s nominal, the H100's compute. 4.17 TB/s is the device-to-device
    # copy bandwidth scripts/bench_step_latency.py measured on one (docs/gpu-runs.md, 2026-12-04).
    Gpu("h200", "H200 SXM (measured bandwidth)", 4.2 * T, 989 * T, 1979 * T, 67 * T),
    Gpu("h200-nominal", "H200 SXM (nominal bandwidth)", 4.8 * T, 989 * T, 1979 * T, 67 * T),
    # NVIDIA RTX Blackwell GPU architecture whitepaper, GeForce RTX 5090: 1792 GB/s; FP16/BF16 tensor with
    # FP32 accumulate 209.5 TFLOPS dense (GeForce runs FP32 accumulation at half the FP16-accumulate rate),
    # FP8 with FP32 accumulate 419 dense; 104.8 TFLOPS FP32 shader.
    Gpu("rtx5090", "RTX 5090", 1.79 * T, 209.5 * T, 419 * T, 104.8 * T),
    # NVIDIA HGX B200 datasheet, per GPU: 8 TB/s (the HGX board's 62 TB/s over 8 GPUs is 7.7), BF16 4.5 /
    # FP8 9 PFLOPS with sparsity, FP32 75 TFLOPS.
    Gpu("b200", "B200 (HGX)", 8 * T, 2250 * T, 4500 * T, 75 * T),
)}


def gpu(name: str) -> Gpu:
    if name not in GPUS:
        raise ArgumentError(f"unknown GPU {name!r}: give one of {', '.join(GPUS)}")
    return GPUS[name]
