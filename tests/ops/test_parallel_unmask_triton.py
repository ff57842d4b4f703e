"""The Triton kernels of `dlmrt::ParallelUnmask` against the torch reference, their AOT compilation for
sm_90/100/120, and the TensorRT plugin registration.

The module-scoped fixture `interpreted` runs every kernel case once in Triton's interpreter, in a
fresh process (this file run as a script, see helpers.run_in_interpreter), and the tests compare
what it returns with the reference here. Everything else (AOT, errors, GPU) runs in the test
process with the compiled kernels.
"""

from __future__ import annotations

import math
import os
import re
import sys

import pytest
import torch

from dlmrt.core.errors import KernelInputError, MissingExtraError
from dlmrt.ops.parallel_unmask import MEASURE_CODES, EditParams, UnmaskParams, parallel_unmask
from helpers import check_plugin_registration, cuda_kernels, fresh_module, interpret_cases, run_in_interpreter
from parallel_unmask_reference import exact_row, logits_of, make_params, probs_row

pytest.importorskip("triton", reason="the Triton kernels need the dlmrt[triton] extra")

KERNELS = "dlmrt.ops.parallel_unmask.triton_kernels"
INF = math.inf


# -- cases: every kernel run is one of these ---------------------------------------------------

def unmask_case(logits, ids, params: UnmaskParams, codes, *, mask_id=None, positions=None, block_v=16,
                block_w=16) -> dict:
    batch, width, vocab = logits.shape
    if positions is None:
        positions = (torch.arange(width) + 7).expand(batch, width).clone()
    codes = torch.tensor(codes if isinstance(codes, list) else [codes] * batch, dtype=torch.long)
    return dict(kind="unmask", logits=logits, ids=ids, positions=positions, params=tuple(params), codes=codes,
                mask_id=vocab - 1 if mask_id is None else mask_id, block_v=block_v, block_w=block_w)


def random_unmask(seed: int, batch: int, width: int, vocab: int, *, codes, temperature, threshold, factor,
                  count, block_v=16, block_w=16, masked_share=0.7) -> dict:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, width, vocab, generator=g) * 2.5
    masked = torch.rand(batch, width, generator=g) < masked_share
    ids = torch.where(masked, vocab - 1, torch.randint(0, vocab - 1, (batch, width), generator=g))
    params = make_params(batch, count=count, threshold=threshold, factor=factor, temperature=temperature,
                         seed=[seed + b for b in range(batch)], step=[3 * b for b in range(batch)])
    return unmask_case(logits, ids, params, codes, block_v=block_v, block_w=block_w)


def masked_ids(masked: list[list[bool]], vocab: int) -> torch.Tensor:
    return torch.tensor([[vocab - 1 if m else 50 + w for w, m in enumerate(row)] for row in masked])


def crafted_cases() -> dict[str, dict]:
    cases = {}
    # exact float32 confidences: 1/4, 1/2, 1/8, 1/2, 1/2 and an unmasked position
    ties = logits_of([[exact_row(4, 1), exact_row(2, 0), exact_row(8, 0), exact_row(2, 3), exact_row(2, 5),
                       exact_row(1, 6)]] * 3)
    cases["ties"] = unmask_case(ties, masked_ids([[True] * 5 + [False]] * 3, 8),
                                make_params(3, count=[0, 2, 1], threshold=[0.5, INF, 0.25]), 0)
    g = torch.Generator().manual_seed(5)
    every = torch.randn(2, 6, 8, generator=g)
    cases["all_and_none_masked"] = unmask_case(every, masked_ids([[True] * 6, [False] * 6], 8),
                                               make_params(2, count=[6, 6], threshold=[0.0, 0.0]), [0, 0])
    # the mask token (the last) is the most likely token, and in the margin's top two it is skipped
    mask_top = torch.tensor([[probs_row([0.2, 0.1, 0.05, 0.65]), probs_row([0.05, 0.3, 0.1, 0.55])]] * 2)
    cases["mask_token_is_argmax"] = unmask_case(mask_top, masked_ids([[True, True]] * 2, 4),
                                                make_params(2, count=[1, 2]), [0, 1])
    # ties across tiles: the same maximum in the first and third tile of 16
    spread = torch.zeros(1, 3, 40)
    spread[0, :, 5] = spread[0, :, 35] = 3.0
    spread[0, 1, 35] = 3.5  # the maximum in the last, partial tile
    cases["argmax_across_tiles"] = unmask_case(spread, masked_ids([[True] * 3], 40), make_params(1, count=3), 1)
    # a threshold of exactly one position's confidence (filled in by `threshold_at_a_confidence`)
    cases["threshold_at_a_confidence"] = threshold_at_a_confidence()
    # Fast-dLLM's factor on exact confidences: (n + 1) * (1 - c_n) for c = 1, 1/2, 1/2, 1/4 is 0, 1.5, 2, 3.75
    exact = logits_of([[exact_row(1, 0), exact_row(2, 1), exact_row(2, 2), exact_row(4, 3)]] * 3)
    cases["factor_boundary"] = unmask_case(exact, masked_ids([[True] * 4] * 3, 8),
                                           make_params(3, factor=[1.5, 2.0, 2.0001]), 0)
    # the hash on values beyond 32 bits and negative ones, for the random confidence and sampling
    flat = torch.zeros(3, 64, 8)
    far = torch.tensor([[2**33 + w for w in range(64)], [-w for w in range(64)], [w * 977 for w in range(64)]])
    cases["hash_extremes"] = unmask_case(flat, masked_ids([[True] * 64] * 3, 8),
                                         make_params(3, count=[5, 9, 64], temperature=[1.0, 0.5, 2.0],
                                                     seed=[-1, 2**40 + 3, 7], step=[2**33, -7, 0]),
                                         [3, 3, 0], positions=far)
    return cases


def threshold_at_a_confidence() -> dict:
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(1, 6, 9, generator=g) * 2
    ids = masked_ids([[True] * 6], 9)
    params = make_params(1, count=1)
    conf = parallel_unmask(logits, ids, (torch.arange(6) + 7)[None], params, mask_id=8).confidence
    return unmask_case(logits, ids, params._replace(threshold=conf[0, 2:3].clone()), 0)


def random_cases() -> dict[str, dict]:
    four = dict(temperature=[0.0, 1.0, 0.0, 0.5], threshold=[0.3, INF, 0.05, 0.5], factor=[0.0, 1.0, 2.0, 0.0],
                count=[1, 2, 0, 3])
    cases = {"mixed_measures": random_unmask(1, 4, 9, 37, codes=[0, 1, 2, 3], **four)}
    for measure, code in MEASURE_CODES.items():
        cases[f"every_row_{measure}"] = random_unmask(10 + code, 4, 9, 37, codes=code, **four)
    cases["wide_row_chunks"] = random_unmask(2, 3, 20, 50, codes=[2, 0, 1], temperature=[0.7, 0.0, 0.0],
                                             threshold=[0.2, 0.6, INF], factor=[0.0, 0.0, 3.0], count=[0, 1, 4],
                                             block_v=32)
    cases["smallest_vocabulary"] = random_unmask(3, 2, 5, 2, codes=[0, 1], temperature=[0.0, 1.0],
                                                 threshold=[0.9, 0.5], factor=[0.0, 0.0], count=[1, 0])
    cases["one_position"] = random_unmask(4, 1, 1, 17, codes=0, temperature=0.0, threshold=INF, factor=0.0,
                                          count=1, masked_share=1.0)
    cases["editing"] = with_edits(random_unmask(6, 4, 9, 37, codes=[0, 1, 2, 3], masked_share=0.4, **four),
                                  threshold=[0.2, 0.0, INF, 0.5], seed=6)
    cases["vocabulary_in_one_tile"] = random_unmask(5, 2, 6, 100, codes=[2, 3], temperature=[2.0, 0.0],
                                                    threshold=[0.1, 0.5], factor=[0.0, 1.0], count=[2, 0],
                                                    block_v=128, block_w=64)
    return cases


def with_edits(case: dict, threshold: list[float], seed: int) -> dict:
    """`case` with token editing: each row's threshold, and a random share of editable positions."""
    g = torch.Generator().manual_seed(seed)
    editable = torch.rand(case["ids"].shape, generator=g) < 0.8
    return dict(case, edits=(torch.tensor(threshold, dtype=torch.float32), editable))


def editing_at_a_probability() -> dict:
    """Editing thresholds of exactly one position's p(x0): that position is edited (>=), with
    the threshold one float32 step above it is not."""
    g = torch.Generator().manual_seed(12)
    logits = (torch.randn(1, 6, 9, generator=g) * 2).expand(2, 6, 9).clone()  # two equal rows
    ids = torch.randint(0, 8, (1, 6), generator=g).expand(2, 6).clone()
    ids[:, 0] = 8
    x0 = logits[..., :8].argmax(-1)  # the mask token (8) is never a candidate
    ids[:, 3] = (x0[:, 3] + 1) % 8
    at = torch.softmax(logits, -1).gather(-1, x0[..., None])[0, 3].reshape(1)
    threshold = torch.cat((at, torch.nextafter(at, torch.tensor(INF))))
    editable = torch.ones(2, 6, dtype=torch.bool)
    return dict(unmask_case(logits, ids, make_params(2, count=1), 0), edits=(threshold, editable))


UNMASK_CASES = {**random_cases(), **crafted_cases(), "editing_at_a_probability": editing_at_a_probability()}


def edits_of(case: dict) -> EditParams | None:
    return EditParams(*case["edits"]) if "edits" in case else None


def run_case(kernels, case: dict) -> dict:
    """The kernels' outputs for a case: the two-kernel form and the fused (TensorRT) one."""
    args = (case["logits"], case["ids"], case["positions"], UnmaskParams(*case["params"]), case["mask_id"],
            case["codes"])
    return {f"fused={fused}": kernels.parallel_unmask(*args, edits=edits_of(case), fused=fused,
                                                      block_v=case["block_v"], block_w=case["block_w"])
            for fused in (False, True)}


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    """Every case's kernel outputs from a TRITON_INTERPRET=1 process (see the module docstring)."""
    return run_in_interpreter(__file__, UNMASK_CASES, tmp_path_factory.mktemp("interpreter"))


def reference(case: dict):
    return parallel_unmask(case["logits"], case["ids"], case["positions"], UnmaskParams(*case["params"]),
                           mask_id=case["mask_id"], confidence=case["codes"], edits=edits_of(case))


def assert_matches_reference(result, expected):
    assert torch.equal(result.ids, expected.ids), (result.ids, expected.ids)
    assert torch.equal(result.commit, expected.commit), (result.commit, expected.commit)
    assert torch.equal(result.committed, expected.committed), (result.committed, expected.committed)
    assert result.confidence.dtype == torch.float32
    assert torch.equal(torch.isinf(result.confidence), torch.isinf(expected.confidence))
    finite = torch.isfinite(expected.confidence)
    torch.testing.assert_close(result.confidence[finite], expected.confidence[finite], atol=1e-6, rtol=0)


# -- (a) the op in the interpreter against the reference ----------------------------------------

@pytest.mark.parametrize("name", list(UNMASK_CASES))
@pytest.mark.parametrize("form", ["fused=False", "fused=True"])
def test_unmask_matches_the_reference(interpreted, name, form):
    assert_matches_reference(interpreted[name][form], reference(UNMASK_CASES[name]))


def test_crafted_cases_commit_what_the_rules_say(interpreted):
    for form in ("fused=False", "fused=True"):
        ties = interpreted["ties"][form]
        # tau = 0.5 takes the three exact halves; count 2 the first two of them; tau = 1/4 adds position 0
        assert ties.commit[:, :5].tolist() == [[False, True, False, True, True], [False, True, False, True, False],
                                               [True, True, False, True, True]]
        assert ties.ids[0].tolist() == [7, 0, 7, 3, 5, 55]
        every = interpreted["all_and_none_masked"][form]
        assert every.committed.tolist() == [6, 0] and not every.commit[1].any()
        assert bool(torch.isinf(every.confidence[1]).all())
        mask_top = interpreted["mask_token_is_argmax"][form]
        assert mask_top.ids.tolist() == [[3, 1], [0, 1]]
        assert mask_top.confidence[1].tolist() == pytest.approx([0.1, 0.2], abs=1e-6)  # margins without the mask
        assert interpreted["argmax_across_tiles"][form].ids[0].tolist() == [5, 35, 5]
        at = interpreted["threshold_at_a_confidence"][form]
        assert bool(at.commit[0, 2]) and int(at.committed[0]) >= 1
        factor = interpreted["factor_boundary"][form]
        assert factor.committed.tolist() == [1, 2, 3]  # the rule is strict: 1.5 < 1.5 fails
        case = UNMASK_CASES["editing_at_a_probability"]
        edited = interpreted["editing_at_a_probability"][form].ids != case["ids"]
        assert bool(edited[0, 3]) and not edited[1, 3]


def test_random_numbers_are_bit_exact(interpreted):
    expected = reference(UNMASK_CASES["hash_extremes"])
    result = interpreted["hash_extremes"]["fused=False"]
    assert torch.equal(result.confidence[:2], expected.confidence[:2])  # the "random" rows, to the bit
    all_committed = result.commit[2]
    assert bool(all_committed.all())
    assert torch.equal(result.ids[2], expected.ids[2])  # 64 Gumbel-max samples at temperature 2


# -- bad input and a missing extra ---------------------------------------------------------------

@pytest.fixture(scope="module")
def kernels():
    from dlmrt.ops.parallel_unmask import triton_kernels
    return triton_kernels


def good_inputs(batch=2, width=3, vocab=5):
    case = random_unmask(0, batch, width, vocab, codes=0, temperature=0.0, threshold=INF, factor=0.0, count=1)
    return dict(logits=case["logits"], ids=case["ids"], positions=case["positions"],
                params=UnmaskParams(*case["params"]), mask_id=vocab - 1, measure_codes=case["codes"])


@pytest.mark.parametrize("change, message", [
    (dict(logits=torch.zeros(2, 3, 5, dtype=torch.float64)), "logits must be torch.float32"),
    (dict(logits=torch.zeros(2, 3)), r"\[B, W, V\]"),
    (dict(logits=torch.zeros(2, 3, 1)), "V >= 2"),
    (dict(ids=torch.zeros(2, 3, dtype=torch.int32)), "ids must be torch.int64"),
    (dict(positions=torch.zeros(2, 4, dtype=torch.long)), r"positions must have shape \[2, 3\]"),
    (dict(mask_id=5), "outside the vocabulary"),
    (dict(measure_codes=torch.zeros(3, dtype=torch.long)), r"measure_codes must have shape \[2\]"),
])
def test_bad_input_is_refused_before_any_launch(kernels, change, message):
    inputs = dict(good_inputs(), **change)
    with pytest.raises(KernelInputError, match=message):
        kernels.parallel_unmask(**inputs)


def test_bad_params_are_refused(kernels):
    inputs = good_inputs()
    inputs["params"] = inputs["params"]._replace(threshold=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(KernelInputError, match="threshold must be torch.float32"):
        kernels.parallel_unmask(**inputs)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the test process itself interprets")
def test_cpu_tensors_need_the_interpreter(kernels):
    with pytest.raises(KernelInputError, match="TRITON_INTERPRET=1"):
        kernels.parallel_unmask(**good_inputs())


def test_missing_triton_says_which_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)
    with pytest.raises(MissingExtraError, match=re.escape("pip install 'dlmrt[triton]'")):
        fresh_module(KERNELS)


# -- (c) ahead-of-time compilation ---------------------------------------------------------------

@pytest.mark.parametrize("cc", [90, 100, 120])
def test_aot_ptx_for_each_target(cc):
    from dlmrt.ops.parallel_unmask import aot, triton_kernels
    compiled = aot.compile_kernel("parallel_unmask_kernel", cc)
    assert re.search(rf"^\.target sm_{cc}a?\b", compiled.ptx, flags=re.M), compiled.ptx[:400]
    entry = re.search(r"\.entry (\w+)\((.*?)\)", compiled.ptx, flags=re.S)
    assert entry.group(1) == compiled.name == "parallel_unmask_kernel"
    # the arguments TensorRT passes: 12 inputs, W, V, mask_id, 4 outputs; Triton's scratch pointers dropped
    assert entry.group(2).count(".param") == len(aot.SIGNATURES["parallel_unmask_kernel"]) == 19
    assert compiled.threads == triton_kernels.CONFIGS["parallel_unmask_kernel"].num_warps * 32
    assert compiled.shared_mem >= 0 and compiled.cc == cc


def test_aot_from_an_interpreting_process_compiles_in_a_subprocess(monkeypatch):
    from dlmrt.ops.parallel_unmask import aot
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(aot.triton_kernels, "interpreted", lambda: True)
    compiled = aot.compile_kernel("commit_kernel", 90)
    assert ".entry commit_kernel(" in compiled.ptx and re.search(r"^\.target sm_90a?\b", compiled.ptx, flags=re.M)


def test_dropping_a_used_parameter_is_refused():
    from dlmrt.ops.parallel_unmask import aot
    ptx = ".entry k(\n\t.param .u64 k_param_0,\n\t.param .u64 k_param_1\n)\n{\n\tld.param.u64 %rd1, [k_param_1];\n}"
    with pytest.raises(KernelInputError, match="k_param_1 is used"):
        aot._drop_params(ptx, "k", keep=1)
    assert "k_param_1" not in aot._drop_params(ptx.replace("[k_param_1]", "[k_param_0]"), "k", keep=1)


# -- (d) TensorRT and the GPU --------------------------------------------------------------------

def test_plugin_registration_without_tensorrt_says_which_extra(monkeypatch):
    trt_plugin = fresh_module("dlmrt.ops.parallel_unmask.trt_plugin")
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(MissingExtraError, match=re.escape("pip install 'dlmrt[tensorrt]'")):
        trt_plugin.register()


@pytest.mark.trt
def test_plugin_is_registered_under_the_onnx_namespace_and_version():
    check_plugin_registration("parallel_unmask")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mixed_measures", "wide_row_chunks", "ties", "hash_extremes"])
def test_compiled_kernels_on_cuda_match_the_reference(name):
    kernels = cuda_kernels(KERNELS)
    case = UNMASK_CASES[name]
    on_gpu = {key: (tuple(t.cuda() for t in value) if key == "params" else
                    value.cuda() if isinstance(value, torch.Tensor) else value) for key, value in case.items()}
    expected = reference(case)
    for result in run_case(kernels, on_gpu).values():
        assert_matches_reference(type(expected)(*(t.cpu() for t in result)), expected)


if __name__ == "__main__":
    interpret_cases(KERNELS, run_case, *sys.argv[1:])
