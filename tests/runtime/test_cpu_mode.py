"""`--mode auto` on a CPU (dlmrt/runtime/cpu_mode.py): compile where the work's matmul time saved outweighs a
warm trace, eager where it does not; and the commands that build the backend from it."""

from __future__ import annotations

import pytest
import torch

import dlmrt
from dlmrt import TINY_MODEL_DIR
from dlmrt.bench.models import random_model
from dlmrt.cli.backends import open_backend
from dlmrt.runtime import Fixed, GenerationSettings, Threshold, cpu_mode


@pytest.fixture(scope="module")
def tiny():
    return dlmrt.load(TINY_MODEL_DIR)


def test_the_work_counts_every_step_a_policy_may_take_and_the_rows_each_forward_runs(tiny):
    prompts = [[5] * 10, [5] * 7, [5] * 3]
    fixed = GenerationSettings(16, 8, Fixed(steps=8), cache="none")
    # 8 steps a run, 2 batches of at most 2 rows, 3 runs; a forward without a cache runs the whole canvas
    assert cpu_mode.work_of(tiny, fixed, prompts, max_batch=2, repeats=3) == cpu_mode.Work(8 * 2 * 3, 2 * (10 + 16))
    threshold = GenerationSettings(16, 8, Threshold(0.9), cache="dual")
    # a threshold policy may take a step per token; with a cache a forward runs the block
    assert cpu_mode.work_of(tiny, threshold, prompts, max_batch=4) == cpu_mode.Work(16, 3 * 8)


def test_the_time_saved_is_the_matmul_flops_at_the_two_rates(tiny):
    weights = sum(m.weight.numel() for m in tiny.modules() if isinstance(m, torch.nn.Linear))
    work = cpu_mode.Work(forwards=10, rows=32)
    flops = 2 * weights * 32 * 10
    expected = flops / cpu_mode.EAGER_FLOP_RATE - flops / cpu_mode.COMPILED_FLOP_RATE
    assert cpu_mode.seconds_saved(tiny, work) == pytest.approx(expected)


def test_an_eager_step_off_onednn_is_counted_at_the_blas_rate(tiny):
    """A bfloat16 model's eager linears stay on torch's BLAS (dlmrt/runtime/onednn.py packs float32 only)."""
    half = dlmrt.load(TINY_MODEL_DIR, dtype="bfloat16")
    work = cpu_mode.Work(forwards=10, rows=32)
    flops = 2 * sum(m.weight.numel() for m in tiny.modules() if isinstance(m, torch.nn.Linear)) * 32 * 10
    assert cpu_mode.seconds_saved(half, work) == pytest.approx(
        flops / cpu_mode.EAGER_BLAS_FLOP_RATE - flops / cpu_mode.COMPILED_FLOP_RATE)
    assert cpu_mode.seconds_saved(half, work) > cpu_mode.seconds_saved(tiny, work)


def test_a_one_off_command_on_the_tiny_model_stays_eager_and_a_long_one_on_a_big_model_compiles(tiny):
    settings = GenerationSettings(16, 8, Threshold(0.9), cache="dual")
    assert cpu_mode.auto_mode(tiny, cpu_mode.work_of(tiny, settings, [[5] * 10], 64)) == "eager"
    big = random_model("llada-512x6")
    long = GenerationSettings(128, 32, Fixed(steps=128), cache="none")
    assert cpu_mode.auto_mode(big, cpu_mode.work_of(big, long, [[5] * 32] * 4, 4, repeats=5)) == "compile"


@pytest.mark.parametrize("saved, expected", [(0.0, "eager"), (1e9, "compile")])
def test_open_backend_builds_the_mode_the_work_asks_for(monkeypatch, saved, expected):
    monkeypatch.setattr(cpu_mode, "seconds_saved", lambda model, work: saved)
    _, backend = open_backend("torch", None, dtype="float32", mode="auto", max_batch=4, device="cpu", engines=None,
                              precision=None, console=None, work=lambda model: cpu_mode.Work(1, 1))
    assert backend.mode == expected


def test_a_mode_named_is_run_whatever_the_work(monkeypatch):
    monkeypatch.setattr(cpu_mode, "seconds_saved", lambda model, work: 1e9)
    _, backend = open_backend("torch", None, dtype="float32", mode="eager", max_batch=4, device="cpu", engines=None,
                              precision=None, console=None, work=lambda model: cpu_mode.Work(1, 1))
    assert backend.mode == "eager"
