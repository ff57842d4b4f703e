"""Train the tiny LLaDA-family model that ships with dlmrt, on the synthetic task suite.

    python scripts/train_tiny.py --out DIR                          # from scratch, every task
    python scripts/train_tiny.py --init DIR --steps 2000 --lr 1e-3 --out DIR2   # continue a model
    python scripts/train_tiny.py --tasks psum,mul --gen-length 32 --block-length 32 --context 96 --out DIR

The shipped model was trained in two stages (docs/tiny-model.md): 3,000 steps from scratch
on `--tasks rev,sort,add`, then 2,000 steps from that model on every task. The third command
trains a base on the headroom tasks, whose answers take a canvas of 32.

The objective is masked-diffusion SFT as in LLaDA (`dlmrt.orl.supervised`). Everything is
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
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from dlmrt.core import atomic, tasks
from dlmrt.core.errors import DlmrtError
from dlmrt.eval.evaluation import exact_match
from dlmrt import models
from dlmrt.models import checkpoint
from dlmrt.models import SpecialTokens
from dlmrt.orl import supervised
from dlmrt.runtime import Fixed, GenerationSettings

sys.path.insert(0, str(Path(__file__).parent))
from tiny_training import parse_task_names, train_steps  # noqa: E402

def model_config(d_model: int, layers: int, heads: int, kv_heads: int, context: int = 64) -> dict:
    vocab = len(tasks.SPECIAL_TOKENS) + len(tasks.ALPHABET)
    return {
        "architectures": ["LLaDAModelLM"], "model_type": "llada",
        "d_model": d_model, "n_heads": heads, "n_kv_heads": kv_heads, "n_layers": layers,
        "mlp_hidden_size": 4 * d_model, "vocab_size": vocab, "embedding_size": vocab,
        "max_sequence_length": context, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "block_type": "llama", "activation_type": "silu", "layer_norm_type": "rms", "rope": True,
        "alibi": False, "weight_tying": False, "include_bias": False, "include_qkv_bias": False,
        "mask_token_id": tasks.MASK_ID, "eos_token_id": tasks.EOS_ID, "pad_token_id": tasks.PAD_ID,
    }


def train(args) -> dict:
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    tokenizer = tasks.build_tokenizer()
    tokens = SpecialTokens(tasks.MASK_ID, (tasks.EOS_ID,), tasks.PAD_ID)
    if args.init is not None:
        model = checkpoint.load(args.init).train()
    else:
        model = models.create(model_config(args.d_model, args.layers, args.heads, args.kv_heads, args.context),
                              tokens=tokens, seed=args.seed).train()
    tasks.check_canvas(args.tasks, args.gen_length, model.max_positions)  # before any step
    model.requires_grad_(True)
    parameters = sum(p.numel() for p in model.parameters())

    def loss_of_step() -> torch.Tensor:
        return supervised.masked_loss(model, supervised.masked_batch(
            rng, tokenizer, args.batch_size, generator, args.tasks, args.gen_length, args.block_length))

    _, train_seconds = train_steps(model, loss_of_step, args.steps, args.lr, args.weight_decay)
    model.eval().requires_grad_(False)
    model.tokenizer = tokenizer
    model.generation_config = {"gen_length": args.gen_length, "trained_gen_length": args.gen_length,
                               "block_length": args.block_length, "steps": args.gen_length}
    return {"model": model, "parameters": parameters, "train_seconds": train_seconds}


def evaluated_tasks(trained: tuple[str, ...]) -> tuple[str, ...]:
    """The tasks the report scores: the whole default suite for a model trained on part of it (as the shipped
    model's first stage was), else the tasks it was trained on."""
    return tuple(tasks.TASKS) if set(trained) <= set(tasks.TASKS) else trained


def evaluate(model, per_task: int, gen_length: int, block_length: int, names: tuple[str, ...]) -> dict[str, float]:
    settings = GenerationSettings(gen_length=gen_length, block_length=block_length, policy=Fixed(gen_length))
    held_out = tasks.examples("test", per_task, seed=1234, tasks=names)
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
    parser.add_argument("--gen-length", type=int, default=16, help="generated tokens of every training row")
    parser.add_argument("--block-length", type=int, default=8, help="block of the semi-autoregressive rows")
    parser.add_argument("--context", type=int, default=64, help="a new model's max_sequence_length")
    parser.add_argument("--init", type=Path, help="continue from this checkpoint instead of a random model")
    args = parser.parse_args()
    args.tasks = parse_task_names(parser, args.tasks)
    if args.gen_length <= 0 or args.block_length <= 0 or args.gen_length % args.block_length:
        parser.error(f"--gen-length ({args.gen_length}) must be a positive multiple of --block-length "
                     f"({args.block_length})")
    torch.set_num_threads(args.threads)

    try:
        result = train(args)
    except DlmrtError as error:
        parser.error(str(error))
    model = result["model"]
    checkpoint.save(model, args.out)
    report = {
        "parameters": result["parameters"], "train_seconds": round(result["train_seconds"], 1),
        "steps": args.steps, "batch_size": args.batch_size, "seed": args.seed,
        "config": {**{k: getattr(args, k) for k in ("d_model", "layers", "heads", "kv_heads", "lr", "gen_length",
                                                     "block_length")}, "context": model.max_positions,
                   "tasks": list(args.tasks), "init": None if args.init is None else args.init.name},
        "exact_match": {},
    }
    if args.init is not None and (args.init / "training_report.json").is_file():  # the earlier stage's, kept
        report["init_report"] = json.loads((args.init / "training_report.json").read_text())
    names = evaluated_tasks(args.tasks)
    for block_length in dict.fromkeys((args.gen_length, args.block_length)):
        scores = evaluate(model, args.eval_per_task, args.gen_length, block_length, names)
        report["exact_match"][f"block_{block_length}"] = {**scores, "mean": sum(scores.values()) / len(scores)}
    atomic.write_text(args.out / "training_report.json", json.dumps(report, indent=2) + "\n")

    table = Table(title=f"tiny model: {report['parameters']:,} parameters, "
                        f"{report['train_seconds'] / 60:.1f} min of training")
    table.add_column("decoding (one token per step)")
    for task in names:
        table.add_column(task, justify="right")
    table.add_column("mean", justify="right")
    for name, scores in report["exact_match"].items():
        table.add_row(name.replace("_", " length "), *(f"{scores[t]:.1%}" for t in (*names, "mean")))
    Console().print(table)


if __name__ == "__main__":
    main()
