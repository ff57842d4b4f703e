"""`parallel_unmask.chunked`: the reference's step on bf16/fp16 logits, upcast a slice of positions at a
time, gives the reference's result on the whole block upcast, bit for bit, without a float32 (or
float64) tensor the size of the block."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dlmrt.ops.parallel_unmask import EditParams, chunked, parallel_unmask
from parallel_unmask_reference import make_params

B, W, V = 3, 7, 300  # W is not a multiple of the slices below


class LargestFloat(TorchDispatchMode):
    """The most elements of any float32 or float64 tensor an op returns while entered."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.float64):
                self.largest = max(self.largest, t.numel())
        return out


def block(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, W, V, generator=g) * 3).to(dtype)
    logits[0, 2, 10] = logits[0, 2, 20] = logits[0, 2].max() + 1  # a tie: the first index wins
    masked = torch.rand(B, W, generator=g) < 0.7
    ids = torch.where(masked, V - 1, torch.randint(0, V - 1, (B, W), generator=g))
    positions = (torch.arange(W) + 11).expand(B, W).clone()
    return logits, ids, positions


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [[0.0, 0.0, 0.0], [0.8, 0.0, 1.5]])
@pytest.mark.parametrize("measure", ["prob", "margin", "entropy", "per row"])
def test_slices_give_the_whole_blocks_result_exactly(dtype, temperature, measure):
    logits, ids, positions = block(dtype)
    params = make_params(B, count=[1, 2, 0], threshold=[0.3, 0.9, 0.05], factor=[0.0, 1.0, 0.0],
                         temperature=temperature, seed=[4, 5, 6], step=[1, 2, 3])
    edits = EditParams(torch.tensor([0.2, float("inf"), 0.1]), torch.rand(B, W, generator=torch.Generator()
                                                                         .manual_seed(1)) < 0.5)
    confidence = torch.tensor([0, 1, 2]) if measure == "per row" else measure
    expected = parallel_unmask(logits.float(), ids, positions, params, mask_id=V - 1, confidence=confidence,
                               edits=edits)
    for elements in (1, 2 * B * V, 3 * B * V, 10**9):  # one position a slice, 2, 3 (7 = 3 + 3 + 1), all
        got = chunked.parallel_unmask(logits, ids, positions, params, mask_id=V - 1, confidence=confidence,
                                      edits=edits, elements=elements)
        for name, want, have in zip(expected._fields, expected, got):
            assert torch.equal(want, have), (name, elements)


def test_no_float_tensor_the_size_of_the_block():
    logits, ids, positions = block(torch.bfloat16)
    params = make_params(B, count=1, temperature=[0.8, 0.0, 0.0], seed=[1, 2, 3])
    with LargestFloat() as whole:
        parallel_unmask(logits.float(), ids, positions, params, mask_id=V - 1, confidence=torch.tensor([0, 1, 2]))
    with LargestFloat() as sliced:
        chunked.parallel_unmask(logits, ids, positions, params, mask_id=V - 1, confidence=torch.tensor([0, 1, 2]),
                                elements=2 * B * V)
    assert whole.largest >= B * W * V  # the measure can see the whole block's copy
    assert sliced.largest <= 2 * B * V


def test_a_slice_holds_one_position_of_every_row_at_least():
    assert chunked.positions_per_slice(64, 126464) == 1
    assert chunked.positions_per_slice(1, 126464) == 8  # 4 slices of a block of 32


def test_a_bf16_models_step_loop_unmasks_by_slices_with_the_same_tokens(monkeypatch):
    from dlmrt.runtime import GenerationSettings, Generator, Threshold
    from dlmrt.runtime.torch_backend import TorchBackend
    from helpers import LLADA, random_model

    model = random_model(LLADA).to(torch.bfloat16)
    prompts = [[5, 6, 7, 8], [9, 10]]
    settings = GenerationSettings(16, 8, Threshold(0.5), temperature=0.7, seed=3, ignore_eos=True)
    calls = []
    sliced_unmask = chunked.parallel_unmask
    monkeypatch.setattr(chunked, "parallel_unmask", lambda *a, **k: calls.append(1) or sliced_unmask(*a, **k))
    monkeypatch.setattr(chunked, "SLICE_ELEMENTS", 1)
    one_position = Generator(TorchBackend(model, mode="eager")).generate(prompts, settings).tokens.tolist()
    assert calls  # the step graph took the sliced path
    assert chunked.positions_per_slice(2, LLADA["vocab_size"]) == 1
    monkeypatch.setattr(chunked, "SLICE_ELEMENTS", 10**9)  # the whole block in one slice: today's upcast
    assert Generator(TorchBackend(model, mode="eager")).generate(prompts, settings).tokens.tolist() == one_position
