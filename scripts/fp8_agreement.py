"""Token agreement of the torch path's FP8 linears (`--precision fp8`) with the model's own precision, on
the tiny trained model's held-out task prompts.

    python scripts/fp8_agreement.py --json fp8_agreement.json      # about a minute on 2 cores

Each variant decodes every prompt with the same settings (eager TorchBackend):

- float32                the shipped model as it is: the reference;
- float32, fp8 linears   the blocks' linears in FP8 (dlmrt/runtime/fp8_linear.py), what --precision fp8 runs;
- float32, fp8 + head    the same with the LM head in FP8 too, which --precision fp8 leaves alone;
- bfloat16               the model cast to bfloat16;
- bfloat16, fp8 linears  the GPU's configuration: bfloat16 with the blocks' linears in FP8.

Token agreement is the share of generated positions (the whole gen-length, end-of-sequence fill
included) equal to those of the reference; "as its dtype" compares an fp8 variant with its own dtype
without fp8. Exact match is against the task answers, the mean over tasks. Which product the linears
ran (`_scaled_mm` or the dequantize reference) is printed with the table.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import dlmrt
from dlmrt.core import atomic, tasks
from dlmrt.eval.evaluation import parse_setting
from dlmrt.runtime import GenerationSettings, Generator, fp8_linear, text
from dlmrt.runtime.fp8_linear import Fp8Linear


def variants(model) -> dict[str, tuple[object, str | None]]:
    """label -> (model, the label of the same dtype without fp8)."""
    fp8 = copy.deepcopy(model)
    fp8_linear.quantize_model(fp8)
    with_head = copy.deepcopy(fp8)
    transformer = with_head.model.transformer
    transformer["ff_out"] = Fp8Linear(transformer["ff_out"], fp8_linear.kernel_for("cpu"))
    half = copy.deepcopy(model).to(torch.bfloat16)
    half_fp8 = copy.deepcopy(half)
    fp8_linear.quantize_model(half_fp8)
    return {"float32": (model, None), "float32, fp8 linears": (fp8, "float32"),
            "float32, fp8 + head": (with_head, "float32"), "bfloat16": (half, None),
            "bfloat16, fp8 linears": (half_fp8, "bfloat16")}


def decode(model, prompts, settings, batch: int) -> tuple[torch.Tensor, list[list[int]], float]:
    generator = Generator(model, mode="eager")
    tokens, completions, started = [], [], time.perf_counter()
    for start in range(0, len(prompts), batch):
        result = generator.generate(prompts[start:start + batch], settings)
        tokens.append(result.tokens)
        completions += [row.token_ids for row in result.rows]
    return torch.cat(tokens), completions, time.perf_counter() - started


def exact_match(model, examples, completions) -> float:
    right: dict[str, list[bool]] = {}
    for example, completion in zip(examples, completions):
        right.setdefault(example.task, []).append(tasks.is_correct(example, text.decode(model, completion)))
    return sum(sum(flags) / len(flags) for flags in right.values()) / len(right)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-task", type=int, default=100, help="held-out prompts per task [100]")
    parser.add_argument("--split", default="test", choices=("test", "train"), help="task-suite split [test]")
    parser.add_argument("--setting", default="fixed", help="decoding policy, as `dlmrt eval --setting` [fixed]")
    parser.add_argument("--cache", default="dual", choices=("none", "prefix", "dual"), help="[dual]")
    parser.add_argument("--gen-length", type=int, default=16, help="[16]")
    parser.add_argument("--block-length", type=int, default=8, help="[8]")
    parser.add_argument("--batch", type=int, default=16, help="prompts per generate call [16]")
    parser.add_argument("--seed", type=int, default=0, help="picks the prompts [0]")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    args = parser.parse_args()

    model = dlmrt.load()
    examples = tasks.examples(args.split, args.per_task, args.seed)
    prompts = [text.encode(model, example.prompt) for example in examples]
    settings = GenerationSettings(args.gen_length, args.block_length, parse_setting(args.setting).policy,
                                  cache=args.cache)
    console = Console(width=120)
    decoded, rows = {}, []
    for label, (variant, own) in variants(model).items():
        with console.status(f"decoding {len(prompts)} prompts: {label}"):
            tokens, completions, seconds = decode(variant, prompts, settings, args.batch)
        decoded[label] = tokens
        reference = decoded["float32"]
        rows.append({"variant": label,
                     "agreement_with_float32": (tokens == reference).float().mean().item(),
                     "rows_as_float32": (tokens == reference).all(dim=1).float().mean().item(),
                     "agreement_with_own_dtype": None if own is None else
                     (tokens == decoded[own]).float().mean().item(),
                     "exact_match": exact_match(model, examples, completions), "seconds": round(seconds, 1)})
    table = Table(title=f"tiny-llada: {len(prompts)} {args.split} prompts, {settings.policy.name}, cache "
                        f"{settings.cache}, gen-length {settings.gen_length}, blocks of {settings.block_length}",
                  caption=f"fp8 product on this CPU: {fp8_linear.kernel_for('cpu')} (torch {torch.__version__})")
    for header in ("variant", "tokens as float32", "rows as float32", "tokens as its dtype", "exact match", "s"):
        table.add_column(header, justify="left" if header == "variant" else "right")
    for row in rows:
        own = row["agreement_with_own_dtype"]
        table.add_row(row["variant"], f"{row['agreement_with_float32']:.2%}", f"{row['rows_as_float32']:.2%}",
                      "-" if own is None else f"{own:.2%}", f"{row['exact_match']:.2%}", f"{row['seconds']:.1f}")
    console.print(table)
    if args.json is not None:
        document = {"settings": vars(args) | {"json": str(args.json)}, "torch": torch.__version__,
                    "fp8_kernel": fp8_linear.kernel_for("cpu"), "rows": rows}
        atomic.write_text(args.json, json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
