"""One benchmark scenario run: the cases of `dlmrt bench --backend` built over one model, timed round by round
against each other (and, in a suite's gated run, against the canary), their tokens hashed and their work
counted; and the JSON document of a run's results.

Every case decodes the same seeded random prompts (`batch_size` of `input_len` ids) to the full `output_len`
(end-of-sequence ignored, as `vllm bench latency` does). The first case is the baseline of the speed
ratios, and "same tokens" compares each case's token digest with the first's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from dlmrt.bench import suite as bench_suite
from dlmrt.bench.backend_specs import fp8_model, split_case
from dlmrt.bench.models import open_model
from dlmrt.bench.suite import Scenario

if TYPE_CHECKING:
    from dlmrt.runtime import GenerationSettings

BENCH_FORMAT_VERSION = 1


class ScenarioRun(NamedTuple):
    result: dict  # what --output-json writes and the gate checks: the scenario, its settings, its cases' rows
    settings: GenerationSettings


def token_hash(tokens) -> str:
    """A short digest of generated tokens: equal digests, equal tokens."""
    return hashlib.sha256(tokens.cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def run_scenario(scenario: Scenario, backends: list[tuple[str, str | None]], console,
                 gated: bool = False) -> ScenarioRun:
    """One scenario, every case (`backends`, as `dlmrt bench --backend` names them) side by side: its rows and
    settings. Each case's speed against the first is the median of the rounds' paired ratios, with its
    bootstrap interval. `gated` (a suite's run) also times the canary in the same rounds and counts each
    case's work (`dlmrt.bench.counted`). `console` shows what is under way."""
    import torch
    from rich.progress import Progress

    from dlmrt.bench.benchmark import summarize
    from dlmrt.bench.canary import LABEL as CANARY
    from dlmrt.bench.paired import median_with_ci, paired_ratios
    from dlmrt.bench.step_case import default_cache
    from dlmrt.runtime import GenerationSettings, make_policy

    model = open_model(scenario.model, scenario.dtype, scenario.device)
    block_length = scenario.block_length or min(32, scenario.output_len)
    cache = scenario.cache or default_cache(model)
    policy = make_policy(scenario.policy, threshold=scenario.threshold, factor=scenario.factor, steps=scenario.steps,
                         generation_config=model.generation_config)
    settings = GenerationSettings(scenario.output_len, block_length, policy, cache=cache, ignore_eos=True)
    settings.validate(model.block_causal)
    special = {model.tokens.mask_id, model.tokens.pad_id, *model.tokens.eos_ids}
    allowed = torch.tensor([i for i in range(model.vocab_size) if i not in special])
    chosen = torch.randint(len(allowed), (scenario.batch_size, scenario.input_len),
                           generator=torch.Generator().manual_seed(scenario.seed))
    prompts = allowed[chosen].tolist()
    threads = bench_suite.GATE_THREADS if gated else None
    if threads is not None:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as scratch, Progress(console=console, transient=True) as progress:
        cases, tokens = make_cases(model, backends, prompts, settings, Path(scratch), console, threads,
                                   runs=scenario.num_iters + scenario.num_iters_warmup)
        timed = timed_rounds(cases, scenario.num_iters, scenario.num_iters_warmup, progress, canary=gated)
        rows = [summarize(case.label, timed.results[case.label], timed.seconds[case.label], timed.warmups[case.label])
                for case in cases]
        work = count_cases(model, backends, prompts, settings, Path(scratch), progress) if gated else None
    first = next((row for row in rows if row["setting"] != "reference"), rows[0])
    for row in rows:
        row["tokens_sha256"] = tokens[row["setting"]]
        row["same_tokens"] = None if row["setting"] == "reference" else row["tokens_sha256"] == tokens[first["setting"]]
        speed = median_with_ci(paired_ratios(rows[0]["seconds_runs"], row["seconds_runs"]))
        row["speedup"], row["speedup_ci"] = speed.median, [speed.low, speed.high]
        if work is not None:
            row["work"] = work.get(row["setting"])
    canary = None
    if gated:
        against = median_with_ci(paired_ratios(timed.seconds[CANARY], rows[0]["seconds_runs"]))
        canary = {**against._asdict(), "seconds": statistics.median(timed.seconds[CANARY])}
    exact = None
    if scenario.exact_match_per_task:
        from dlmrt.eval import evaluation
        from dlmrt.core import tasks

        from dlmrt.runtime.settings import lengths_with_defaults

        # at the model's own lengths: the tiny model knows one, and scores 0 at the scenario's output_len
        gen_length, scored_block = lengths_with_defaults(model, None, None)
        examples = tasks.examples("test", scenario.exact_match_per_task, seed=0)
        score = evaluation.exact_match(model, examples, dataclasses.replace(
            settings, gen_length=gen_length, block_length=scored_block, ignore_eos=False), mode="eager")
        exact = {"correct": score.correct, "total": score.total}
    return ScenarioRun({"scenario": bench_suite.scenario_dict(scenario), "model": model.name,
                        "settings": {"policy": policy.name, **dataclasses.asdict(policy), "cache": cache,
                                     "block_length": block_length, "dtype": str(model.dtype)},
                        "cases": rows, "exact_match": exact, "canary": canary}, settings)


def make_cases(model, backends, prompts, settings, scratch: Path, console, ort_threads: int | None = None,
               outputs: dict | None = None, runs: int = 1):
    """One benchmark Case per backend; `tokens` fills with each case's token digest as it runs, and
    `outputs` (when given) with its generated tokens. The reference case is LLaDA's plain loop (fixed
    policy, one token a step, no cache) on the same prompts. ONNX Runtime runs `ort_threads` intra-op
    threads (None: its default); an ort case needs the onnx extra (`dlmrt.cli.errors.require_onnx_extra`
    checks it first). torch:auto on a CPU runs what `dlmrt generate` would for the case's
    `runs` runs (`cpu_mode`), and says which."""
    from dlmrt.bench.case import Case
    from dlmrt.runtime import Fixed, Generator, reference
    from dlmrt.runtime.torch_backend import TorchBackend

    tokens: dict[str, str] = {}
    quantized: dict[str, object] = {}  # the model in each precision a torch case names, made once

    def keep(label: str, generated) -> None:
        tokens[label] = token_hash(generated)
        if outputs is not None:
            outputs[label] = generated

    cases = []
    for name, mode in backends:
        label = f"{name}:{mode}" if mode else name
        if name == "reference":
            plain = dataclasses.replace(settings, policy=Fixed(), cache="none")

            def run(label=label, plain=plain):
                result = reference.generate(model, prompts, plain)
                keep(label, result.tokens)
                return result.metrics
            cases.append(Case(label, run))
            continue
        if name == "torch":
            mode, precision = split_case(mode)
            if precision and precision not in quantized:
                quantized[precision] = fp8_model(model)
            case_model = quantized[precision] if precision else model
            if mode == "auto" and model.device.type == "cpu":
                from dlmrt.runtime import cpu_mode

                mode = cpu_mode.auto_mode(case_model, cpu_mode.work_of(case_model, settings, prompts, len(prompts),
                                                                       runs))
                console.print(f"{label} runs {mode} on this CPU for this work")
            generator = Generator(TorchBackend(case_model, mode=mode, max_batch=len(prompts)))
        else:
            from dlmrt.export.export_manifest import MANIFEST_FILE
            from dlmrt.export.onnx_export import export
            from dlmrt.runtime.layout import canvas_length
            from dlmrt.runtime.ort_backend import OrtBackend

            # exactly the canvas these prompts need: a block more overran the tiny model's context on the defaults
            length = canvas_length(prompts, settings.gen_length, settings.block_length, block_causal=model.block_causal)
            export_dir = scratch / "export"
            if not (export_dir / MANIFEST_FILE).exists():
                with console.status(f"exporting {model.name} for ONNX Runtime"):
                    export(model, export_dir, max_batch=len(prompts), max_length=length)
            if mode is not None:
                from dlmrt.quant.cpu_int import quantize_export

                with console.status(f"quantizing the export: {mode}"):
                    export_dir = quantize_export(export_dir, case_export(scratch, label), precision=mode)
            generator = Generator(OrtBackend(export_dir, spinning=False, threads=ort_threads))  # between torch's

        def run(label=label, generator=generator):
            result = generator.generate(prompts, settings)
            keep(label, result.tokens)
            return result.metrics
        cases.append(Case(label, run))
    return cases, tokens


def timed_rounds(cases, rounds: int, warmups: int, progress, canary: bool):
    """Every case, and with `canary` the canary, interleaved round by round."""
    from dlmrt.bench.canary import canary_case
    from dlmrt.bench.paired import interleaved_rounds

    timed = [*cases, canary_case()] if canary else list(cases)
    task = progress.add_task("benchmarking", total=len(timed) * (rounds + warmups))
    return interleaved_rounds(timed, rounds, warmups, advance=lambda: progress.advance(task))


def case_export(scratch: Path, label: str) -> Path:
    """Where an ort case's export lies: the float one, or its quantized copy (ort:int8 ...)."""
    _, _, precision = label.partition(":")
    return scratch / (precision or "export")


def count_cases(model, backends, prompts, settings, scratch: Path, progress) -> dict[str, dict]:
    """Each case's counted work, from one instrumented run of a backend built as the case's was. The
    reference loop is the timing's yardstick, not a product: counting it (some 10 s a scenario) would
    only repeat what eager's counts see in the model."""
    from dlmrt.bench.counted import count_work

    counted = [f"{name}:{mode}" if mode else name for name, mode in backends if name != "reference"]
    task = progress.add_task("counting work", total=len(counted))
    work = {}
    for label in counted:
        work[label] = count_work(label, model, prompts, settings, export_dir=case_export(scratch, label)).as_dict()
        progress.advance(task)
    return work


def write_results(path: Path, suite_name: str | None, results: dict) -> None:
    """What `dlmrt bench --output-json` writes: every scenario's results, the suite, the environment."""
    from dlmrt.core import atomic
    from dlmrt.bench.benchmark import environment

    document = {"format_version": BENCH_FORMAT_VERSION, "suite": suite_name, "environment": environment(),
                "scenarios": results}
    atomic.write_text(path, json.dumps(document, indent=2) + "\n")
