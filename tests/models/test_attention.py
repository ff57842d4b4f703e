"""Attention compiled for a CPU runs as two batched matmuls around one softmax (`attend_by_matmul`) up to
CPU_MATMUL_ATTENTION_MAX_SCORES scores, SDPA elsewhere; both against a plain softmax(q k^T / sqrt(D)) v."""

from __future__ import annotations

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from dlmrt.models import layers


def plain_attention(q, k, v, mask):
    """Query by query: the softmax over the keys it may see, zeros where it may see none."""
    batch, heads, length, head_dim = q.shape
    out = torch.zeros_like(q)
    for b in range(batch):
        for h in range(heads):
            for t in range(length):
                allowed = mask[b, 0, t if mask.shape[2] > 1 else 0]
                if not allowed.any():
                    continue
                scores = (k[b, h] @ q[b, h, t]) / math.sqrt(head_dim)
                weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
                out[b, h, t] = weights @ v[b, h]
    return out


def inputs(mask_rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g) for n in (5, 7, 7))
    mask = torch.rand(2, 1, mask_rows, 7, generator=g) > 0.3
    mask[1, 0, 0, :] = False  # a query (or, broadcast, the whole row) that may attend to no key
    return q, k, v, mask


@pytest.mark.parametrize("mask_rows", [1, 5], ids=["keys-only mask", "per-query mask"])
def test_attend_by_matmul_is_plain_attention_with_zeros_for_a_query_that_sees_no_key(mask_rows):
    q, k, v, mask = inputs(mask_rows)
    found = layers.attend_by_matmul(q, k, v, mask)
    torch.testing.assert_close(found, plain_attention(q, k, v, mask), rtol=1e-5, atol=1e-6)
    assert not found.isnan().any()


def ops_of_compiled_attend(q, k, v, mask) -> tuple[torch.Tensor, set[str]]:
    compiled = torch.compile(layers.attend, backend="eager", fullgraph=True)  # traced, is_compiling() true
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = compiled(q, k, v, mask)
    torch._dynamo.reset()
    return out, {event.key for event in prof.key_averages()}


def test_compiled_attention_on_a_cpu_takes_the_matmuls_up_to_the_limit_and_sdpa_beyond(monkeypatch):
    q, k, v, mask = inputs(5, seed=1)
    expected = plain_attention(q, k, v, mask).transpose(1, 2).reshape(2, 5, 24)
    out, ops = ops_of_compiled_attend(q, k, v, mask)
    assert "aten::baddbmm" in ops and not any("scaled_dot_product" in op for op in ops)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)

    monkeypatch.setattr(layers, "CPU_MATMUL_ATTENTION_MAX_SCORES", 2 * 3 * 5 * 7 - 1)
    out, ops = ops_of_compiled_attend(q, k, v, mask)
    assert "aten::baddbmm" not in ops and any("scaled_dot_product" in op for op in ops)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_eager_attention_is_sdpa():
    q, k, v, mask = inputs(1, seed=2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        layers.attend(q, k, v, mask)
    ops = {event.key for event in prof.key_averages()}
    assert "aten::baddbmm" not in ops and any("scaled_dot_product" in op for op in ops)
