"""How often the prefix and dual caches give the tokens of no cache, per model and threshold.

    python scripts/cache_agreement.py --model tests/data/dream --prompts 64

A bidirectional model's caches are approximate (the cached K/V of the prefix and suffix were computed
at the block's start), so their tokens may differ from a full recompute; a block-causal model's block
cache is exact. Prompts are random token ids (seeded), so any checkpoint works. Prints, for each
threshold and cache mode, the share of generated positions and of whole rows that equal no cache.
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

import dlmrt
from dlmrt.runtime import GenerationSettings, Generator, Threshold


def random_prompts(vocab: int, special: set[int], count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([t for t in range(vocab) if t not in special])
    lengths = torch.randint(2, 9, (count,), generator=generator)
    return [allowed[torch.randint(0, len(allowed), (int(n),), generator=generator)].tolist() for n in lengths]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--gen-length", type=int, default=16)
    parser.add_argument("--block-length", type=int, default=4)
    parser.add_argument("--threshold", type=float, action="append", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = dlmrt.load(args.model)
    tokens = model.tokens
    prompts = random_prompts(model.vocab_size, {tokens.mask_id, tokens.pad_id, *tokens.eos_ids}, args.prompts,
                             args.seed)
    generator = Generator(model, mode="eager")
    caches = ("prefix",) if model.block_causal else ("prefix", "dual")
    table = Table(title=f"{model.name}: tokens equal to no cache ({args.prompts} prompts, gen-length "
                        f"{args.gen_length}, blocks of {args.block_length})")
    for column in ("threshold", "cache", "positions", "rows", "forwards vs none"):
        table.add_column(column, justify="right")
    for threshold in args.threshold or [0.9, 0.5, 0.2]:
        def run(cache: str):
            settings = GenerationSettings(args.gen_length, args.block_length, Threshold(threshold), cache=cache,
                                          ignore_eos=True)
            return generator.generate(prompts, settings)
        plain = run("none")
        for cache in caches:
            cached = run(cache)
            same = cached.tokens == plain.tokens
            table.add_row(f"{threshold}", cache, f"{same.float().mean():.1%}", f"{same.all(-1).float().mean():.1%}",
                          f"{cached.metrics.nfe} / {plain.metrics.nfe}")
    Console().print(table)


if __name__ == "__main__":
    main()
