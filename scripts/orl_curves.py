"""The speed-quality curves of several models over one grid, with TPF compared at matched exact-match:
the measurement of ORL's gain (base, control and ORL in one run, each over its training seeds).

    python scripts/orl_curves.py --model base=dlmrt/assets/tiny-llada --model control=runs/control \\
        --model orl=dlmrt/assets/tiny-llada-orl --per-task 300 --plot docs/orl-curves.png --json curves.json
    python scripts/orl_curves.py --grid headroom --tasks psum,mul --gen-length 32 --block-length 32 \\
        --model further=runs/further-0 --model further=runs/further-1 ... --model orl=runs/orl-2 \\
        --below 0.01 --below 0.03 --plot docs/orl-headroom.png

A name given more than once is one model trained with several seeds: each seed is a curve, and every
figure is their mean with the range (lowest to highest seed). Every model decodes the same held-out
prompts (the task suite's test split, as `dlmrt eval` draws them) under every setting of the grid,
through `dlmrt.eval.evaluation.evaluate_grid`, the code of `dlmrt eval`. The first model is the
reference of the matched comparison: TPF at its best exact-match less each `--below`
(`dlmrt.orl.comparison`), and at each `--target`. A model is called faster than another only where
the ranges do not overlap. The rules table repeats the comparison within each commit rule of the grid
(the threshold on the token's probability against the threshold on the certainty `1 - H / log V`).
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
from dlmrt.cli.errors import print_error
from dlmrt.core import atomic, tasks
from dlmrt.core.errors import DlmrtError
from dlmrt.eval import evaluation
from dlmrt.orl import comparison
from dlmrt.runtime import Fixed, GenerationSettings

GRIDS = {
    # The default suite: 16 tokens in blocks of 8.
    "suite": (*(f"fixed:steps={s}" for s in (16, 8, 4, 2)),
              *(f"threshold:threshold={t}" for t in (0.99, 0.9, 0.7, 0.5, 0.3, 0.1)),
              *(f"factor:factor={f}" for f in (1, 2, 4, 8, 16))),
    # The headroom tasks: 32 tokens in one block; the threshold on probability and on certainty.
    "headroom": (*(f"fixed:steps={s}" for s in (32, 8)),
                 *(f"threshold:threshold={t}" for t in (0.9, 0.7, 0.5, 0.3)),
                 *(f"threshold:threshold={t},confidence=entropy" for t in (0.7, 0.5, 0.3, 0.2))),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", required=True, metavar="NAME=DIR",
                        help="a model to compare; repeat (the first is the reference; a repeated name is a seed)")
    parser.add_argument("--grid", choices=tuple(GRIDS), default="suite", help="the settings to decode under")
    parser.add_argument("--setting", action="append", help="a grid setting instead; repeat")
    parser.add_argument("--tasks", default=",".join(tasks.TASKS), help="comma-separated task names")
    parser.add_argument("--gen-length", type=int, default=16)
    parser.add_argument("--block-length", type=int, default=8)
    parser.add_argument("--per-task", type=int, default=300)
    parser.add_argument("--data-seed", type=int, default=1234)
    parser.add_argument("--mode", default="eager", help="the torch backend's mode (eager or compile)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--below", type=float, action="append", metavar="FRACTION",
                        help="compare TPF at the reference's best exact-match less this (e.g. 0.01 for one point); "
                             "repeat [default: 0 and 0.01]")
    parser.add_argument("--target", type=float, action="append", default=[], metavar="FRACTION",
                        help="also compare TPF at this mean exact-match (e.g. 0.99); repeat")
    parser.add_argument("--plot", type=Path, help="write the curves as a PNG")
    parser.add_argument("--json", type=Path, help="write every result as JSON")
    parser.add_argument("--markdown", type=Path, help="write the tables as Markdown")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    console = Console()
    try:
        models = parse_models(args.model)
        grid = [evaluation.parse_setting(spec) for spec in (args.setting or GRIDS[args.grid])]
        names = tuple(name.strip() for name in args.tasks.split(",") if name.strip())
        tasks.check_canvas(names, args.gen_length)
        base = GenerationSettings(gen_length=args.gen_length, block_length=args.block_length, policy=Fixed())
        base.validate()
        if args.plot is not None:
            evaluation.require_matplotlib()
        loaded = {name: [dlmrt.load(path) for path in paths] for name, paths in models.items()}
        for name, seeds in loaded.items():
            for path, model in zip(models[name], seeds):
                try:
                    tasks.check_canvas(names, args.gen_length, model.max_positions)
                except DlmrtError as error:
                    raise DlmrtError(f"{path}: {error}") from None
    except DlmrtError as error:
        print_error(console, str(error))
        return 2
    examples = tasks.examples("test", args.per_task, seed=args.data_seed, tasks=names)
    curves: dict[str, list[comparison.Curve]] = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        runs = sum(len(seeds) for seeds in loaded.values())
        bar = progress.add_task("evaluating", total=runs * len(grid) * len(examples))
        for name, seeds in loaded.items():
            curves[name] = []
            for seed, model in enumerate(seeds):
                def advance(setting, rows, label=f"{name} #{seed}"):
                    progress.update(bar, advance=rows, description=f"{label}: {setting.label}")
                curves[name].append(evaluation.evaluate_grid(model, examples, base, grid, on_batch=advance,
                                                             mode=args.mode))
    reference = next(iter(curves.values()))
    levels = [*comparison.targets(reference, args.below or (0.0, 0.01)), *args.target]
    points = comparison.matched(curves, levels)
    rules = {rule: comparison.matched(part, levels) for rule, part in comparison.by_rule(curves).items()}
    console.print(curve_table(curves))
    title = f"TPF at matched exact-match (targets from {next(iter(curves))})"
    console.print(matched_table(points, list(curves), title))
    if len(rules) > 1:
        for rule, rule_points in rules.items():
            console.print(matched_table(rule_points, list(curves), f"the same, {rule} settings only"))
    if args.markdown is not None:
        atomic.write_text(args.markdown, markdown(curves, points, rules))
    if args.json is not None:
        document = {"models": {name: [evaluation.results_document(f"{name} #{seed}", len(examples), base, curve)
                                      for seed, curve in enumerate(seeds)]
                               for name, seeds in curves.items()},
                    "checkpoints": {name: [str(path) for path in paths] for name, paths in models.items()},
                    "matched": [point_document(p) for p in points],
                    "by_rule": {rule: [point_document(p) for p in rule_points] for rule, rule_points in rules.items()}}
        atomic.write_text(args.json, json.dumps(document, indent=2) + "\n")
    if args.plot is not None:
        write_band_plot(curves, args.plot, f"{len(examples)} held-out prompts ({', '.join(names)}), gen "
                                           f"{args.gen_length}, blocks of {args.block_length}")
    return 0


def parse_models(specs: list[str]) -> dict[str, list[Path]]:
    models: dict[str, list[Path]] = {}
    for spec in specs:
        name, equals, path = spec.partition("=")
        if not equals or not name or not path:
            raise DlmrtError(f"--model takes NAME=DIR, e.g. base=dlmrt/assets/tiny-llada; got {spec!r}")
        models.setdefault(name, []).append(Path(path))
    return models


def point_document(point: comparison.MatchedPoint) -> dict:
    return {"model": point.model, "target": point.target, "tpf_per_seed": list(point.tpfs),
            "settings": list(point.settings), "mean": point.mean, "low": point.low, "high": point.high}


def curve_table(curves) -> Table:
    table = Table(title="mean exact-match / TPF on the same grid (mean over seeds)")
    table.add_column("setting")
    for name in curves:
        table.add_column(name, justify="right")
    for index, result in enumerate(next(iter(curves.values()))[0]):
        table.add_row(result.setting.label, *(curve_cell(seeds, index) for seeds in curves.values()))
    return table


def curve_cell(seeds, index: int) -> str:
    em = sum(curve[index].score.mean for curve in seeds) / len(seeds)
    tpf = sum(curve[index].score.metrics.tpf for curve in seeds) / len(seeds)
    return f"{em:.1%} / {tpf:.2f}"


def tpf_cell(point: comparison.MatchedPoint, reference: comparison.MatchedPoint | None, code: str = "") -> str:
    """Mean TPF with its range over seeds (and how many seeds reach the target, if not all), then the
    ratio to the reference's mean and whether the ranges separate; one seed: its TPF and setting."""
    if point.mean is None:
        return "not reached"
    if len(point.tpfs) == 1:
        text = f"{point.mean:.2f} ({code}{point.settings[0]}{code})"
    else:
        text = f"{point.mean:.2f} [{min(point.reached):.2f}-{point.high:.2f}]"
        if len(point.reached) < len(point.tpfs):
            text += f" ({len(point.reached)}/{len(point.tpfs)} seeds)"
    if reference is not None and reference.mean:
        verdict = " faster" if point.beats(reference) else " slower" if reference.beats(point) else ""
        text += f", {point.mean / reference.mean:.2f}x{verdict}"
    return text


def matched_rows(points, names: list[str], code: str = "") -> list[tuple[str, list[str]]]:
    rows = []
    for target in dict.fromkeys(p.target for p in points):
        row = {p.model: p for p in points if p.target == target}
        reference = row[names[0]]
        cells = [tpf_cell(row[name], None if name == names[0] else reference, code) for name in names]
        rows.append((f">= {target:.1%}", cells))
    return rows


def matched_table(points, names: list[str], title: str) -> Table:
    table = Table(title=title)
    table.add_column("target exact-match")
    for name in names:
        table.add_column(name, justify="right")
    for label, cells in matched_rows(points, names):
        table.add_row(label, *cells)
    return table


def markdown(curves, points, rules) -> str:
    names = list(curves)
    lines = ["| setting | " + " | ".join(f"{n} EM / TPF" for n in names) + " |", "|---|" + "---|" * len(names)]
    for index, result in enumerate(next(iter(curves.values()))[0]):
        lines.append(f"| `{result.setting.label}` | " + " | ".join(curve_cell(s, index) for s in curves.values())
                     + " |")
    sections = [("all settings", points), *((f"{rule} only", p) for rule, p in rules.items() if len(rules) > 1)]
    for title, section in sections:
        lines += ["", f"| target exact-match ({title}) | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in matched_rows(section, names, "`")]
    return "\n".join(lines) + "\n"


def write_band_plot(curves, path: Path, title: str) -> None:
    """Exact-match against TPF: for each model, the fastest TPF reached at each exact-match level (its
    matched-quality frontier), the mean over seeds as a line and the seeds' range as a band; each
    setting's mean over seeds as a dot."""
    figure, axes = evaluation.new_figure()
    every = sorted({r.score.mean for seeds in curves.values() for curve in seeds for r in curve})
    levels = [every[0] + (every[-1] - every[0]) * step / 200 for step in range(201)]
    for index, (name, seeds) in enumerate(curves.items()):
        rows = [(level, p) for level in levels for p in comparison.matched({name: seeds}, [level]) if p.mean]
        ys = [100 * level for level, _ in rows]
        axes.plot([p.mean for _, p in rows], ys, color=f"C{index}",
                  label=f"{name} ({len(seeds)} seed{'s' if len(seeds) > 1 else ''})")
        axes.scatter([sum(c[i].score.metrics.tpf for c in seeds) / len(seeds) for i in range(len(seeds[0]))],
                     [100 * em for em in comparison.mean_exact_match(seeds)], color=f"C{index}", s=12, alpha=0.6)
        axes.fill_betweenx(ys, [p.low for _, p in rows], [p.high for _, p in rows], color=f"C{index}", alpha=0.2,
                           linewidth=0)
    evaluation.save_figure(figure, axes, title, path,
                           xlabel="tokens per forward (TPF), fastest setting at each exact-match")


if __name__ == "__main__":
    sys.exit(main())
