"""`dlmrt eval`: exact-match and speed over a grid of decoding settings (`dlmrt.eval.evaluation`), printed as
a table, and written as JSON and a plot on request."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import click

from dlmrt.cli.backends import BACKENDS, once, open_backend
from dlmrt.cli.errors import reports_errors
from dlmrt.cli.model_param import model_param
from dlmrt.cli.options import MODE_NAMES, MODEL_HELP, backend_options, eval_decoding_options

if TYPE_CHECKING:
    from rich.table import Table

    from dlmrt.core.tasks import Example
    from dlmrt.eval.evaluation import Setting, SettingScore
    from dlmrt.runtime import GenerationSettings
    from dlmrt.runtime.backend import Backend


@click.command("eval")
@model_param(help=MODEL_HELP)
@click.option("--data", type=click.Path(path_type=Path, dir_okay=False), default=None, metavar="FILE.jsonl",
              help='Examples as JSONL: {"prompt": ..., "answer": ..., "task": ...} per line ("task" is '
                   "optional) [default: the task suite].")
@click.option("--tasks", "task_names", default=None, metavar="rev,sort,add",
              help="Task-suite tasks, comma-separated [default: rev,sort,add,same; the headroom tasks psum and "
                   "mul, which need --gen-length 32, only by name].")
@click.option("--per-task", type=click.IntRange(min=1), default=None,
              help="Task-suite examples per task [default: 100].")
@click.option("--split", type=click.Choice(("test", "train")), default=None,
              help="Task-suite split [default: test, the held-out prompts].")
@click.option("--data-seed", type=int, default=None, help="Seed that picks the task-suite examples [default: 0].")
@click.option("--setting", "setting_specs", multiple=True, metavar="POLICY[:key=value,...]",
              help="A decoding setting, e.g. fixed:steps=8, threshold:threshold=0.9,confidence=margin, "
                   "factor:factor=2, llada2:threshold=0.9,steps=8. Repeat for a grid [default: fixed at 1, "
                   "1/2 and 1/4 token per step, threshold 0.5-0.99, factor 1, 2, 4, 8].")
@eval_decoding_options
@click.option("--backend", type=click.Choice(BACKENDS), default="torch", show_default=True,
              help="torch: the step loop in PyTorch (see --mode); ort: the exported graphs in ONNX Runtime (--model "
                   "an export, or a model directory exported on first use); trt: the TensorRT engines stored for "
                   "this GPU (--model the export they were built from).")
@click.option("--mode", type=click.Choice(MODE_NAMES), default="auto", show_default=True,
              help="torch backend: eager, compile, cudagraph; auto is cudagraph on CUDA, and on a CPU compile "
                   "where the evaluation's work repays compiling, else eager.")
@backend_options
@click.option("--batch-size", type=click.IntRange(min=1), default=64, show_default=True,
              help="Examples decoded together.")
@click.option("--json", "json_path", type=click.Path(path_type=Path, dir_okay=False), default=None,
              metavar="PATH", help="Also write the results as JSON.")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path, dir_okay=False), default=None,
              metavar="PATH.png", help="Also plot exact-match against tokens per forward (needs matplotlib).")
@reports_errors
def evaluate(model_dir, data, task_names, per_task, split, data_seed, setting_specs, gen_length, block_length,
             cache, temperature, seed, dtype, steps_per_sync, backend, mode, device, engines, precision,
             batch_size, json_path, plot_path):
    """Exact-match and speed over a grid of decoding settings: the speed-quality curve."""
    suite_options = {"--tasks": task_names, "--per-task": per_task, "--split": split, "--data-seed": data_seed}
    if data is not None and any(value is not None for value in suite_options.values()):
        given = ", ".join(name for name, value in suite_options.items() if value is not None)
        raise click.UsageError(f"--data replaces the task suite: drop {given}")

    from dlmrt.eval import evaluation

    if plot_path is not None:
        if plot_path.suffix.lower() != ".png":
            raise click.BadParameter(f"the plot is a PNG: give a path ending in .png, got {str(plot_path)!r}",
                                     param_hint="--plot")
        evaluation.require_matplotlib()
    grid = [evaluation.parse_setting(spec) for spec in setting_specs]
    if data is not None:
        examples = evaluation.load_jsonl(data)
    else:
        examples = suite_examples(task_names, per_task or 100, split or "test", data_seed or 0)

    from rich.console import Console

    @once
    def base_and_grid(model):
        return evaluation.base_and_grid(model, grid, gen_length=gen_length, block_length=block_length,
                                        temperature=temperature, seed=seed, cache=cache,
                                        steps_per_sync=steps_per_sync)

    model, backend_impl = open_backend(
        backend, model_dir, dtype=dtype, mode=mode, max_batch=batch_size, device=device, engines=engines,
        precision=precision, console=Console(stderr=True),
        work=lambda model: evaluation.grid_work(model, examples, *base_and_grid(model), batch_size))
    base, grid = base_and_grid(model)
    gen_length, block_length = base.gen_length, base.block_length
    results = run_grid(model, backend_impl, examples, base, grid, batch_size)

    title = f"{model.name}: {len(examples)} examples, gen-length {gen_length}, block-length {block_length}"
    print_table(results_table(results, title))
    if json_path is not None:
        from dlmrt.core import atomic

        document = evaluation.results_document(model.name, len(examples), base, results)
        atomic.write_text(json_path, json.dumps(document, indent=2) + "\n")
    if plot_path is not None:
        evaluation.write_plot(results, plot_path, title)


def suite_examples(task_names: str | None, per_task: int, split: str, seed: int) -> list[Example]:
    from dlmrt.core import tasks

    chosen = tuple(tasks.TASKS) if task_names is None else \
        tuple(dict.fromkeys(name.strip() for name in task_names.split(",") if name.strip()))
    unknown = [name for name in chosen if name not in tasks.ALL_TASKS]
    if unknown or not chosen:
        raise click.BadParameter(f"expected task names from {', '.join(tasks.ALL_TASKS)}, comma-separated; "
                                 f"got {task_names!r}", param_hint="--tasks")
    return tasks.examples(split, per_task, seed, chosen)


def run_grid(model, backend: Backend, examples: Sequence[Example], base: GenerationSettings,
             grid: Sequence[Setting], batch_size: int) -> list[SettingScore]:
    """evaluation.evaluate_grid with a progress bar on stderr (on a terminal)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from dlmrt.eval import evaluation

    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("evaluating", total=len(examples) * len(grid))

        def advance(setting: Setting, count: int) -> None:
            bar.update(task, advance=count, description=setting.label)

        return evaluation.evaluate_grid(model, examples, base, grid, batch_size, on_batch=advance, backend=backend)


def print_table(table: Table) -> None:
    """On stdout: fitted to a terminal, at full width elsewhere (a file or pipe gets whole labels)."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        unbounded = console.options.update_width(10_000)
        console.width = max(console.width, console.measure(table, options=unbounded).maximum)
    console.print(table)


def results_table(results: Sequence[SettingScore], title: str) -> Table:
    """One row per setting, in the order given: exact-match per task and mean, then speed."""
    from rich.table import Table

    task_names = list(dict.fromkeys(task for r in results for task in r.score.per_task))
    table = Table(title=title)
    table.add_column("setting")
    for name in (*task_names, "mean"):
        table.add_column(name, justify="right")
    for name in ("TPF", "tokens/s", "NFE"):
        table.add_column(name, justify="right")
    for r in results:
        scores = [f"{r.score.per_task[name]:.1%}" for name in task_names]
        metrics = r.score.metrics
        table.add_row(r.setting.label, *scores, f"{r.score.mean:.1%}", f"{metrics.tpf:.2f}",
                      f"{metrics.tokens_per_s:.0f}", f"{metrics.nfe}")
    return table
