"""The uniform-noise step loop (policy `entropy_bound`, `dlmrt.runtime.uniform_noise`) on DiffusionGemma.

The Generator's batched loop, which freezes a stopped row and reads the host every K steps, is held
to a plain loop written here for one row as the public generate is structured: a canvas per block,
decoder steps until the stop rule holds (then break), the argmax cut after its first EOS, and the
encoder committing the canvas. The step itself (`dlmrt.ops.entropy_bound`) is held to the public
sampler in test_entropy_bound.py.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from dlmrt.core.errors import ArgumentError
from dlmrt.models import checkpoint
from dlmrt.ops.entropy_bound import RenoiseParams, entropy_bound_step, initial_canvas, temperature_schedule
from dlmrt.runtime import EntropyBound, GenerationSettings, Generator, Threshold, make_policy
from dlmrt.runtime.uniform_policy import entropy_bound_defaults

DATA = Path(__file__).parents[1] / "data" / "diffusion_gemma"
PROMPTS = [[2, 17, 42, 5], [2, 9, 22, 31, 8, 77], [2, 40]]


def load(path: Path = DATA):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return checkpoint.load(path)


@pytest.fixture(scope="module")
def model():
    return load()


@torch.no_grad()
def reference(model, prompt: list[int], gen_length: int, block: int, policy: EntropyBound, seed: int):
    """(tokens, decoder forwards) of one row, plainly."""
    length = len(prompt)
    cache = model.encode(torch.tensor([prompt]))
    temperatures = temperature_schedule(policy.t_min, policy.t_max, policy.steps)
    eos, pad = model.tokens.eos_ids, model.tokens.pad_id
    tokens, forwards = [], 0
    for start in range(0, gen_length, block):
        positions = torch.arange(length + start, length + start + block)[None]
        seeds = torch.tensor([seed])
        canvas = initial_canvas(seeds, positions, model.vocab_size)
        previous, stable, soft = None, 0, None
        for step in range(policy.steps):
            logits = model.denoise(canvas, positions=positions, past=cache, residual=soft).logits
            params = RenoiseParams(temperatures[step:step + 1], torch.tensor([policy.entropy_bound]), seeds,
                                   torch.tensor([step]))
            result = entropy_bound_step(logits, canvas, positions, params)
            forwards += 1
            stable = stable + 1 if previous is not None and torch.equal(result.argmax, previous) else 0
            previous, canvas = result.argmax, result.canvas
            soft = model.soft_tokens(result.scaled_logits)
            if stable >= policy.stability_threshold and float(result.mean_entropy) < policy.confidence_threshold:
                break
        block_tokens = previous[0].tolist()
        ends = [i for i, t in enumerate(block_tokens) if t in eos]
        if ends:
            tokens += block_tokens[:ends[0] + 1] + [pad] * (gen_length - len(tokens) - ends[0] - 1)
            return tokens, forwards
        tokens += block_tokens
        cache = model.encode(previous, positions=positions, past=cache)
    return tokens, forwards


# A policy whose stop rule fires on this random model's flat distributions, so that steps end early.
EARLY = EntropyBound(steps=6, stability_threshold=0, confidence_threshold=3.5)
TINY = Path(__file__).parents[2] / "dlmrt" / "assets" / "tiny-diffusion-gemma"


@pytest.fixture(scope="module")
def trained():
    """The DiffusionGemma-shaped model trained on the task suite (scripts/train_tiny_diffusion_gemma.py)."""
    return load(TINY)


def task_prompts(model, count: int) -> list[list[int]]:
    from dlmrt.core import tasks

    return [model.tokenizer.encode(e.prompt).ids for e in tasks.examples("test", count, 0)]


# The loop decodes over static buffers: the decoder attends to the bucket's whole cache storage, masked
# to what was written, and prompts are left-padded to whole blocks, so its logits differ from the plain
# loop's in float rounding (about 1e-5: test_the_decoder_over_the_storage_is_the_plain_decoder). On the
# random model the self-conditioning amplifies that until a token flips; the trained model's peaked
# distributions leave no decision to rounding, so the plain loop is held to the same tokens there.
@pytest.mark.parametrize("policy", [EntropyBound(steps=6), EntropyBound(steps=6, confidence_threshold=0.3)],
                         ids=["defaults", "early stop"])
def test_the_loop_matches_a_plain_loop_row_by_row(trained, policy):
    generator = Generator(trained, mode="eager")
    fewest = 12
    for seed, prompt in enumerate(task_prompts(trained, 3)):
        expected, forwards = reference(trained, prompt, 16, 8, policy, seed)
        result = generator.generate([prompt], GenerationSettings(16, 8, policy, seed=seed))
        assert result.tokens[0].tolist() == expected
        assert result.rows[0].metrics.nfe == forwards
        fewest = min(fewest, forwards)
    assert fewest < 12  # some row stopped before its step budget, or the stop rule is untested


def test_the_decoder_over_the_storage_is_the_plain_decoder(model):
    """The step's decoder reads the bucket's cache storage (prompt left-padded to whole blocks, unwritten
    slots masked): the same logits as the plain decoder over the prompt's own cache, to float rounding."""
    from dlmrt.runtime.batches import open_batch
    from dlmrt.runtime.torch_backend import TorchBackend
    from dlmrt.runtime.uniform_step import UNIFORM_STEP

    prompt = PROMPTS[0]
    backend = TorchBackend(model, mode="eager")
    batch = open_batch(backend)
    batch.add(0, prompt, GenerationSettings(16, 8, EntropyBound()), seed=0)
    with torch.no_grad():
        batch._place_waiting()  # the row joins: the encoder writes its prompt's K/V
        state = batch.state
        assert state.bucket.prompt == 8 and state.bucket.storage == 16  # 4 tokens of padding, 8 unwritten slots
        state.start_blocks(model.vocab_size)
        got = UNIFORM_STEP.bind(backend, state).decode(state)
        positions = torch.arange(len(prompt), len(prompt) + 8)[None]
        expected = model.denoise(state.block_ids, positions=positions, past=model.encode(torch.tensor([prompt]))).logits
    assert (got - expected).abs().max() < 1e-4


def test_a_bucket_decodes_each_request_afresh(trained):
    """A bucket's buffers serve one request after another: what a request gets does not depend on what ran
    before it in the same buffers."""
    prompts = task_prompts(trained, 2)
    generator = Generator(trained, mode="eager")
    settings = GenerationSettings(16, 8, EntropyBound(steps=6), seed=4)
    first = generator.generate(prompts[:3], settings)
    generator.generate(prompts[3:6], GenerationSettings(16, 8, EntropyBound(steps=6), seed=9))
    again = generator.generate(prompts[:3], settings)
    assert torch.equal(first.tokens, again.tokens)
    assert [r.metrics.nfe for r in first.rows] == [r.metrics.nfe for r in again.rows]


def test_steps_per_host_read_change_no_token(model):
    """Steps after a row stopped leave it as it was, so K steps per host read give the same tokens."""
    base = GenerationSettings(16, 8, EARLY, seed=3)
    one = Generator(model, mode="eager").generate(PROMPTS, base)
    four = Generator(model, mode="eager").generate(PROMPTS, GenerationSettings(16, 8, EARLY, seed=3,
                                                                                steps_per_sync=4))
    assert torch.equal(one.tokens, four.tokens)
    assert [r.metrics.nfe for r in one.rows] == [r.metrics.nfe for r in four.rows]
    assert four.metrics.forwards_executed >= one.metrics.forwards_executed


def test_a_seed_reproduces_a_run_and_another_seed_does_not(model):
    settings = GenerationSettings(8, 8, EntropyBound(steps=4), seed=7)
    first = Generator(model, mode="eager").generate(PROMPTS, settings).tokens
    again = Generator(model, mode="eager").generate(PROMPTS, settings).tokens
    other = Generator(model, mode="eager").generate(PROMPTS, GenerationSettings(8, 8, EntropyBound(steps=4),
                                                                                seed=8)).tokens
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_everything_after_the_first_eos_is_pad_and_the_row_stops():
    model = load()
    eos = model.tokens.eos_ids[0]
    with torch.no_grad():  # EOS becomes by far the likeliest token everywhere
        model.input_embedding().weight[eos] *= 40.0
    result = Generator(model, mode="eager").generate(PROMPTS[:2], GenerationSettings(16, 8, EntropyBound(steps=3)))
    for row in range(2):
        tokens = result.tokens[row].tolist()
        first = tokens.index(eos)
        assert first < 8 and tokens[first + 1:] == [model.tokens.pad_id] * (15 - first)
        assert result.rows[row].finish_reason == "eos"
        assert result.rows[row].token_ids == tokens[:first]
        assert result.rows[row].metrics.nfe <= 3  # no step of the second block ran for it


def test_mask_policies_and_uniform_noise_models_refuse_each_other(model):
    with pytest.raises(ArgumentError, match="policy 'threshold' is mask-based, but .* is a uniform-noise model "
                                            ".* use --policy entropy_bound"):
        Generator(model, mode="eager").generate([[2, 3]], GenerationSettings(8, 8, Threshold(0.9)))
    import dlmrt

    with pytest.raises(ArgumentError, match="policy 'entropy_bound' decodes uniform-noise models .* tiny-llada "
                                            "is mask-based"):
        Generator(dlmrt.load(), mode="eager").generate([[3, 4]], GenerationSettings(8, 8, EntropyBound()))


@pytest.mark.parametrize("policy, message", [
    (EntropyBound(steps=0), "steps must be an integer in"),
    (EntropyBound(entropy_bound=0.0), "entropy-bound must be positive"),
    (EntropyBound(t_min=0.9, t_max=0.8), "0 <= t-min < t-max"),
    (EntropyBound(confidence_threshold=float("nan")), "confidence-threshold must be a finite number"),
    (EntropyBound(stability_threshold=-1), "stability-threshold must be a non-negative integer"),
])
def test_bad_policy_parameters_are_refused_before_any_compute(model, policy, message):
    with pytest.raises(ArgumentError, match=message):
        Generator(model, mode="eager").generate([[2, 3]], GenerationSettings(8, 8, policy))


def test_the_generation_config_sets_the_defaults_and_options_override_them():
    config = {"max_denoising_steps": 12, "t_min": 0.2, "t_max": 0.6, "sampler_config": {"entropy_bound": 0.3,
              "_cls_name": "EntropyBoundSamplerConfig"}, "stability_threshold": 2, "confidence_threshold": None}
    assert entropy_bound_defaults(config) == {"steps": 12, "t_min": 0.2, "t_max": 0.6, "entropy_bound": 0.3,
                                              "stability_threshold": 2}
    policy = make_policy("entropy_bound", steps=5, generation_config=config)
    assert policy == EntropyBound(steps=5, entropy_bound=0.3, t_min=0.2, t_max=0.6, stability_threshold=2)
    with pytest.raises(ArgumentError, match="entropy-bound belongs to policy entropy_bound"):
        make_policy("threshold", entropy_bound=0.2)


def test_the_trained_tiny_model_decodes_its_tasks_and_each_row_as_alone(trained):
    """End to end on the DiffusionGemma-shaped model trained on the task suite
    (scripts/train_tiny_diffusion_gemma.py): batched rows give the tokens each gets alone (row i
    uses seed + i), and the answers are mostly right."""
    from dlmrt.core import tasks
    from dlmrt.runtime import text

    model = trained
    examples = tasks.examples("test", 5, 0)
    prompts = [model.tokenizer.encode(e.prompt).ids for e in examples]
    generator = Generator(model, mode="eager")
    batched = generator.generate(prompts, GenerationSettings(16, 16, EntropyBound(), seed=0))
    for row in range(0, len(prompts), 3):
        alone = generator.generate([prompts[row]], GenerationSettings(16, 16, EntropyBound(), seed=row))
        assert torch.equal(alone.tokens[0], batched.tokens[row])
    right = sum(tasks.is_correct(e, text.decode(model, r.token_ids)) for e, r in zip(examples, batched.rows))
    assert right >= 0.6 * len(examples)  # it measured 77% on 400 held-out prompts (README)


class _CaptureChecks(TorchDispatchMode):
    """Refuses, at the op, what a CUDA graph cannot capture, in a step run on the meta device (no data,
    and a device apart from the host's): a host read (`.item()`, `.tolist()`, `nonzero`, `unique`) and a
    host tensor meeting a device one (a copy from the host, or a CPU tensor fed to a device op)."""

    HOST_READS = ("aten._local_scalar_dense", "aten.nonzero", "aten.unique", "aten._unique")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        host = any(t.device.type == "cpu" for t in tensors)
        to_device = kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "meta"
        if str(func).startswith(self.HOST_READS):
            raise AssertionError(f"a host read in the step: {func}")
        if host and (to_device or any(t.device.type == "meta" for t in tensors)):
            raise AssertionError(f"a host tensor meets the device in the step: {func}")
        return func(*args, **kwargs)


def test_the_step_reads_nothing_from_the_host_and_copies_nothing_to_the_device(model, monkeypatch):
    """The uniform-noise step (decoder, dlmrt::EntropyBoundStep, soft tokens) and the encoder's cache
    commits as a CUDA graph captures them, emulated on a CPU: on the meta device, with
    `torch.cuda.is_current_stream_capturing()` true (the fixed-shape paths), after one step as the
    executor's warm-up. A copy from the host or a host read in them would fail the capture (`Cannot
    copy between CPU and CUDA tensors during CUDA graph capture`)."""
    from dlmrt.runtime.buckets import Bucket
    from dlmrt.runtime.encode_step import EncodeStep
    from dlmrt.runtime.torch_backend import TorchBackend
    from dlmrt.runtime.uniform_state import UniformState
    from dlmrt.runtime.uniform_step import UNIFORM_STEP

    backend = TorchBackend(copy.deepcopy(model).to("meta"), mode="eager")
    bucket = Bucket(batch=2, canvas=12, block=4, noise="uniform", prompt=4, schedule=Bucket.schedule_room(4))
    state = UniformState.allocate(backend.spec, bucket, backend.cache_groups())
    programs = (UNIFORM_STEP, EncodeStep(None), EncodeStep(0))
    bound = [(program, program.bind(backend, state)) for program in programs]
    # dynamo maps torch's functions once, on first use: before torch.tensor is patched, not during
    torch._dynamo.trace_rules.get_torch_obj_rule_map()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    made_from_host = []
    tensor = torch.tensor

    def host_tensor(data, *args, **kwargs):  # torch.tensor(data, device=...) copies from the host below dispatch
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type != "cpu":
            made_from_host.append(data)
        return tensor(data, *args, **kwargs)

    monkeypatch.setattr(torch, "tensor", host_tensor)
    with torch.no_grad():
        for program, graphs in bound:
            program.step(state, graphs)  # the warm-up
            made_from_host.clear()
            with _CaptureChecks():
                program.step(state, graphs)
            assert made_from_host == [], program


@pytest.mark.parametrize("mode", [pytest.param("compile", marks=pytest.mark.slow),
                                  pytest.param("cudagraph", marks=pytest.mark.gpu)])
def test_another_schedule_reuses_the_compiled_or_captured_steps(mode):
    """The temperature schedule and the step count are the step's inputs, not its code: a new one runs
    on the runner already compiled (torch.compile, fullgraph=True) or captured (one CUDA graph per
    bucket), and gives the eager tokens. That the compiled step gives the eager tokens at all is the
    parity matrix's (test_parity_matrix_compiled.py)."""
    import dlmrt

    if mode == "cudagraph" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    model = dlmrt.load(TINY, device="cuda" if mode == "cudagraph" else "cpu")
    prompts = [[5, 17, 42, 30], [8, 9]]  # the matrix's shapes: its compiled graphs are in the session's cache
    settings = GenerationSettings(8, 4, EntropyBound(steps=8), seed=2)
    eager, generator = Generator(model, mode="eager"), Generator(model, mode=mode)
    first = generator.generate(prompts, settings)
    assert first.metrics.compile_s > 0  # it did compile or capture, rather than fall back
    fewer = dataclasses.replace(settings, policy=EntropyBound(steps=4, t_max=0.9))
    again = generator.generate(prompts, fewer)  # another schedule and step count: the same bucket and runner
    assert torch.equal(again.tokens, eager.generate(prompts, fewer).tokens)
    assert [r.metrics.nfe for r in again.rows] == [r.metrics.nfe for r in eager.generate(prompts, fewer).rows]
    assert again.metrics.compile_s == 0
