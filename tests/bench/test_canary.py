"""dlmrt.bench.canary: fixed seeded inputs, a run that does its GEMMs and attention calls and fits the
gate's rounds, and who is blamed for a slowdown. No test here asserts a speed."""

from __future__ import annotations

import pytest
import torch

from dlmrt.bench import canary, paired


def test_the_inputs_are_fixed_by_the_seed(monkeypatch):
    first, second = canary.inputs(), canary.inputs()
    assert all(torch.equal(first[name], second[name]) for name in first)
    m, k, n = canary.GEMM
    assert first["a"].shape == (m, k) and first["b"].shape == (k, n)
    assert all(first[name].shape == canary.ATTENTION for name in ("q", "k", "v"))
    assert all(tensor.dtype == torch.float32 for tensor in first.values())
    monkeypatch.setattr(canary, "SEED", canary.SEED + 1)
    assert not torch.equal(canary.inputs()["a"], first["a"])


def test_a_run_is_its_gemms_and_attention_calls(monkeypatch):
    calls = []
    case = canary.canary_case()
    monkeypatch.setattr(canary.torch, "mm", lambda a, b: calls.append(("mm", a.shape, b.shape)))
    monkeypatch.setattr(canary.F, "scaled_dot_product_attention", lambda q, k, v: calls.append(("sdpa", q.shape)))
    case.run()
    m, k, n = canary.GEMM
    assert calls.count(("mm", (m, k), (k, n))) == canary.REPEATS
    assert calls.count(("sdpa", canary.ATTENTION)) == canary.REPEATS
    assert len(calls) == 2 * canary.REPEATS


def test_the_canary_is_a_case_of_the_interleaved_rounds():
    found = paired.interleaved_rounds([canary.canary_case()], rounds=2, warmups=0)
    assert list(found.seconds) == [canary.LABEL]
    assert len(found.seconds[canary.LABEL]) == 2
    assert all(seconds > 0 for seconds in found.seconds[canary.LABEL])


@pytest.mark.parametrize("case_slowed, canary_slowed, blamed", [
    (True, False, "project"), (True, True, "machine"), (False, True, "machine"), (False, False, None)])
def test_blame(case_slowed, canary_slowed, blamed):
    assert canary.blame(case_slowed, canary_slowed) == blamed
