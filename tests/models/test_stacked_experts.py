"""LLaDA2's routed experts stacked per projection (`dlmrt.models.experts`): checkpoints keep their
per-expert names both ways; the grouped forward (sorted by expert, `torch._grouped_mm`, which torch runs on
the CPU too) sums what the per-expert loop sums; the CPU's oneDNN packing reaches each stacked expert."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

import dlmrt
from dlmrt.models import checkpoint
from dlmrt.models import llada2_moe
from dlmrt.models.experts import PROJECTIONS, grouped_routed, grouped_runs
from dlmrt.runtime import onednn
from helpers import LLADA2, random_model

# Written by tests/data/make_llada21.py before the experts were stacked: one tensor per expert and projection.
OLD_CHECKPOINT = Path(__file__).parent.parent / "data" / "llada21"


def _moe_layers(model) -> list[llada2_moe.MoE]:
    return [m for m in model.modules() if isinstance(m, llada2_moe.MoE)]


def test_a_checkpoint_saved_per_expert_loads_into_the_stacks_and_saves_back_under_its_names(tmp_path):
    model = dlmrt.load(OLD_CHECKPOINT)
    with safe_open(str(OLD_CHECKPOINT / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        moe = _moe_layers(model)[0]
        index = next(i for i, layer in enumerate(model.model.layers) if layer.mlp is moe)
        for expert in range(moe.experts.num_experts):
            for name in PROJECTIONS:
                stored = f.get_tensor(f"model.layers.{index}.mlp.experts.{expert}.{name}.weight")
                assert torch.equal(getattr(moe.experts, name).weight[expert], stored)
    assert moe.experts.gate_proj.weight.dim() == 3
    assert set(model.state_dict()) == names
    saved = checkpoint.save(model, tmp_path / "again")
    with safe_open(str(OLD_CHECKPOINT / "model.safetensors"), "pt") as old, \
            safe_open(str(saved / "model.safetensors"), "pt") as new:
        assert set(new.keys()) == names
        assert all(torch.equal(old.get_tensor(name), new.get_tensor(name)) for name in names)


def _loop_and_grouped(model, partial: slice | None = None):
    """A MoE layer's routed sum by the per-expert loop and by the grouped forward, on random tokens."""
    moe = _moe_layers(model)[0]
    flat = torch.randn(37, model.config.hidden_size, generator=torch.Generator().manual_seed(5),
                       dtype=next(model.parameters()).dtype)
    experts, weights = moe.gate(flat)
    loop = moe.routed(flat, experts, weights)
    grouped = grouped_routed(moe.experts, flat, experts, weights, partial=False)
    return loop, grouped, experts


def test_the_grouped_forward_sums_what_the_loop_sums():
    model = random_model(LLADA2)
    with torch.no_grad():
        loop, grouped, experts = _loop_and_grouped(model)
    assert experts.unique().numel() > 2  # several experts, each with its own rows
    assert not grouped_runs(torch.empty(1))  # the CPU keeps the loop
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-6)


def test_a_slice_of_the_experts_adds_only_its_own():
    """An expert-parallel rank's rows: the pairs routed elsewhere contribute nothing, even where the
    grouped GEMM leaves their rows unwritten."""
    from dlmrt.parallel.experts import ExpertParallelMoE

    model = random_model(LLADA2)
    moe = _moe_layers(model)[0]
    count = moe.experts.num_experts
    flat = torch.randn(29, model.config.hidden_size, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        experts, weights = moe.gate(flat)
        halves = [ExpertParallelMoE(moe, ranks=None, part=part)
                  for part in (slice(0, count // 2), slice(count // 2, count))]
        parts = [grouped_routed(half.experts, flat, experts, weights, partial=True) for half in halves]
        loops = [half.routed(flat, experts, weights) for half in halves]
        whole = moe.routed(flat, experts, weights)
    for part, loop in zip(parts, loops):
        torch.testing.assert_close(part, loop, rtol=1e-5, atol=1e-6)
        assert part.abs().sum() > 0
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-6)


def test_the_grouped_forward_runs_on_meta_tensors():
    model = random_model(LLADA2).to(device="meta", dtype=torch.bfloat16)  # the grouped kernel's dtype
    moe = _moe_layers(model)[0]
    flat = torch.empty(11, model.config.hidden_size, device="meta", dtype=torch.bfloat16)
    experts, weights = moe.gate(flat)
    assert grouped_runs(flat)
    assert moe.routed(flat, experts, weights).shape == flat.shape


def test_onednn_packs_each_stacked_expert_and_computes_as_before():
    model = random_model(LLADA2)
    packed = onednn.PackedModel(model)
    twins = [m for m in packed.model.modules() if isinstance(m, onednn.PackedExperts)]
    ids = torch.randint(3, model.vocab_size - 2, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(packed.model.denoise(ids).logits, model.denoise(ids).logits, rtol=1e-4, atol=1e-5)
    # LLADA2's experts are too small to be worth packing; with the threshold lowered, every stack is packed
    assert not twins
    original = onednn.MIN_PACKED_WEIGHTS
    onednn.MIN_PACKED_WEIGHTS = 1
    try:
        packed = onednn.PackedModel(model)
    finally:
        onednn.MIN_PACKED_WEIGHTS = original
    twins = [m for m in packed.model.modules() if isinstance(m, onednn.PackedExperts)]
    assert len(twins) == 3 * len(_moe_layers(model))
    with torch.no_grad():
        before = packed.model.denoise(ids).logits
        torch.testing.assert_close(before, model.denoise(ids).logits, rtol=1e-4, atol=1e-5)
        model.model.layers[1].mlp.experts.up_proj.weight.mul_(1.5)  # written in place: re-packed on refresh
        packed.refresh()
        torch.testing.assert_close(packed.model.denoise(ids).logits, model.denoise(ids).logits, rtol=1e-4, atol=1e-5)
        assert not torch.equal(packed.model.denoise(ids).logits, before)
