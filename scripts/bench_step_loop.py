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
medians. Host overhead is the share of wall time spent outside Backend.step. On 2
cores the whole run takes about 10 minutes, most of it the reference loop on the
larger config.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import dlmrt
from dlmrt import atomic, tasks
from dlmrt.evaluation import exact_match
from dlmrt.export import models
from dlmrt.export.models import SpecialTokens
from dlmrt.runtime import Fixed, GenerationMetrics, GenerationSettings, Generator, Threshold, reference, text

LARGE_LLADA = {
    "architectures": ["LLaDAModelLM"], "model_type": "llada", "d_model": 1024, "n_heads": 16,
    "n_layers": 8, "mlp_hidden_size": 2816, "vocab_size": 4096, "max_sequence_length": 1024,
    "rope_theta": 10000.0, "block_type": "llama", "activation_type": "silu", "layer_norm_type": "rms",
    "rope": True, "alibi": False, "weight_tying": False,
}
LARGE_TOKENS = SpecialTokens(mask_id=4095, eos_ids=(4094,), pad_id=4094)


def cases(gen_length: int, block_length: int, *, compare_policies: bool) -> list[tuple[str, Callable]]:
    """(label, run(model, prompts) -> metrics), the reference first. Without `compare_policies`
    only the cached threshold runs follow it (for random weights the others cost what the reference
    costs: a full forward per token)."""
    def generator(policy, cache):
        settings = GenerationSettings(gen_length, block_length, policy, cache=cache, ignore_eos=True)
        return lambda model, prompts: Generator(model).generate(prompts, settings).metrics

    one_per_step = GenerationSettings(gen_length, block_length, Fixed(gen_length))
    uncached = [("fixed, cache none", generator(Fixed(gen_length), "none")),
                ("threshold 0.9, cache none", generator(Threshold(0.9), "none"))]
    return [
        ("reference loop (fixed, 1 token/step)", lambda m, p: reference.generate(m, p, one_per_step).metrics),
        *(uncached if compare_policies else []),
        ("threshold 0.9, cache prefix", generator(Threshold(0.9), "prefix")),
        ("threshold 0.9, cache dual", generator(Threshold(0.9), "dual")),
    ]


def measure(model, prompts, gen_length, block_length, repeats, progress, title, *,
            compare_policies: bool) -> list[dict]:
    configurations = cases(gen_length, block_length, compare_policies=compare_policies)
    task = progress.add_task(title, total=len(configurations) * repeats + 1)
    warm_up = GenerationSettings(block_length, block_length, Threshold(0.9), cache="dual")
    Generator(model).generate(prompts[:1], warm_up)
    progress.advance(task)
    rows = []
    for label, run in configurations:
        runs: list[GenerationMetrics] = []
        for _ in range(repeats):
            runs.append(run(model, prompts))
            progress.advance(task)
        rows.append({"setting": label,
                     "tokens_per_s": statistics.median(m.tokens_per_s for m in runs),
                     "latency_s": statistics.median(m.latency_s for m in runs),
                     "host_fraction": statistics.median(m.host_fraction for m in runs),
                     "tpf": runs[0].tpf, "nfe": runs[0].nfe})
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / base
    return rows


def agreement(model, prompts, gen_length, block_length, examples, progress) -> list[dict]:
    """Per policy and cache mode: token agreement with cache none, and exact-match."""
    rows = []
    task = progress.add_task("cache agreement (tiny)", total=6)
    for policy in (Fixed(gen_length), Threshold(0.9)):
        baseline = None
        for cache in ("none", "prefix", "dual"):
            settings = GenerationSettings(gen_length, block_length, policy, cache=cache, ignore_eos=True)
            tokens = Generator(model).generate(prompts, settings).tokens
            if baseline is None:
                baseline = tokens
            score = exact_match(model, examples, settings)
            rows.append({"policy": policy.name, "cache": cache,
                         "token_agreement": float((tokens == baseline).float().mean()),
                         "rows_identical": float((tokens == baseline).all(-1).float().mean()),
                         "exact_match": sum(score.per_task.values()) / len(score.per_task),
                         "tpf": score.metrics.tpf})
            progress.advance(task)
    return rows


def speed_table(title: str, rows: list[dict]) -> Table:
    table = Table(title=title)
    for column in ("setting", "tokens/s (median)", "vs reference", "TPF", "NFE", "latency", "host overhead"):
        table.add_column(column, justify="left" if column == "setting" else "right")
    for row in rows:
        table.add_row(row["setting"], f"{row['tokens_per_s']:.1f}", f"{row['speedup']:.2f}x",
                      f"{row['tpf']:.2f}", str(row["nfe"]), f"{row['latency_s'] * 1e3:.0f} ms",
                      f"{row['host_fraction']:.1%}")
    return table


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
        results["tiny"] = measure(tiny, prompts, 16, 8, args.repeats, progress, "tiny model",
                                  compare_policies=True)
        progress.console.print(speed_table(f"tiny model, batch of {args.tiny_batch}, gen 16, block 8",
                                           results["tiny"]))
        results["tiny_agreement"] = agreement(tiny, all_prompts, 16, 8, examples, progress)
        progress.console.print(agreement_table(results["tiny_agreement"]))
        if not args.skip_large:
            large = models.create(LARGE_LLADA, tokens=LARGE_TOKENS, seed=0)
            prompt = torch.randint(0, 4000, (32,), generator=torch.Generator().manual_seed(0)).tolist()
            results["large"] = measure(large, [prompt], 256, 32, args.repeats, progress,
                                       "llada d1024 x 8 layers, 256 tokens", compare_policies=False)
            progress.console.print(speed_table(
                "random llada d1024 x 8 layers, batch 1, prompt 32, gen 256, block 32", results["large"]))
    if args.json:
        atomic.write_text(args.json, json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
