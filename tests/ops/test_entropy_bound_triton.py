"""The Triton kernels of `dlmrt::EntropyBoundStep` against the torch reference, and their AOT compilation
for sm_90/100/120 without a GPU.

As in test_parallel_unmask_triton.py, the module-scoped fixture `interpreted` runs every kernel case
once in Triton's interpreter, in a fresh process (this file run as a script, see
helpers.run_in_interpreter), and the tests compare what comes back with the reference here: the
canvas, argmax, accepted positions and scaled logits to the bit, the entropies and their mean within
1e-5. Each case runs both forms (the two kernels, and the fused one a TensorRT plugin would launch).
"""

from __future__ import annotations

import math
import os
import re
import sys

import pytest
import torch

from dlmrt.core.errors import KernelInputError
from dlmrt.ops.entropy_bound import RenoiseParams, entropy, entropy_bound_step
from helpers import cuda_kernels, interpret_cases, run_in_interpreter

pytest.importorskip("triton", reason="the Triton kernels need the dlmrt[triton] extra")

KERNELS = "dlmrt.ops.entropy_bound.triton_kernels"
FORMS = ("fused=False", "fused=True")


# -- cases: every kernel run is one of these ---------------------------------------------------

def step_case(logits, bound, *, temperature=1.0, seed=None, step=None, positions=None, finished=None, canvas=None,
              block_v=16, block_w=None) -> dict:
    batch, width, vocab = logits.shape
    full = lambda value, dtype: (torch.tensor(value, dtype=dtype) if isinstance(value, list)  # noqa: E731
                                 else torch.full((batch,), value, dtype=dtype))
    params = RenoiseParams(full(temperature, torch.float32), full(bound, torch.float32),
                           full(seed if seed is not None else [11 * b + 1 for b in range(batch)], torch.long),
                           full(step if step is not None else [3 * b for b in range(batch)], torch.long))
    if positions is None:
        positions = (torch.arange(width) + 40).expand(batch, width).clone()
    if canvas is None:
        canvas = (torch.arange(batch * width).reshape(batch, width) * 7) % vocab
    finished = torch.zeros(batch, dtype=torch.bool) if finished is None else torch.tensor(finished)
    return dict(logits=logits, canvas=canvas, positions=positions, params=tuple(params), finished=finished,
                block_v=block_v, block_w=block_w)


def random_case(seed: int, batch: int, width: int, vocab: int, *, scale=3.0, block_v=16, block_w=None,
                finished_share=0.25) -> dict:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, width, vocab, generator=g) * scale
    temperature = (0.3 + 1.7 * torch.rand(batch, generator=g)).tolist()
    # bounds from none accepted but the first to all of them, by the entropies' own scale
    h = entropy(logits / torch.tensor(temperature)[:, None, None]).sum(-1)
    bound = (h * torch.rand(batch, generator=g) * 1.2).tolist()
    bound[0] = 0.0
    finished = (torch.rand(batch, generator=g) < finished_share).tolist()
    return step_case(logits, bound, temperature=temperature, finished=finished,
                     canvas=torch.randint(0, vocab, (batch, width), generator=g),
                     positions=torch.randint(0, 1000, (batch, width), generator=g), block_v=block_v, block_w=block_w)


def random_cases() -> dict[str, dict]:
    return {
        "small_vocabulary_in_tiles": random_case(1, 3, 9, 37),
        "canvas_of_32": random_case(2, 2, 32, 100, block_v=128),
        "width_not_a_power_of_two": random_case(3, 2, 13, 50, scale=1.0, block_v=64),
        "vocabulary_in_one_tile": random_case(4, 2, 6, 300, block_v=None),
        "smallest_vocabulary": random_case(5, 3, 5, 2),
        "one_token_vocabulary": random_case(6, 2, 4, 1),
        "one_position": random_case(7, 2, 1, 17),
        "peaked": random_case(8, 2, 12, 40, scale=12.0, block_v=64),
        "wide_tile": random_case(9, 2, 17, 23, block_v=32, block_w=64),
    }


def tied_rows() -> torch.Tensor:
    """[1, 8, 24]: positions 1, 3, 4 and 6 share one row of logits (equal entropies), 0 and 5 share a
    flatter one, 2 and 7 each a single possible token (entropy exactly 0, stored as -0.0)."""
    g = torch.Generator().manual_seed(21)
    sharp, flat = torch.randn(24, generator=g) * 3, torch.randn(24, generator=g) * 0.3
    one_token = torch.full((24,), -math.inf)
    one_token[5] = 1.0
    return torch.stack([flat, sharp, one_token, sharp, sharp, flat, sharp, one_token.roll(9)])[None]


def below(value: float) -> float:
    """The float32 just below float32 `value`."""
    return torch.nextafter(torch.tensor(value), torch.tensor(-math.inf)).item()


def crafted_cases() -> dict[str, dict]:
    tied = tied_rows()
    h = entropy(tied)[0].tolist()  # the reference's; the sums below are exact in float64 (equal values)
    sharp, flat = h[1], h[0]
    cases = {}
    # bounds around the sums of the tied group: 0 (the zero-entropy pair and one more), inside the group,
    # just below, at and above a sum of two and of four sharp entropies
    bounds = {"zero": 0.0, "inside": 1.5 * sharp, "below_two": below(2 * sharp), "at_two": 2 * sharp,
              "four": 4 * sharp + flat * 0.5}
    for name, bound in bounds.items():
        cases[f"ties_{name}"] = step_case(tied.expand(2, 8, 24).clone(), [bound, bound], finished=[False, True],
                                          block_v=32)
    # the same maximum in the first and third tile of 16, and a later maximum in the last, partial tile
    spread = torch.zeros(1, 3, 40)
    spread[0, :, 5] = spread[0, :, 35] = 3.0
    spread[0, 1, 37] = 3.5
    cases["argmax_across_tiles"] = step_case(spread, 1.0)
    # the hash beyond 32 bits and at negative values; step -1 refills at counter 0 (initial_canvas)
    g = torch.Generator().manual_seed(13)
    far = torch.tensor([[2**33 + w for w in range(12)], [-w for w in range(12)], [w * 977 for w in range(12)]])
    cases["hash_extremes"] = step_case(torch.randn(3, 12, 29, generator=g), [2.0, 50.0, 0.5],
                                       temperature=[1.0, 0.5, 2.0], seed=[-1, 2**40 + 3, 7], step=[2**33, -1, 0],
                                       positions=far)
    return cases


CASES = {**random_cases(), **crafted_cases()}


def run_case(kernels, case: dict) -> dict:
    """The kernels' outputs for a case, both forms; the two-kernel form also returns its entropies."""
    args = (case["logits"], case["canvas"], case["positions"], RenoiseParams(*case["params"]))
    options = dict(finished=case["finished"], block_v=case["block_v"], block_w=case["block_w"])
    # the kernels' scratch row lives where they run: a CPU one for the interpreter, a CUDA one on the GPU
    token_entropy = torch.empty(case["canvas"].shape, dtype=torch.float32, device=case["canvas"].device)
    return {"fused=False": kernels.entropy_bound_step(*args, **options, fused=False, token_entropy=token_entropy),
            "fused=True": kernels.entropy_bound_step(*args, **options, fused=True), "token_entropy": token_entropy}


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    """Every case's kernel outputs from a TRITON_INTERPRET=1 process (see the module docstring)."""
    return run_in_interpreter(__file__, CASES, tmp_path_factory.mktemp("interpreter"))


def reference(case: dict):
    return entropy_bound_step(case["logits"], case["canvas"], case["positions"], RenoiseParams(*case["params"]),
                              finished=case["finished"])


def assert_matches_reference(result, expected):
    assert torch.equal(result.canvas, expected.canvas), (result.canvas, expected.canvas)
    assert torch.equal(result.argmax, expected.argmax), (result.argmax, expected.argmax)
    assert torch.equal(result.accepted, expected.accepted), (result.accepted, expected.accepted)
    assert result.scaled_logits.dtype == torch.float32
    assert torch.equal(result.scaled_logits, expected.scaled_logits)
    assert result.mean_entropy.dtype == torch.float32
    torch.testing.assert_close(result.mean_entropy, expected.mean_entropy, atol=1e-5, rtol=0)


# -- the kernels in the interpreter against the reference ------------------------------------------

@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("form", FORMS)
def test_step_matches_the_reference(interpreted, name, form):
    assert_matches_reference(interpreted[name][form], reference(CASES[name]))


@pytest.mark.parametrize("name", list(CASES))
def test_entropies_match_the_reference(interpreted, name):
    case = CASES[name]
    expected = entropy(case["logits"] / case["params"][0][:, None, None])
    torch.testing.assert_close(interpreted[name]["token_entropy"], expected, atol=1e-5, rtol=0)


def test_ties_are_accepted_in_position_order(interpreted):
    """Ascending entropy: 2 and 7 (0), then the sharp group 1, 3, 4, 6, then the flat pair 0, 5."""
    sharp = entropy(tied_rows())[0, 1].item()
    assert sharp > 0.1
    expected = {"zero": [2, 7, 1], "inside": [2, 7, 1, 3], "below_two": [2, 7, 1, 3], "at_two": [2, 7, 1, 3, 4],
                "four": [2, 7, 1, 3, 4, 6, 0]}
    for name, taken in expected.items():
        for form in FORMS:
            result = interpreted[f"ties_{name}"][form]
            assert result.accepted[0].nonzero().flatten().sort().values.tolist() == sorted(taken), (name, form)
            assert not result.accepted[1].any()  # a finished row accepts nothing and keeps its canvas
            assert torch.equal(result.canvas[1], CASES[f"ties_{name}"]["canvas"][1])
    assert interpreted["argmax_across_tiles"]["fused=False"].argmax[0].tolist() == [5, 37, 5]


def test_random_numbers_are_bit_exact(interpreted):
    """Samples and refills from hash inputs beyond 32 bits and negative ones, to the token."""
    expected = reference(CASES["hash_extremes"])
    for form in FORMS:
        assert torch.equal(interpreted["hash_extremes"][form].canvas, expected.canvas)
    assert 0 < int(expected.accepted.sum()) < expected.accepted.numel()


# -- bad input ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kernels():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the test process interprets Triton")
    from dlmrt.ops.entropy_bound import triton_kernels
    return triton_kernels


@pytest.mark.parametrize("change, message", [
    (dict(logits=torch.zeros(2, 3, 5, dtype=torch.float64)), "logits must be torch.float32"),
    (dict(logits=torch.zeros(2, 3)), r"\[B, W, V\]"),
    (dict(logits=torch.zeros(2, 2000, 5)), "W <= 1024"),
    (dict(canvas=torch.zeros(2, 3, dtype=torch.int32)), "canvas must be torch.int64"),
    (dict(positions=torch.zeros(2, 4, dtype=torch.long)), r"positions must have shape \[2, 3\]"),
    (dict(finished=torch.zeros(2, dtype=torch.long)), "finished must be torch.bool"),
    (dict(block_w=2), "block_w 2 must be a power of two >= W = 3"),
    (dict(), "TRITON_INTERPRET=1"),  # CPU tensors without the interpreter
])
def test_bad_input_is_refused_before_any_launch(kernels, change, message):
    case = random_case(0, 2, 3, 5)
    inputs = {**dict(logits=case["logits"], canvas=case["canvas"], positions=case["positions"],
                     params=RenoiseParams(*case["params"]), finished=case["finished"]), **change}
    with pytest.raises(KernelInputError, match=message):
        kernels.entropy_bound_step(**inputs)


# -- ahead-of-time compilation -----------------------------------------------------------------------

@pytest.mark.parametrize("cc", [90, 100, 120])
def test_kernels_compile_for_each_target(kernels, cc):
    import triton
    from triton.backends.compiler import GPUTarget

    for name, signature in kernels.SIGNATURES.items():
        config = kernels.CONFIGS[name]
        source = triton.compiler.ASTSource(getattr(kernels, name),
                                           dict(signature, **{c: "constexpr" for c in config.constexprs}),
                                           constexprs=config.constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", cc, 32),
                                  options={"num_warps": config.num_warps, "enable_fp_fusion": False})
        ptx, metadata = compiled.asm["ptx"], compiled.metadata
        assert re.search(rf"^\.target sm_{cc}a?\b", ptx, flags=re.M), ptx[:400]
        entry = re.search(r"\.entry (\w+)\((.*?)\)", ptx, flags=re.S)
        assert entry.group(1) == metadata.name == name
        # the kernel's own arguments, then Triton's scratch pointers, unused (a TensorRT plugin cannot pass them)
        assert entry.group(2).count(".param") >= len(signature)
        assert not metadata.global_scratch_size and not metadata.profile_scratch_size
        assert metadata.num_warps == config.num_warps
        if name != "entropy_accept_kernel":
            assert "div.rn.f32" in ptx  # the temperature division is IEEE, as torch's


def test_the_fused_kernel_compiles_through_the_aot_module():
    """What a TensorRT plugin of the op would take: the fused kernel, by name, through aot."""
    from dlmrt.ops.parallel_unmask import aot

    compiled = aot.compile_kernel("entropy_bound_kernel", 100)
    assert compiled.name == "entropy_bound_kernel" and ".target sm_100" in compiled.ptx


# -- the GPU -------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", ["small_vocabulary_in_tiles", "canvas_of_32", "ties_at_two", "hash_extremes"])
def test_compiled_kernels_on_cuda_match_the_reference(name):
    kernels = cuda_kernels(KERNELS)
    case = CASES[name]
    on_gpu = {key: (tuple(t.cuda() for t in value) if key == "params" else
                    value.cuda() if isinstance(value, torch.Tensor) else value) for key, value in case.items()}
    expected = reference(case)
    results = run_case(kernels, on_gpu)
    for form in FORMS:
        assert_matches_reference(type(expected)(*(t.cpu() for t in results[form])), expected)
    scaled = case["logits"] / case["params"][0][:, None, None]
    torch.testing.assert_close(results["token_entropy"].cpu(), entropy(scaled), atol=1e-5, rtol=0)


if __name__ == "__main__":
    interpret_cases(KERNELS, run_case, *sys.argv[1:])
