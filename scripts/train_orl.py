"""Train an ORL model (or its control, or the base further) from a base checkpoint, at small scale.

    python scripts/train_orl.py --base dlmrt/assets/tiny-llada --out dlmrt/assets/tiny-llada-orl
    python scripts/train_orl.py --base dlmrt/assets/tiny-llada --out runs/control --method control
    python scripts/train_orl.py --base dlmrt/assets/tiny-llada --out runs/further --method further
    python scripts/train_orl.py --base dlmrt/assets/tiny-llada --out runs/orl --resume   # after a stop

Each iteration rolls the current model out with dlmrt's own step loop under an aggressive policy,
keeps the states of the verified rows (the canvas, and the exact `z` and certainty each step
consumed), and trains on them: cross-entropy on the masked positions with `z` held fixed, plus the
adjacent-entropy-contraction term (`dlmrt.orl`). `--method control` runs the same loop on the base
architecture, with no residual pathway; `--method further` takes as many updates of the base's own
objective, on training examples rather than rollouts. Seeded; the defaults take about 15 minutes on 2 CPU cores.
The model is saved after every iteration with its training state, atomically; the finished model
gets training_report.json and no training state.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from dlmrt.cli.errors import print_error
from dlmrt.core import atomic, tasks
from dlmrt.core.errors import DlmrtError
from dlmrt.eval.evaluation import exact_match
from dlmrt.orl.trainer import METHODS, Run, TrainingConfig, weights_sha256
from dlmrt.runtime import Fixed

HELD_OUT_SEED = 1234
OPTIONAL_KINDS = {"adapter_hidden_size": int, "adapter_lr": float}  # the options whose default is None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, help="the base checkpoint to start from (not needed with --resume)")
    parser.add_argument("--out", type=Path, required=True, help="where the model and its training state go")
    parser.add_argument("--method", choices=tuple(METHODS), default="orl",
                        help="; ".join(f"{name}: {what}" for name, what in METHODS.items()))
    parser.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    parser.add_argument("--tasks", default=",".join(tasks.TASKS), help="comma-separated task names")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eval-per-task", type=int, default=100, help="held-out prompts per task in the report")
    defaults = TrainingConfig()
    for f in fields(TrainingConfig):
        if f.name in ("method", "tasks"):
            continue
        kind = type(getattr(defaults, f.name)) if getattr(defaults, f.name) is not None else OPTIONAL_KINDS[f.name]
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=getattr(defaults, f.name))
    return parser.parse_args()


def config_of(args: argparse.Namespace) -> TrainingConfig:
    values = {f.name: getattr(args, f.name) for f in fields(TrainingConfig) if f.name != "tasks"}
    names = tuple(name.strip() for name in args.tasks.split(",") if name.strip())
    return TrainingConfig(tasks=names, **values)


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    console = Console()
    config = config_of(args)
    try:
        if args.resume:
            run = Run.resume(args.out, config)
        else:
            if args.base is None:
                raise DlmrtError("give --base (the checkpoint to start from), or --resume to continue a run")
            run = Run.start(args.base, config, args.out)
    except DlmrtError as error:
        print_error(console, str(error))
        return 2
    started = time.perf_counter()
    done = run.iteration * config.updates
    total = config.iterations * config.updates
    columns = (TextColumn(config.method), BarColumn(), MofNCompleteColumn(),
               TextColumn("rollout EM {task.fields[em]:.1%} TPF {task.fields[tpf]:.2f}  loss {task.fields[loss]:.4f}"),
               TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task("train", total=total, completed=done, em=float("nan"), tpf=float("nan"),
                                loss=float("nan"))

        def on_iteration(record):
            em, tpf, loss = (math.nan if value is None else value
                             for value in (record.rollout_exact_match, record.rollout_tpf, record.loss))
            progress.update(bar, em=em, tpf=tpf, loss=loss)
            if not console.is_terminal:
                console.print(f"iteration {record.iteration + 1}/{config.iterations}: rollout exact-match {em:.1%}, "
                              f"TPF {tpf:.2f}, {record.states} states, loss {loss:.4f} "
                              f"({time.perf_counter() - started:.0f} s)")

        history = run.train(on_update=lambda: progress.advance(bar), on_iteration=on_iteration)
    train_seconds = time.perf_counter() - started
    report = {
        "method": config.method,
        "config": asdict(config),
        "base_weights_sha256": run.base_sha256,
        "parameters": sum(p.numel() for p in run.model.parameters()),
        "train_seconds_this_process": round(train_seconds, 1),
        "threads": args.threads,
        "history": [asdict(r) for r in history],
        "held_out_exact_match": held_out(run, config, args.eval_per_task),
    }
    run.save(with_state=False)
    report["weights_sha256"] = weights_sha256(args.out)
    atomic.write_text(args.out / "training_report.json", json.dumps(report, indent=2) + "\n")
    show(console, report)
    return 0


def held_out(run: Run, config: TrainingConfig, per_task: int) -> dict[str, dict[str, float]]:
    """Exact-match on held-out prompts at one token per step and under the rollout policy."""
    examples = tasks.examples("test", per_task, seed=HELD_OUT_SEED, tasks=config.tasks)
    settings = config.settings()
    scores = {}
    for name, policy in (("one token per step", Fixed(config.gen_length)), (config.policy, settings.policy)):
        score = exact_match(run.model, examples, replace(settings, policy=policy), mode="eager")
        scores[name] = {**score.per_task, "mean": score.mean, "tpf": score.metrics.tpf}
    return scores


def show(console: Console, report: dict) -> None:
    names = list(report["config"]["tasks"])
    table = Table(title=f"{report['method']}: held-out exact-match after {report['config']['iterations']} iterations")
    table.add_column("decoding")
    for name in (*names, "mean", "TPF"):
        table.add_column(name, justify="right")
    for decoding, scores in report["held_out_exact_match"].items():
        table.add_row(decoding, *(f"{scores[n]:.1%}" for n in (*names, "mean")), f"{scores['tpf']:.2f}")
    console.print(table)


if __name__ == "__main__":
    sys.exit(main())
