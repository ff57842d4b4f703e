"""What the tiny-model training scripts share: the --tasks option, AdamW with a linear warmup and a cosine
decay, and the loop that steps it with a progress bar."""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from dlmrt.core import tasks
from dlmrt.core.errors import ArgumentError


def parse_task_names(parser: argparse.ArgumentParser, value: str) -> tuple[str, ...]:
    """The comma-separated task names of --tasks; a parser error unless they are task-suite tasks."""
    names = tuple(name.strip() for name in value.split(",") if name.strip())
    try:
        tasks.check_task_names(names)
    except ArgumentError as error:
        parser.error(str(error))
    return names


def train_steps(model: torch.nn.Module, loss_of_step: Callable[[], torch.Tensor], steps: int, lr: float,
                weight_decay: float) -> tuple[float, float]:
    """`steps` AdamW steps on `loss_of_step()` (gradients clipped at norm 1; the rate warms up over the first
    thirtieth, then decays on a cosine to 5%). Returns the smoothed final loss and the seconds taken."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=weight_decay)
    warmup = max(1, steps // 30)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    started = time.perf_counter()
    columns = (TextColumn("training"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]:.4f}"),
               TimeRemainingColumn())
    smoothed = float("nan")
    with Progress(*columns) as progress:
        bar = progress.add_task("train", total=steps, loss=smoothed)
        for step in range(steps):
            loss = loss_of_step()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            smoothed = loss.item() if step == 0 else 0.98 * smoothed + 0.02 * loss.item()
            progress.update(bar, advance=1, loss=smoothed)
            if not progress.console.is_terminal and (step + 1) % 250 == 0:
                progress.console.print(f"step {step + 1}/{steps}  loss {smoothed:.4f}  "
                                       f"{time.perf_counter() - started:.0f} s")
    return smoothed, time.perf_counter() - started
