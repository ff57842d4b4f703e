"""Train the tiny LLaDA-family model that ships with dlmrt, on the synthetic task suite.

    python scripts/train_tiny.py --out DIR                          # from scratch, every task
    python scripts/train_tiny.py --init DIR --steps 2000 --lr 1e-3 --out DIR2   # continue a model

The shipped model was trained in two stages (docs/tiny-model.md): 3,000 steps from scratch
on `--tasks rev,sort,add`, then 2,000 steps from that model on every task.

Masked-diffusion SFT as in LLaDA: the prompt stays clean; each row draws a
masking ratio t ~ U(0, 1) and masks that share of the response (answer, then
EOS up to GEN_LENGTH); the loss is the mean cross-entropy over masked
positions (LLaDA's 1/t weighting made this small model's training noisy).
Half the rows instead mask a random suffix of blocks entirely and part of the
block before it, as semi-autoregressive decoding sees them. Everything is
seeded; on 2 CPU cores 3,000 steps from scratch take about 10 minutes.
At the end the script measures exact-match per task on the held-out split
with one token per step and writes it beside the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from dlmrt.core import atomic, tasks
from dlmrt.eval.evaluation import exact_match
from dlmrt.export import checkpoint, models
from dlmrt.export.models import SpecialTokens
from dlmrt.runtime import Fixed, GenerationSettings

sys.path.insert(0, str(Path(__file__).parent))
from tiny_training import parse_task_names, train_steps  # noqa: E402

GEN_LENGTH = 16
BLOCK_LENGTH = 8


def model_config(d_model: int, layers: int, heads: int, kv_heads: int) -> dict:
    vocab = len(tasks.SPECIAL_TOKENS) + len(tasks.ALPHABET)
    return {
        "architectures": ["LLaDAModelLM"], "model_type": "llada",
        "d_model": d_model, "n_heads": heads, "n_kv_heads": kv_heads, "n_layers": layers,
        "mlp_hidden_size": 4 * d_model, "vocab_size": vocab, "embedding_size": vocab,
        "max_sequence_length": 64, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "block_type": "llama", "activation_type": "silu", "layer_norm_type": "rms", "rope": True,
        "alibi": False, "weight_tying": False, "include_bias": False, "include_qkv_bias": False,
        "mask_token_id": tasks.MASK_ID, "eos_token_id": tasks.EOS_ID, "pad_token_id": tasks.PAD_ID,
    }


def make_batch(rng: random.Random, tokenizer, size: int, generator: torch.Generator, task_names: tuple[str, ...]):
    """Left-padded prompts + responses: masked inputs, key mask, targets, which are masked, prompt width."""
    rows = [tasks.sample(rng.choice(task_names), "train", rng) for _ in range(size)]
    prompts = [tokenizer.encode(e.prompt).ids for e in rows]
    width = max(len(p) for p in prompts)
    ids = torch.full((size, width + GEN_LENGTH), tasks.PAD_ID, dtype=torch.long)
    key_mask = torch.zeros_like(ids, dtype=torch.bool)
    for row, (prompt, example) in enumerate(zip(prompts, rows)):
        answer = tokenizer.encode(example.answer).ids
        response = answer + [tasks.EOS_ID] * (GEN_LENGTH - len(answer))
        ids[row, width - len(prompt):width] = torch.tensor(prompt)
        ids[row, width:] = torch.tensor(response)
        key_mask[row, width - len(prompt):] = True

    t = torch.rand(size, 1, generator=generator) * (1 - 1e-3) + 1e-3
    masked = torch.rand(size, GEN_LENGTH, generator=generator) < t
    # Semi-autoregressive view for half the rows: later blocks fully masked.
    blocks = GEN_LENGTH // BLOCK_LENGTH
    suffix_start = torch.randint(1, blocks + 1, (size, 1), generator=generator) * BLOCK_LENGTH
    position = torch.arange(GEN_LENGTH)[None]
    semi_ar = torch.rand(size, 1, generator=generator) < 0.5
    in_suffix = position >= suffix_start
    in_current = (position >= suffix_start - BLOCK_LENGTH) & ~in_suffix
    masked = torch.where(semi_ar, in_suffix | (in_current & masked), masked)
    masked[masked.sum(1) == 0, -1] = True

    inputs = ids.clone()
    inputs[:, width:] = torch.where(masked, tasks.MASK_ID, ids[:, width:])
    return inputs, key_mask, ids[:, width:], masked, width


def train(args) -> dict:
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    tokenizer = tasks.build_tokenizer()
    tokens = SpecialTokens(tasks.MASK_ID, (tasks.EOS_ID,), tasks.PAD_ID)
    if args.init is not None:
        model = checkpoint.load(args.init).train()
    else:
        model = models.create(model_config(args.d_model, args.layers, args.heads, args.kv_heads),
                              tokens=tokens, seed=args.seed).train()
    model.requires_grad_(True)
    parameters = sum(p.numel() for p in model.parameters())

    def masked_loss() -> torch.Tensor:
        inputs, key_mask, targets, masked, width = make_batch(rng, tokenizer, args.batch_size, generator, args.tasks)
        logits = model.denoise(inputs, key_mask=key_mask).logits[:, width:]
        loss_per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                         reduction="none").view_as(targets)
        return (loss_per_token * masked).sum() / masked.sum()

    _, train_seconds = train_steps(model, masked_loss, args.steps, args.lr, args.weight_decay)
    model.eval().requires_grad_(False)
    model.tokenizer = tokenizer
    model.generation_config = {"gen_length": GEN_LENGTH, "trained_gen_length": GEN_LENGTH, "block_length": BLOCK_LENGTH,
                               "steps": GEN_LENGTH}
    return {"model": model, "parameters": parameters, "train_seconds": train_seconds}


def evaluate(model, per_task: int, block_length: int) -> dict[str, float]:
    settings = GenerationSettings(gen_length=GEN_LENGTH, block_length=block_length, policy=Fixed(GEN_LENGTH))
    held_out = tasks.examples("test", per_task, seed=1234)
    with Progress(TextColumn(f"exact-match, block {block_length}"), BarColumn(), MofNCompleteColumn()) as p:
        bar = p.add_task("eval", total=len(held_out))
        return exact_match(model, held_out, settings, on_batch=lambda n: p.advance(bar, n)).per_task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-per-task", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tasks", default=",".join(tasks.TASKS), help="comma-separated task names to train on")
    parser.add_argument("--init", type=Path, help="continue from this checkpoint instead of a random model")
    args = parser.parse_args()
    args.tasks = parse_task_names(parser, args.tasks)
    torch.set_num_threads(args.threads)

    result = train(args)
    model = result["model"]
    checkpoint.save(model, args.out)
    report = {
        "parameters": result["parameters"], "train_seconds": round(result["train_seconds"], 1),
        "steps": args.steps, "batch_size": args.batch_size, "seed": args.seed,
        "config": {**{k: getattr(args, k) for k in ("d_model", "layers", "heads", "kv_heads", "lr")},
                   "tasks": list(args.tasks), "init": None if args.init is None else args.init.name},
        "exact_match": {},
    }
    if args.init is not None and (args.init / "training_report.json").is_file():  # the earlier stage's, kept
        report["init_report"] = json.loads((args.init / "training_report.json").read_text())
    for block_length in (GEN_LENGTH, BLOCK_LENGTH):
        scores = evaluate(model, args.eval_per_task, block_length)
        report["exact_match"][f"block_{block_length}"] = {**scores, "mean": sum(scores.values()) / len(scores)}
    atomic.write_text(args.out / "training_report.json", json.dumps(report, indent=2) + "\n")

    table = Table(title=f"tiny model: {report['parameters']:,} parameters, "
                        f"{report['train_seconds'] / 60:.1f} min of training")
    table.add_column("decoding (one token per step)")
    for task in tasks.TASKS:
        table.add_column(task, justify="right")
    table.add_column("mean", justify="right")
    for name, scores in report["exact_match"].items():
        table.add_row(name.replace("_", " length "), *(f"{scores[t]:.1%}" for t in (*tasks.TASKS, "mean")))
    Console().print(table)


if __name__ == "__main__":
    main()
