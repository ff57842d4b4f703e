"""The step loop on the device: padded buckets give the unpadded tokens, the host reads the device once
per K steps, and bad modes, limits and failures get one clear error. That the compiled step (one graph,
fullgraph=True) gives the eager tokens is the parity matrix's compile column (test_parity_matrix_compiled.py)."""

from __future__ import annotations

import math
import sys
import threading
import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode

from dlmrt.core.errors import ArgumentError
from dlmrt.runtime import Factor, Fixed, GenerationSettings, Generator, LLaDA2, Threshold
from dlmrt.runtime.batch_resources import resources
from dlmrt.runtime.torch_backend import TorchBackend
from helpers import interpret_cases, run_in_interpreter

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]]






def tokens(model, settings, prompts=PROMPTS, **backend_options):
    return Generator(model, **backend_options).generate(prompts, settings).tokens


# -- buckets: padding is inert ----------------------------------------------------------------------
BUCKET_CASES = [  # (model, settings): every cache mode, guidance, ORL, sampling, both families
    ("llada", GenerationSettings(12, 4, Threshold(0.3), cache="dual", ignore_eos=True)),
    ("llada", GenerationSettings(12, 4, Fixed(12), cache="prefix", cfg_scale=1.5, ignore_eos=True)),
    ("orl", GenerationSettings(12, 4, Factor(2.0), cache="none", temperature=0.8, seed=2)),
    ("llada2", GenerationSettings(12, 4, LLaDA2(0.3, 4), cache="prefix")),
    ("llada2_orl", GenerationSettings(12, 4, Threshold(0.3), cache="none", cfg_scale=1.0, ignore_eos=True)),
]


@pytest.mark.parametrize("model_name, settings", BUCKET_CASES, ids=lambda value: getattr(value, "cache", value))
def test_a_padded_bucket_gives_the_tokens_of_the_unpadded_run(request, model_name, settings):
    model = request.getfixturevalue(model_name)
    exact = tokens(model, settings, mode="eager", batch_sizes=(3,), canvas_lengths=(1,))  # no padding anywhere
    padded = tokens(model, settings, mode="eager")  # 3 rows in the bucket of 4, canvas in whole blocks
    wide = tokens(model, settings, mode="eager", batch_sizes=(8,), canvas_lengths=(48,))  # much more padding
    assert torch.equal(padded, exact) and torch.equal(wide, exact)


def test_rows_alone_give_their_batched_tokens_with_sampling_and_orl(orl):
    """Steps after a row's block is done are no-ops, so its random stream and residual do not depend on
    how long its neighbours take."""
    settings = GenerationSettings(12, 4, Threshold(0.3), cache="dual", temperature=0.8, seed=2, ignore_eos=True)
    batched = Generator(orl, mode="eager").generate(PROMPTS, settings).rows
    for row, prompt in enumerate(PROMPTS):
        alone = Generator(orl, mode="eager").generate([prompt], GenerationSettings(
            12, 4, Threshold(0.3), cache="dual", temperature=0.8, seed=2 + row, ignore_eos=True)).rows[0]
        assert alone.token_ids == batched[row].token_ids


# -- host reads -------------------------------------------------------------------------------------
READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}


class DeviceReads(TorchFunctionMode):
    """Counts reads of a backend's device state on the host."""

    def __init__(self, backend):
        super().__init__()
        self.backend, self.count = backend, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in READS and args and isinstance(args[0], torch.Tensor):
            storages = {t.untyped_storage().data_ptr() for state in resources(self.backend).pool.states.values()
                        for t in state.tensors().values()}
            self.count += args[0].untyped_storage().data_ptr() in storages
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_the_host_reads_the_device_once_per_k_steps(llada, k):
    backend = TorchBackend(llada, mode="eager")
    settings = GenerationSettings(16, 8, Fixed(16), cache="dual", ignore_eos=True, steps_per_sync=k)  # 8 steps/block
    with DeviceReads(backend) as reads:
        result = Generator(backend).generate(PROMPTS, settings)
    blocks, steps = 2, 8
    assert result.metrics.forwards_executed == blocks * steps
    assert reads.count <= blocks * (math.ceil(steps / k) + 1)  # the done flags, and the block's tokens once
    assert reads.count >= blocks * math.ceil(steps / k)


@pytest.mark.parametrize("budget_left, remaining, taken, last_rate, expected", [
    (32, 32, 0, None, 1),  # nothing known: one step, then look
    (31, 28, 1, None, 7),  # the first step committed 4: 28 left need 7 more
    (31, 28, 1, 8.0, 7),  # this block's own rate wins over the last block's
    (32, 32, 0, 8.0, 4),  # a new block starts at the last block's rate
    (3, 28, 1, None, 3),  # never past the budget
    (31, 31, 1, None, 31),  # one token a step: the rest of the block
    (31, 32, 1, None, 1),  # nothing committed yet: one step
    (24, 1, 8, None, 1),  # at least one
])
def test_automatic_k_plans_the_steps_the_block_still_needs(budget_left, remaining, taken, last_rate, expected):
    from dlmrt.runtime.mask_batch import automatic_steps

    assert automatic_steps(budget_left, remaining, taken, 32, last_rate) == expected


def test_a_large_k_runs_no_op_steps_and_changes_no_token():
    import dlmrt
    from dlmrt.core import tasks
    from dlmrt.runtime import text

    tiny = dlmrt.load()
    prompts = [text.encode(tiny, e.prompt) for e in tasks.examples("test", 8, seed=3)]
    settings = GenerationSettings(16, 8, Threshold(0.9), cache="dual")
    one = Generator(tiny, mode="eager").generate(prompts, settings)
    whole = Generator(tiny, mode="eager").generate(prompts, GenerationSettings(16, 8, Threshold(0.9), cache="dual",
                                                                               steps_per_sync=8))
    assert torch.equal(one.tokens, whole.tokens)
    assert one.metrics.nfe == whole.metrics.nfe == one.metrics.forwards_executed
    assert whole.metrics.forwards_executed > whole.metrics.nfe  # the confident model ends blocks early


# -- bad input ---------------------------------------------------------------------------------------------
def test_a_mode_this_device_cannot_run_names_the_modes_that_can(llada):
    with pytest.raises(ArgumentError, match=r"mode 'cudagraph' cannot run on cpu: modes that run here are auto, "
                                            r"eager, compile"):
        TorchBackend(llada, mode="cudagraph")
    with pytest.raises(ArgumentError, match=r"mode 'jit' cannot run on cpu \(modes: auto, eager, compile, cudagraph\)"):
        TorchBackend(llada, mode="jit")


def test_a_batch_or_canvas_over_the_largest_bucket_names_the_option(llada):
    with pytest.raises(ArgumentError, match=r"3 prompts exceed the batch limit of 2: raise the limit with --max-batch"):
        Generator(llada, mode="eager", max_batch=2).generate(PROMPTS, GenerationSettings(8, 4))
    with pytest.raises(ArgumentError, match=r"needs a canvas of 17 positions, more than the largest of 16: raise it "
                                            r"with TorchBackend\(max_length=...\)"):
        Generator(llada, mode="eager", max_length=16).generate(PROMPTS, GenerationSettings(8, 4))
    with pytest.raises(ArgumentError, match="steps-per-sync must be positive"):
        Generator(llada, mode="eager").generate(PROMPTS, GenerationSettings(8, 4, steps_per_sync=0))


def _failing_compile(*args, **kwargs):
    raise RuntimeError("no compiler here")


def test_auto_runs_eager_on_a_cpu_and_compiles_nothing(llada, monkeypatch):
    monkeypatch.setattr(torch, "compile", _failing_compile)
    settings = GenerationSettings(8, 4, Threshold(0.3), cache="dual", ignore_eos=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning either: nothing was tried
        found = Generator(llada).generate(PROMPTS, settings)
    assert torch.equal(found.tokens, tokens(llada, settings, mode="eager"))


def test_a_failed_compile_falls_back_to_eager_only_for_the_default_mode(llada, monkeypatch):
    """`auto` falls back (on CUDA, where it captures); a mode asked for explains. On a CPU `auto` runs eager,
    so the fallback runs here through the executor TorchBackend makes for `auto`, over compile."""
    from dlmrt.runtime.executor import Executor
    from dlmrt.runtime.torch_backend import TorchBackend

    monkeypatch.setattr(torch, "compile", _failing_compile)
    settings = GenerationSettings(8, 4, Threshold(0.3), cache="dual", ignore_eos=True)
    backend = TorchBackend(llada, mode="compile")
    resources(backend).executor = Executor(backend, "compile", "fall back")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallback = Generator(backend).generate(PROMPTS, settings)
    said = [w for w in caught if "running eagerly instead" in str(w.message)]
    assert len(said) == 1 and "no compiler here" in str(said[0].message)  # once, for both step kinds
    assert torch.equal(fallback.tokens, tokens(llada, settings, mode="eager"))
    with pytest.raises(ArgumentError, match=r"mode 'compile' failed to compile the step for a batch of 4 x 20: "
                                            r"RuntimeError: no compiler here; use --mode eager"):
        Generator(llada, mode="compile").generate(PROMPTS, settings)


def test_two_streams_on_one_backend_are_refused_until_the_first_ends(llada):
    generator = Generator(llada, mode="eager")
    settings = GenerationSettings(8, 4, Fixed(8), ignore_eos=True)
    first = generator.stream(PROMPTS, settings)
    next(first)
    with pytest.raises(ArgumentError, match="already decoding a batch of the same shape"):
        generator.generate(PROMPTS, settings)
    first.close()
    assert generator.generate(PROMPTS, settings).tokens.shape == (3, 8)
    with pytest.raises(ArgumentError, match=r"backend options \(mode\) apply to a model"):
        Generator(generator.backend, mode="eager")


def test_cancellation_from_another_thread_stops_at_a_host_read(llada):
    cancel = threading.Event()
    cancel.set()
    result = Generator(llada, mode="eager").generate(PROMPTS, GenerationSettings(8, 4, Fixed(8), steps_per_sync=4),
                                                     cancel=cancel)
    assert result.metrics.forwards_executed == 0
    assert all(row.finish_reason == "cancelled" for row in result.rows)


# -- the Triton unmask kernels inside the loop (in Triton's interpreter here; on CUDA in the GPU check) --
TRITON_CASES = {
    "dual, sampled, orl": (GenerationSettings(8, 4, Threshold(0.3), cache="dual", temperature=0.8, seed=1,
                                              ignore_eos=True), True),
    "prefix, guided, margin": (GenerationSettings(8, 4, Factor(2.0, "margin"), cache="prefix", cfg_scale=1.0,
                                                  ignore_eos=True), False),
}


def run_triton_case(kernels, case):
    """In the interpreter process: decode with the step graph's Triton unmask kernels, counting their calls."""
    import dlmrt

    launcher, calls = kernels.parallel_unmask, []
    kernels.parallel_unmask = lambda *args, **kwargs: calls.append(1) or launcher(*args, **kwargs)
    model = dlmrt.load(case["model"])
    result = Generator(TorchBackend(model, mode="eager", unmask="triton")).generate(case["prompts"], case["settings"])
    kernels.parallel_unmask = launcher
    return result.tokens, len(calls), result.metrics.forwards_executed


def test_the_triton_unmask_kernels_give_the_torch_tokens_inside_the_loop(llada, orl, tmp_path):
    pytest.importorskip("triton", reason="the Triton kernels need the 'triton' extra")
    from dlmrt.models import checkpoint

    directories = {name: checkpoint.save(model, tmp_path / name) for name, model in (("llada", llada), ("orl", orl))}
    cases = {name: {"model": str(directories["orl" if residual else "llada"]), "prompts": PROMPTS[:2],
                    "settings": settings} for name, (settings, residual) in TRITON_CASES.items()}
    found = run_in_interpreter(__file__, cases, tmp_path)
    for name, (settings, residual) in TRITON_CASES.items():
        found_tokens, kernel_calls, steps = found[name]
        assert kernel_calls == steps > 0  # every step unmasked with the kernels
        assert torch.equal(found_tokens, tokens(orl if residual else llada, settings, PROMPTS[:2], mode="eager")), name


if __name__ == "__main__":
    interpret_cases("dlmrt.ops.parallel_unmask.triton_kernels", run_triton_case, *sys.argv[1:])
