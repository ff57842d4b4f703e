"""Benchmark the step loop against the reference loop, side by side in one run.

    python scripts/bench_step_loop.py --repeats 3 --json bench.json

Two models:
- the tiny model on a batch of held-out task-suite prompts (gen 16, block 8), where
  the policies also decide quality: token agreement of each cache mode with `none`
  and exact-match are reported over the whole held-out set;
- a larger random-weight LLaDA config (hidden 1024, 8 layers, 256 generated tokens
  in blocks of 32, one prompt of 32 tokens). Random weights are never confident, so
  threshold decoding commits one token per step there: its speed-up comes from the
  caches alone. Rows decode the full length (--ignore-eos), as the reference does.

Each configuration runs `--repeats` times after a short warm-up; the tables show
medians. Host overhead is the share of wall time spent outside the backend. On 2
cores the whole run takes about 10 minutes, most of it the reference loop on the
larger config.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import dlmrt
from dlmrt.core import atomic, tasks
from dlmrt.bench.benchmark import measure, speed_table
from dlmrt.bench.case import Case
from dlmrt.eval.evaluation import exact_match
from dlmrt import models
from dlmrt.models import SpecialTokens
from dlmrt.runtime import Fixed, GenerationSettings, Generator, Threshold, reference, text

LARGE_LLADA = {
    "architectures": ["LLaDAModelLM"], "model_type": "llada", "d_model": 1024, "n_heads": 16,
    "n_layers": 8, "mlp_hidden_size": 2816, "vocab_size": 4096, "max_sequence_length": 1024,
    "rope_theta": 10000.0, "block_type": "llama", "activation_type": "silu", "layer_norm_type": "rms",
    "rope": True, "alibi": False, "weight_tying": False,
}
LARGE_TOKENS = SpecialTokens(mask_id=4095, eos_ids=(4094,), pad_id=4094)


def cases(model, prompts, gen_length: int, block_length: int, *, compare_policies: bool) -> list[Case]:
    """The reference first. Without `compare_policies` only the cached threshold runs follow it (for
    random weights the others cost what the reference costs: a full forward per token)."""
    def generator(policy, cache):
        settings = GenerationSettings(gen_length, block_length, policy, cache=cache, ignore_eos=True)
        return lambda: Generator(model, mode="eager").generate(prompts, settings).metrics

    one_per_step = GenerationSettings(gen_length, block_length, Fixed(gen_length))
    uncached = [Case("fixed, cache none", generator(Fixed(gen_length), "none")),
                Case("threshold 0.9, cache none", generator(Threshold(0.9), "none"))]
    return [
        Case("reference loop (fixed, 1 token/step)",
             lambda: reference.generate(model, prompts, one_per_step).metrics),
        *(uncached if compare_policies else []),
        Case("threshold 0.9, cache prefix", generator(Threshold(0.9), "prefix")),
        Case("threshold 0.9, cache dual", generator(Threshold(0.9), "dual")),
    ]


def warm_up(model, prompts, block_length):
    return lambda: Generator(model, mode="eager").generate(prompts[:1], GenerationSettings(block_length, block_length,
                                                                              Threshold(0.9), cache="dual"))


def agreement(model, prompts, gen_length, block_length, examples, progress) -> list[dict]:
    """Per policy and cache mode: token agreement with cache none, and exact-match."""
    rows = []
    task = progress.add_task("cache agreement (tiny)", total=6)
    for policy in (Fixed(gen_length), Threshold(0.9)):
        baseline = None
        for cache in ("none", "prefix", "dual"):
            settings = GenerationSettings(gen_length, block_length, policy, cache=cache, ignore_eos=True)
            tokens = Generator(model, mode="eager", max_batch=len(prompts)).generate(prompts, settings).tokens
            if baseline is None:
                baseline = tokens
            score = exact_match(model, examples, settings, mode="eager")
            rows.append({"policy": policy.name, "cache": cache,
                         "token_agreement": float((tokens == baseline).float().mean()),
                         "rows_identical": float((tokens == baseline).all(-1).float().mean()),
                         "exact_match": sum(score.per_task.values()) / len(score.per_task),
                         "tpf": score.metrics.tpf})
            progress.advance(task)
    return rows


def agreement_table(rows: list[dict]) -> Table:
    table = Table(title="tiny model: cache modes against cache none (held-out task suite)")
    for column in ("policy", "cache", "token agreement", "rows identical", "exact-match", "TPF"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["policy"], row["cache"], f"{row['token_agreement']:.2%}",
                      f"{row['rows_identical']:.2%}", f"{row['exact_match']:.2%}", f"{row['tpf']:.2f}")
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (median)")
    parser.add_argument("--tiny-batch", type=int, default=32, help="held-out prompts per tiny-model call")
    parser.add_argument("--per-task", type=int, default=100, help="held-out prompts per task for agreement")
    parser.add_argument("--skip-large", action="store_true", help="only the tiny model")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    torch.manual_seed(0)
    console = Console(width=None if sys.stdout.isatty() else 140)
    results: dict[str, object] = {"torch": torch.__version__, "threads": torch.get_num_threads()}

    with Progress(console=console, transient=True) as progress:
        tiny = dlmrt.load()
        examples = tasks.examples("test", args.per_task, seed=1234)
        prompts = [text.encode(tiny, e.prompt) for e in examples[:args.tiny_batch]]
        all_prompts = [text.encode(tiny, e.prompt) for e in examples]
        results["tiny"] = measure(cases(tiny, prompts, 16, 8, compare_policies=True), args.repeats, progress,
                                  "tiny model", warm_up(tiny, prompts, 8))
        progress.console.print(speed_table(f"tiny model, batch of {args.tiny_batch}, gen 16, block 8",
                                           results["tiny"]))
        results["tiny_agreement"] = agreement(tiny, all_prompts, 16, 8, examples, progress)
        progress.console.print(agreement_table(results["tiny_agreement"]))
        if not args.skip_large:
            large = models.create(LARGE_LLADA, tokens=LARGE_TOKENS, seed=0)
            prompt = torch.randint(0, 4000, (32,), generator=torch.Generator().manual_seed(0)).tolist()
            results["large"] = measure(cases(large, [prompt], 256, 32, compare_policies=False), args.repeats,
                                       progress, "llada d1024 x 8 layers, 256 tokens",
                                       warm_up(large, [prompt], 32))
            progress.console.print(speed_table(
                "random llada d1024 x 8 layers, batch 1, prompt 32, gen 256, block 32", results["large"]))
    if args.json:
        atomic.write_text(args.json, json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
