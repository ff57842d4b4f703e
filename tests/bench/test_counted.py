"""Counted work (dlmrt.bench.counted): a case counts the same work run after run, its FLOPs are a hand
count's and ONNX Runtime's graphs count torch's, and each regression the benchmark gate must catch
changes a count that timing would have to see through noise."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dlmrt
from dlmrt.bench.counted import count_work
from dlmrt.core import tasks
from dlmrt.models.layers import RMSNorm
from dlmrt.models.llada import LLaDABlock
from dlmrt.runtime import Fixed, GenerationSettings, device_step, text
from dlmrt.runtime.executor import Executor
from dlmrt.runtime.mask_batch import MaskBatch
from helpers import VOCAB

# Two blocks of four steps each: a step over the whole canvas that fills the dual cache, then three over it.
SETTINGS = GenerationSettings(16, 8, Fixed(8), cache="dual", ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return dlmrt.load()


@pytest.fixture(scope="module")
def prompts(tiny):
    return [text.encode(tiny, example.prompt) for example in tasks.examples("test", 1, seed=3)]


def counted(kind, model, prompts, request=None, settings=SETTINGS):
    export_dir = request.getfixturevalue("tiny_export") if kind == "ort" else None
    return count_work(kind, model, prompts, settings, export_dir=export_dir)


@pytest.mark.parametrize("kind", ["reference", "torch:eager", "ort"])
def test_a_case_counts_the_same_work_run_after_run(request, tiny, prompts, kind):
    first = counted(kind, tiny, prompts, request)
    assert counted(kind, tiny, prompts, request) == first
    assert first.nfe == first.forwards_executed == (16 if kind == "reference" else 8)
    assert first.blocks == 2
    assert min(first.host_reads, first.flops_per_token, first.peak_bytes) > 0
    assert (first.aten_ops_per_step is None) == (kind == "ort")
    assert first.compiled_graphs is first.recompiles is None


def test_flops_are_a_hand_count_of_the_forwards(llada):
    """The reference loop runs the whole canvas each step: 2 FLOPs a weight of the linear layers and
    the head per position, and the attention's two products, Q K^T and its weights times V."""
    prompts, gen_length = [[5, 6, 7, 8], [9, 10, 11, 12]], 8
    counts = count_work("reference", llada, prompts, GenerationSettings(gen_length, 4, ignore_eos=True))
    rows, length, width, heads, head, kv_width, mlp, layers = 2, 12, 32, 4, 8, 16, 48, 2  # helpers.LLADA
    weights = layers * (2 * width * width + 2 * width * kv_width + 3 * width * mlp) + width * VOCAB
    attention = layers * 2 * (2 * heads * length * length * head)
    forward = rows * (2 * length * weights + attention)
    assert counts.nfe == gen_length
    assert counts.flops_per_token == gen_length * forward // (rows * gen_length)


def test_ort_counts_from_its_graphs_the_work_torch_counts(request, tiny, prompts):
    eager, ort = counted("torch:eager", tiny, prompts), counted("ort", tiny, prompts, request)
    assert ort.flops_per_token == eager.flops_per_token
    assert (ort.nfe, ort.forwards_executed, ort.host_reads, ort.blocks) == (
        eager.nfe, eager.forwards_executed, eager.host_reads, eager.blocks)


# -- the regressions the gate must catch -----------------------------------------------------------
def test_a_wasted_forward_per_block_shows_in_the_flops(tiny, prompts, monkeypatch):
    """The loop's own counters do not see a forward that no step runs."""
    before = counted("torch:eager", tiny, prompts)
    start_block = MaskBatch._start_block

    def wasting(self):
        self.backend.model(self.state.canvas)
        return start_block(self)
    monkeypatch.setattr(MaskBatch, "_start_block", wasting)
    after = counted("torch:eager", tiny, prompts)
    assert (after.nfe, after.forwards_executed) == (before.nfe, before.forwards_executed)
    assert after.flops_per_token > before.flops_per_token


def test_the_dual_cache_silently_off_shows_in_the_flops(tiny, prompts, monkeypatch):
    before = counted("torch:eager", tiny, prompts)
    kinds_for_block = device_step.kinds_for_block
    monkeypatch.setattr(device_step, "kinds_for_block",
                        lambda cache, *args, **kwargs: kinds_for_block("none", *args, **kwargs))
    after = counted("torch:eager", tiny, prompts)
    assert after.nfe == before.nfe
    assert after.flops_per_token > before.flops_per_token


@pytest.mark.parametrize("kind", ["torch:eager", "ort"])
def test_a_host_read_per_step_shows_in_the_host_reads(request, tiny, prompts, monkeypatch, kind):
    before = counted(kind, tiny, prompts, request)
    step = device_step.step

    def reading(state, step_kind, run_graph):
        step(state, step_kind, run_graph)
        state.status[-1].item()
    monkeypatch.setattr(device_step, "step", reading)
    after = counted(kind, tiny, prompts, request)
    assert after.host_reads == before.host_reads + before.forwards_executed


@pytest.mark.parametrize("kind", ["reference", "torch:eager"])
def test_a_matmul_more_in_the_forward_shows_in_flops_and_aten_ops(tiny, prompts, monkeypatch, kind):
    before = counted(kind, tiny, prompts)
    forward = LLaDABlock.forward

    def one_more(self, x, *args, **kwargs):
        x, kv = forward(self, x, *args, **kwargs)
        return x + 0 * (x @ self.attn_out.weight.T), kv
    monkeypatch.setattr(LLaDABlock, "forward", one_more)
    after = counted(kind, tiny, prompts)
    assert after.flops_per_token > before.flops_per_token
    assert after.aten_ops_per_step > before.aten_ops_per_step


def test_more_work_in_every_step_shows_in_the_aten_ops(tiny, prompts, monkeypatch):
    """Every norm computed twice: about 15% more ops a step, none of them a matrix product."""
    before = counted("torch:eager", tiny, prompts)
    norm = RMSNorm.forward

    def twice(self, x):
        norm(self, x)
        return norm(self, x)
    monkeypatch.setattr(RMSNorm, "forward", twice)
    after = counted("torch:eager", tiny, prompts)
    assert after.flops_per_token == before.flops_per_token
    assert after.aten_ops_per_step > 1.1 * before.aten_ops_per_step


def test_a_step_that_keeps_its_tensors_shows_in_the_peak_bytes(tiny, prompts, monkeypatch):
    before = counted("torch:eager", tiny, prompts)
    kept, step = [], device_step.step

    def keeping(state, step_kind, run_graph):
        step(state, step_kind, run_graph)
        kept.append(torch.zeros(2**18))  # 1 MiB a step
    monkeypatch.setattr(device_step, "step", keeping)
    after = counted("torch:eager", tiny, prompts)
    assert after.peak_bytes >= before.forwards_executed * 2**20 > before.peak_bytes  # all kept at the end


def test_compile_is_counted_warm_and_silently_running_eager_shows(tiny, prompts, monkeypatch):
    uncached = dataclasses.replace(SETTINGS, cache="none")  # one graph to compile: about 20 s on 2 cores
    compiled = counted("torch:compile", tiny, prompts, settings=uncached)
    assert counted("torch:compile", tiny, prompts, settings=uncached) == compiled  # this one finds the graph compiled
    assert (compiled.compiled_graphs, compiled.recompiles) == (1, 0)
    assert compiled.flops_per_token is compiled.aten_ops_per_step is compiled.peak_bytes is None
    monkeypatch.setattr(Executor, "_compile", Executor._eager)
    eager = counted("torch:compile", tiny, prompts, settings=uncached)
    assert eager.compiled_graphs == 0
    assert (eager.nfe, eager.host_reads) == (compiled.nfe, compiled.host_reads)
