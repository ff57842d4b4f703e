"""Accuracy of the quantized step graphs against fp32, in one run: fp32, bf16, FP8, NVFP4, int8 and int4.

    python scripts/quant_accuracy.py --json quant_accuracy.json      # about 2.5 minutes on 2 cores

Two models: the tiny model on held-out task-suite prompts, and a larger random-weight LLaDA
config (hidden 512, 6 layers by default, the tiny tokenizer's vocabulary) on the same prompts. Each
is decoded by the Generator, with the same settings, as

- fp32 (torch)    the torch model (TorchBackend): the reference every other row is compared with;
- bf16 (torch)    the same model cast to bfloat16 (what a bfloat16 checkpoint runs on a CPU by default);
- fp32 (ORT)      the exported fp32 step graphs in ONNX Runtime (should agree 100%);
- FP8 (ORT)       the export quantized by nvidia-modelopt's ONNX PTQ (dlmrt.quant.fp8),
                  run by ONNX Runtime's CPU provider;
- NVFP4 (torch)   the torch model with NVFP4 fake-quantized transformer Linears
                  (dlmrt.quant.nvfp4.simulate), run by the TorchBackend;
- int8 / int4 (ORT) the export's weights quantized by onnxruntime's MatMulNBits quantizer
                  (dlmrt.quant.cpu_int, `dlmrt export --precision`), uncalibrated, run by
                  ONNX Runtime's CPU provider: int8 and int4 in symmetric blocks of 32, and int4 in
                  asymmetric blocks of 128;
- int8-dynamic (ORT) int8 weights and activations quantized at each call (MatMulInteger).

Token agreement is the fraction of generated positions (the whole gen-length, end-of-sequence fill
included) equal to fp32's. Exact-match: for the tiny model against the task answers (per task and
mean); for the random model, the fraction of rows whose completion equals fp32's exactly. FP8 and
NVFP4 are calibrated on step-loop inputs from train-split prompts (dlmrt.quant.calibration).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import dlmrt
from dlmrt.core import atomic, tasks
from dlmrt.quant.calibration import calibration_feeds
from dlmrt.quant import cpu_int
from dlmrt.quant.fp8 import quantize_export
from dlmrt.eval.evaluation import parse_setting
from dlmrt import models
from dlmrt.models import SpecialTokens
from dlmrt.export.onnx_export import export
from dlmrt.runtime import GenerationSettings, Generator, text
from dlmrt.runtime.ort_backend import OrtBackend
from dlmrt.core.tasks import Example

RANDOM_CONTEXT = 128


@dataclass
class Target:
    """A model and what it is decoded on."""

    name: str
    model: object  # a Denoiser
    examples: list[Example]
    settings: GenerationSettings
    answers_known: bool  # score against the examples' answers (else against fp32's completions)


# (row label, precision, block size, symmetric)
CPU_INT_VARIANTS = [("int8 (ORT)", "int8", 32, True), ("int4 (ORT)", "int4", 32, True),
                    ("int4 asym. 128 (ORT)", "int4", 128, False), ("int8-dynamic (ORT)", "int8-dynamic", 32, True)]


def tiny_target(args) -> Target:
    settings = GenerationSettings(args.gen_length, args.block_length, parse_setting(args.setting).policy,
                                  cache=args.cache)
    return Target("tiny", dlmrt.load(), tasks.examples(args.split, args.per_task, args.seed), settings, True)


def scaled_init(model, head_gain: float, seed: int) -> None:
    """Weights of a trained-like scale: unit embeddings, matrices N(0, 1/fan_in), the residual
    branches' output projections further divided by sqrt(2 * layers), the LM head times `head_gain`
    (which sets how peaked predictions are). models.create's fixed-std init puts a 512-wide stack in
    a chaotic regime where any perturbation changes most predictions, which would measure the random
    network rather than the number format."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.dim() < 2:
                continue
            if name.endswith("wte.weight"):
                std = 1.0
            else:
                std = weight.shape[1] ** -0.5
                if name.endswith(("attn_out.weight", "ff_out.weight")) and ".blocks." in name:
                    std /= math.sqrt(2 * model.num_layers)
                elif ".blocks." not in name:  # the LM head (LLaDA's transformer.ff_out)
                    std *= head_gain
            weight.copy_(torch.randn(weight.shape, generator=generator) * std)


def random_target(args) -> Target:
    """A LLaDA config of the requested size with random weights (`scaled_init`), over the tiny
    tokenizer's vocabulary."""
    special = SpecialTokens(mask_id=tasks.MASK_ID, eos_ids=(tasks.EOS_ID,), pad_id=tasks.PAD_ID)
    raw = {"architectures": ["LLaDAModelLM"], "model_type": "llada", "d_model": args.random_hidden,
           "n_heads": args.random_heads, "n_kv_heads": args.random_heads, "n_layers": args.random_layers,
           "mlp_hidden_size": args.random_hidden * 11 // 4,
           "vocab_size": len(tasks.SPECIAL_TOKENS) + len(tasks.ALPHABET), "max_sequence_length": RANDOM_CONTEXT,
           "rope_theta": 10000.0, "block_type": "llama",
           "activation_type": "silu", "layer_norm_type": "rms", "rope": True, "alibi": False, "weight_tying": False,
           "mask_token_id": tasks.MASK_ID, "eos_token_id": tasks.EOS_ID, "pad_token_id": tasks.PAD_ID}
    model = models.create(raw, tokens=special, seed=args.seed)
    scaled_init(model, args.random_head_gain, args.seed)
    model.tokenizer = tasks.build_tokenizer()
    name = f"random {args.random_hidden}x{args.random_layers}"
    # Random weights stop at end-of-sequence at random: decode the whole length so every position counts.
    settings = GenerationSettings(args.random_gen_length, args.random_block_length,
                                  parse_setting(args.setting).policy, cache=args.cache, ignore_eos=True)
    per_task = math.ceil(args.random_prompts / len(tasks.TASKS))
    examples = tasks.examples(args.split, per_task, args.seed)[:args.random_prompts]
    return Target(name, model, examples, settings, False)


def decode(generator: Generator, prompts: list[list[int]], settings: GenerationSettings, batch: int,
           advance: Callable[[int], None]) -> tuple[torch.Tensor, list[list[int]], float]:
    """All prompts, `batch` at a time: the generated tokens [N, gen_length], each row's completion, seconds."""
    tokens, completions, started = [], [], time.perf_counter()
    for start in range(0, len(prompts), batch):
        result = generator.generate(prompts[start:start + batch], settings)
        tokens.append(result.tokens)
        completions += [row.token_ids for row in result.rows]
        advance(len(result.rows))
    return torch.cat(tokens), completions, time.perf_counter() - started


def exact_match(target: Target, completions: list[list[int]], reference: list[list[int]]) -> dict[str, float]:
    """Per task and mean: against the answers, or (random model) against fp32's completions."""
    right: dict[str, list[bool]] = {}
    for example, completion, expected in zip(target.examples, completions, reference):
        if target.answers_known:
            correct = tasks.is_correct(example, text.decode(target.model, completion))
        else:
            correct = completion == expected
        right.setdefault(example.task, []).append(correct)
    scores = {task: sum(flags) / len(flags) for task, flags in right.items()}
    scores["mean"] = sum(scores.values()) / len(scores)
    return scores


def build_variants(target: Target, scratch: Path, args, progress: Progress) -> tuple[dict[str, Generator], dict]:
    """The generators of a target, after exporting, FP8 quantization, NVFP4 simulation and weight-only
    quantization; the build facts (times, FP8 reports) for the JSON."""
    from dlmrt.quant import nvfp4

    facts: dict = {}
    step = progress.add_task(f"{target.name}: export, FP8, NVFP4", total=5)
    started = time.perf_counter()
    export_dir = export(target.model, scratch / "fp32", max_batch=args.batch, max_length=target.model.max_positions,
                        on_graph=lambda graph: progress.advance(step))
    facts["export_s"] = round(time.perf_counter() - started, 1)
    started = time.perf_counter()
    fp8_dir, reports = quantize_export(export_dir, scratch / "fp8", count=args.calibration_count, seed=args.seed,
                                       calibration_method=args.calibration_method,
                                       on_graph=lambda graph: progress.advance(step))
    facts["fp8_s"] = round(time.perf_counter() - started, 1)
    facts["fp8"] = {graph: report.to_dict() for graph, report in reports.items()}
    started = time.perf_counter()
    feeds = calibration_feeds(export_dir, "full", count=args.calibration_count, seed=args.seed)
    simulated = nvfp4.simulate(target.model, [torch.from_numpy(feed["ids"]) for feed in feeds])
    facts["nvfp4_s"] = round(time.perf_counter() - started, 1)
    progress.advance(step)
    generators = {"fp32 (torch)": Generator(target.model, mode="eager"),
                  "bf16 (torch)": Generator(copy.deepcopy(target.model).to(torch.bfloat16), mode="eager"),
                  "fp32 (ORT)": Generator(OrtBackend(export_dir)),
                  "FP8 (ORT)": Generator(OrtBackend(fp8_dir)), "NVFP4 (torch)": Generator(simulated, mode="eager")}
    for label, precision, block_size, symmetric in CPU_INT_VARIANTS:
        started = time.perf_counter()
        quantized = cpu_int.quantize_export(export_dir, scratch / label.split(" (")[0].replace(" ", "_"),
                                            precision=precision, block_size=block_size, symmetric=symmetric)
        facts[f"{label} s"] = round(time.perf_counter() - started, 1)
        generators[label] = Generator(OrtBackend(quantized))
    return generators, facts


def evaluate(target: Target, args, progress: Progress) -> dict:
    prompts = [text.encode(target.model, example.prompt) for example in target.examples]
    with tempfile.TemporaryDirectory(prefix="dlmrt-quant-accuracy-") as scratch:
        generators, facts = build_variants(target, Path(scratch), args, progress)
        rows, reference = [], None
        for label, generator in generators.items():
            bar = progress.add_task(f"{target.name}: {label}", total=len(prompts))
            tokens, completions, seconds = decode(generator, prompts, target.settings, args.batch,
                                                  lambda n, bar=bar: progress.advance(bar, n))
            if reference is None:
                reference = (tokens, completions)
            rows.append({"variant": label, "token_agreement": (tokens == reference[0]).float().mean().item(),
                         "exact_match": exact_match(target, completions, reference[1]),
                         "seconds": round(seconds, 2)})
    settings = target.settings
    return {"model": target.name, "prompts": len(prompts), "scored_against": "answers" if target.answers_known
            else "fp32 completions", "settings": {"gen_length": settings.gen_length,
                                                  "block_length": settings.block_length, "policy": args.setting,
                                                  "cache": settings.cache, "ignore_eos": settings.ignore_eos},
            **facts, "rows": rows}


def results_table(result: dict) -> Table:
    tasks_seen = [task for task in result["rows"][0]["exact_match"] if task != "mean"]
    s = result["settings"]
    table = Table(title=f"{result['model']}: {result['prompts']} prompts, gen {s['gen_length']}, block "
                        f"{s['block_length']}, {s['policy']}, cache {s['cache']}; exact-match against "
                        f"{result['scored_against']}")
    table.add_column("variant")
    table.add_column("token agreement", justify="right")
    for name in (*tasks_seen, "mean"):
        table.add_column(f"EM {name}", justify="right")
    table.add_column("decode s", justify="right")
    for row in result["rows"]:
        table.add_row(row["variant"], f"{row['token_agreement']:.2%}",
                      *(f"{row['exact_match'][name]:.1%}" for name in (*tasks_seen, "mean")), f"{row['seconds']:.1f}")
    return table


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-task", type=int, default=100, help="tiny model: held-out prompts per task [100]")
    parser.add_argument("--split", default="test", choices=("test", "train"), help="task-suite split [test]")
    parser.add_argument("--setting", default="fixed", help="decoding policy, as `dlmrt eval --setting` [fixed]")
    parser.add_argument("--cache", default="dual", choices=("none", "prefix", "dual"),
                        help="cache mode [dual: runs both the full and the cached graph]")
    parser.add_argument("--gen-length", type=int, default=16, help="tiny model [16]")
    parser.add_argument("--block-length", type=int, default=8, help="tiny model [8]")
    parser.add_argument("--random-hidden", type=int, default=512)
    parser.add_argument("--random-layers", type=int, default=6)
    parser.add_argument("--random-heads", type=int, default=8)
    parser.add_argument("--random-head-gain", type=float, default=4.0,
                        help="scale of the random model's LM head: how peaked its predictions are [4]")
    parser.add_argument("--random-prompts", type=int, default=96)
    parser.add_argument("--random-gen-length", type=int, default=32)
    parser.add_argument("--random-block-length", type=int, default=8)
    parser.add_argument("--skip-random", action="store_true", help="the tiny model only")
    parser.add_argument("--calibration-count", type=int, default=32, help="calibration steps per graph [32]")
    parser.add_argument("--calibration-method", default="max", choices=("max", "entropy"))
    parser.add_argument("--batch", type=int, default=16, help="prompts per generate call [16]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 140)
    targets = [tiny_target] + ([] if args.skip_random else [random_target])
    results = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        for make in targets:
            result = evaluate(make(args), args, progress)
            progress.console.print(results_table(result))
            results.append(result)
    if args.json:
        document = {"command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
                    "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
                    "results": results}
        atomic.write_text(args.json, json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
