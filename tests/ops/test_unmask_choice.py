"""`unmask="auto"`: the torch reference on a CPU, under compile and on a tensor-parallel rank; on CUDA the
kernel the last GPU run measured fastest, where Triton is installed."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dlmrt.core.errors import ArgumentError
from dlmrt.ops.parallel_unmask import choice

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def test_auto_is_the_reference_wherever_no_gpu_run_measured_triton_faster():
    assert choice.resolve("auto", CPU, "eager") == "torch"
    assert choice.resolve("auto", CPU, "compile") == "torch"
    assert choice.resolve("auto", CUDA, "compile") == "torch"
    assert choice.resolve("auto", CUDA, "cudagraph", sharded=True) == "torch"


def test_auto_on_cuda_is_the_measured_fastest(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert choice.CUDA_FASTEST == "triton"  # docs/gpu-runs.md, 2026-12-04: 290.0 µs against the reference's 1394.7
    assert choice.resolve("auto", CUDA, "cudagraph") == "triton"
    assert choice.resolve("auto", CUDA, "eager") == "triton"


def test_auto_without_the_triton_extra_is_the_reference(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert choice.resolve("auto", CUDA, "cudagraph") == "torch"


def test_an_explicit_choice_is_kept():
    assert choice.resolve("triton", CPU) == "triton"
    assert choice.resolve("torch", CUDA, "cudagraph") == "torch"


def test_an_unknown_choice_is_one_clear_error():
    with pytest.raises(ArgumentError, match="unmask must be one of auto, torch, triton, triton-split, got 'fused'"):
        choice.resolve("fused", CPU)
