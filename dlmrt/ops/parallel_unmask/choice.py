"""Which kernels run the unmasking step of a torch step graph, chosen here and nowhere else.

    resolve("auto", device, mode)   # what a TorchBackend runs by default
    resolve("torch", ...)           # the op's torch reference (`reference.py`), on any device
    resolve("triton", ...)          # the op's Triton kernels (`triton_kernels.py`), two launches
    resolve("triton-split", ...)    # the vocabulary split across programs (`split_kernels.py`), three

`auto` is the torch reference on a CPU, under torch.compile, and on a tensor-parallel rank (which
unmasks from its vocabulary slice), and on CUDA whichever kernel the last GPU run measured fastest:
`CUDA_FASTEST`, where the Triton extra is installed. A kernel no GPU run has timed (today
"triton-split") is never the default.
"""

from __future__ import annotations

import importlib.util

import torch

from dlmrt.core.errors import ArgumentError

KERNELS = ("auto", "torch", "triton", "triton-split")

# docs/gpu-runs.md, 2026-12-04, one H200 (scripts/bench_step_latency.py, logits [1, 32, 126464] float32),
# median µs greedy / at temperature 0.8: torch reference 1394.7 / 1947.5, Triton two kernels 290.0 / 908.5,
# Triton fused 3240.1 / 13691.3. Change this only with a newer run's numbers beside it.
CUDA_FASTEST = "triton"


def check(unmask: str) -> None:
    if unmask not in KERNELS:
        raise ArgumentError(f"unmask must be one of {', '.join(KERNELS)}, got {unmask!r}")


def resolve(unmask: str, device: torch.device, mode: str = "eager", sharded: bool = False) -> str:
    """"torch", "triton" or "triton-split": what `unmask` runs for a step on `device` in `mode` (eager, compile,
    cudagraph); `sharded` for a tensor-parallel rank's step."""
    check(unmask)
    if unmask != "auto":
        return unmask
    # Inductor compiles the reference into its own kernels: that case was not measured against Triton.
    if device.type != "cuda" or mode == "compile" or sharded:
        return "torch"
    if CUDA_FASTEST == "triton" and importlib.util.find_spec("triton") is None:
        return "torch"
    return CUDA_FASTEST
