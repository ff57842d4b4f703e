"""The vocabulary-split Triton form of `dlmrt::ParallelUnmask` (`split_kernels`) against the torch reference
on the upcast logits, in Triton's interpreter (this file run as a script, as in
test_parallel_unmask_triton.py): float32 and bfloat16 logits, a vocabulary over several splits and not a
multiple of the tile, ties across splits, sampling; and its PTX for sm_90/100/120."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from dlmrt.ops.parallel_unmask import EditParams, UnmaskParams, parallel_unmask
from helpers import interpret_cases, run_in_interpreter
from parallel_unmask_reference import make_params

pytest.importorskip("triton", reason="the Triton kernels need the dlmrt[triton] extra")

KERNELS = "dlmrt.ops.parallel_unmask.split_kernels"
B, W, V = 2, 5, 300  # tiles of 16, splits of 64: 5 splits, the last one partial
BLOCK_V, SPLIT_V = 16, 64


def case(seed: int, dtype: torch.dtype, temperature: list[float], codes: list[int]) -> dict:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, W, V, generator=g) * 3
    top = logits[0, 1].max() + 1
    logits[0, 1, 20] = logits[0, 1, 200] = top  # a tie across splits 0 and 3: the first index wins
    logits[1, 2, V - 1] = logits[1, 2].max() + 5  # the mask token is the most likely
    masked = torch.rand(B, W, generator=g) < 0.7
    ids = torch.where(masked, V - 1, torch.randint(0, V - 1, (B, W), generator=g))
    params = make_params(B, count=[1, 2], threshold=[0.3, 0.05], factor=[0.0, 1.0], temperature=temperature,
                         seed=[seed, seed + 1], step=[1, 2])
    return dict(logits=logits.to(dtype), ids=ids, positions=(torch.arange(W) + 11).expand(B, W).clone(),
                params=tuple(params), codes=torch.tensor(codes),
                edits=(torch.tensor([0.01, float("inf")]), torch.rand(B, W, generator=g) < 0.6))


CASES = {f"{dtype}-{'sampled' if t[0] else 'greedy'}-{codes}": case(i, dtype, t, codes)
         for i, (dtype, t, codes) in enumerate((dtype, t, codes) for dtype in (torch.float32, torch.bfloat16)
                                                for t in ([0.0, 0.0], [0.8, 1.3]) for codes in ([0, 1], [2, 3]))}


def run_case(kernels, case: dict):
    return kernels.parallel_unmask(case["logits"], case["ids"], case["positions"], UnmaskParams(*case["params"]),
                                   V - 1, case["codes"], edits=EditParams(*case["edits"]), block_v=BLOCK_V,
                                   split_v=SPLIT_V)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    return run_in_interpreter(__file__, CASES, tmp_path_factory.mktemp("interpreter"))


def test_the_vocabulary_spans_several_splits():
    from dlmrt.ops.parallel_unmask import split_kernels
    assert split_kernels.splits_for(V, BLOCK_V, SPLIT_V) == (5, 64)
    assert split_kernels.splits_for(126464, 1024) == (16, 8192)


@pytest.mark.parametrize("name", list(CASES))
def test_split_kernels_match_the_reference(interpreted, name):
    c = CASES[name]
    expected = parallel_unmask(c["logits"].float(), c["ids"], c["positions"], UnmaskParams(*c["params"]),
                               mask_id=V - 1, confidence=c["codes"], edits=EditParams(*c["edits"]))
    got = interpreted[name]
    assert torch.equal(got.ids, expected.ids) and torch.equal(got.commit, expected.commit)
    assert torch.equal(got.committed, expected.committed)
    assert torch.equal(torch.isinf(got.confidence), torch.isinf(expected.confidence))
    finite = torch.isfinite(expected.confidence)
    torch.testing.assert_close(got.confidence[finite], expected.confidence[finite], atol=1e-6, rtol=0)
    if "greedy" in name and c["ids"][0, 1] == V - 1:
        assert got.ids[0, 1] == 20  # the tie across splits went to the first index


@pytest.mark.parametrize("cc", [90, 100, 120])
@pytest.mark.parametrize("kernel", ["split_kernel", "merge_kernel"])
def test_split_kernels_compile_for_each_target_from_bf16(kernel, cc):
    from dlmrt.ops.parallel_unmask import aot
    compiled = aot.compile_kernel(kernel, cc, {"logits": "*bf16"})
    assert re.search(rf"^\.target sm_{cc}a?\b", compiled.ptx, flags=re.M)
    assert f".entry {kernel}(" in compiled.ptx


if __name__ == "__main__":
    interpret_cases(KERNELS, run_case, *sys.argv[1:])
