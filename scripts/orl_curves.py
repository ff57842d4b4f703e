"""The speed-quality curves of several models over one grid, with TPF compared at matched exact-match:
the measurement of ORL's gain (base, control and ORL in one run).

    python scripts/orl_curves.py --model base=dlmrt/assets/tiny-llada --model control=runs/control \\
        --model orl=dlmrt/assets/tiny-llada-orl --per-task 300 --plot docs/orl-curves.png --json curves.json

Every model decodes the same held-out prompts (the task suite's test split, as `dlmrt eval` draws
them) under every setting of the grid, through `dlmrt.eval.evaluation.evaluate_grid`, the code of `dlmrt
eval`. The first model is the reference of the matched comparison: TPF at its best exact-match and
at one point (1%) below it (`dlmrt.orl.comparison`), and at each `--target`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import dlmrt
from dlmrt.core import atomic, tasks
from dlmrt.eval import evaluation
from dlmrt.core.errors import DlmrtError
from dlmrt.orl import comparison
from dlmrt.runtime import Fixed, GenerationSettings

GRID = (*(f"fixed:steps={s}" for s in (16, 8, 4, 2)),
        *(f"threshold:threshold={t}" for t in (0.99, 0.9, 0.7, 0.5, 0.3, 0.1)),
        *(f"factor:factor={f}" for f in (1, 2, 4, 8, 16)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", required=True, metavar="NAME=DIR",
                        help="a model to compare; repeat (the first is the reference)")
    parser.add_argument("--setting", action="append", help=f"a grid setting; repeat [default: {', '.join(GRID)}]")
    parser.add_argument("--per-task", type=int, default=300)
    parser.add_argument("--data-seed", type=int, default=1234)
    parser.add_argument("--mode", default="eager", help="the torch backend's mode (eager or compile)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--target", type=float, action="append", default=[], metavar="FRACTION",
                        help="also compare TPF at this mean exact-match (e.g. 0.99); repeat")
    parser.add_argument("--plot", type=Path, help="write the curves as a PNG")
    parser.add_argument("--json", type=Path, help="write every result as JSON")
    parser.add_argument("--markdown", type=Path, help="write the tables as Markdown")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    console = Console()
    try:
        models = dict(parse_model(spec) for spec in args.model)
        grid = [evaluation.parse_setting(spec) for spec in (args.setting or GRID)]
        if args.plot is not None:
            evaluation.require_matplotlib()
        loaded = {name: dlmrt.load(path) for name, path in models.items()}
    except DlmrtError as error:
        console.print(f"[red]error:[/red] {error}")
        return 2
    examples = tasks.examples("test", args.per_task, seed=args.data_seed)
    base = GenerationSettings(gen_length=16, block_length=8, policy=Fixed())
    curves = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        bar = progress.add_task("evaluating", total=len(models) * len(grid) * len(examples))
        for name, model in loaded.items():
            def advance(setting, rows, name=name):
                progress.update(bar, advance=rows, description=f"{name}: {setting.label}")
            curves[name] = evaluation.evaluate_grid(model, examples, base, grid, on_batch=advance, mode=args.mode)
    levels = [*comparison.targets(next(iter(curves.values()))), *args.target]
    points = comparison.matched(curves, levels)
    console.print(curve_table(curves))
    console.print(matched_table(points, curves))
    if args.markdown is not None:
        atomic.write_text(args.markdown, markdown(curves, points))
    if args.json is not None:
        document = {name: evaluation.results_document(name, len(examples), base, results)
                    for name, results in curves.items()}
        document["matched"] = [vars(p) for p in points]
        atomic.write_text(args.json, json.dumps(document, indent=2) + "\n")
    if args.plot is not None:
        evaluation.write_comparison_plot(curves, args.plot, f"{len(examples)} held-out prompts, gen 16, blocks of 8")
    return 0


def parse_model(spec: str) -> tuple[str, Path]:
    name, equals, path = spec.partition("=")
    if not equals or not name or not path:
        raise DlmrtError(f"--model takes NAME=DIR, e.g. base=dlmrt/assets/tiny-llada; got {spec!r}")
    return name, Path(path)


def curve_table(curves) -> Table:
    table = Table(title="mean exact-match / TPF on the same grid")
    table.add_column("setting")
    for name in curves:
        table.add_column(name, justify="right")
    for index, result in enumerate(next(iter(curves.values()))):
        table.add_row(result.setting.label, *(f"{r[index].score.mean:.1%} / {r[index].score.metrics.tpf:.2f}"
                                              for r in curves.values()))
    return table


def matched_rows(points, names: list[str], code: str = "") -> list[tuple[str, list[str]]]:
    """Each target's label and one cell per model: TPF, its ratio to the first model's, the setting
    (between `code` marks)."""
    reference = names[0]
    rows = []
    for target in dict.fromkeys(p.target for p in points):
        row = {p.model: p for p in points if p.target == target}
        cells = []
        for name in names:
            point = row[name]
            if point.tpf is None:
                cells.append("not reached")
            elif name == reference or not row[reference].tpf:
                cells.append(f"{point.tpf:.2f} ({code}{point.setting}{code})")
            else:
                cells.append(f"{point.tpf:.2f}, {point.tpf / row[reference].tpf:.2f}x ({code}{point.setting}{code})")
        rows.append((f">= {target:.1%}", cells))
    return rows


def matched_table(points, curves) -> Table:
    names = list(curves)
    table = Table(title=f"TPF at matched exact-match (targets from {names[0]})")
    table.add_column("target exact-match")
    for name in names:
        table.add_column(name, justify="right")
    for label, cells in matched_rows(points, names):
        table.add_row(label, *cells)
    return table


def markdown(curves, points) -> str:
    names = list(curves)
    lines = ["| setting | " + " | ".join(f"{n} EM | {n} TPF" for n in names) + " |",
             "|---|" + "---|---|" * len(names)]
    for index, result in enumerate(next(iter(curves.values()))):
        cells = " | ".join(f"{r[index].score.mean:.1%} | {r[index].score.metrics.tpf:.2f}" for r in curves.values())
        lines.append(f"| `{result.setting.label}` | {cells} |")
    lines += ["", "| target exact-match | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in matched_rows(points, names, "`")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
