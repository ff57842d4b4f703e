"""Exact-match of a model on task-suite or JSONL examples, decoded by the Generator, over a grid of
decoding settings: the speed-quality curve of `dlmrt eval`.

    score = exact_match(model, examples, GenerationSettings(16, 8, Threshold(0.9)))
    score.per_task, score.mean, score.metrics.tpf

A setting is written `POLICY[:key=value,...]`, e.g. `fixed:steps=8` or
`threshold:threshold=0.7,confidence=margin`; its label is the spec as written.
"""

from __future__ import annotations

import functools
import io
import json
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from dlmrt.core import atomic, file_reads, json_files, limits
from dlmrt.core.errors import ArgumentError
from dlmrt.models import Denoiser
from dlmrt.runtime import GenerationMetrics, GenerationSettings, Generator, Policy, make_policy, text
from dlmrt.runtime.policy_registry import POLICIES, unknown_policy
from dlmrt.runtime.settings import check_request
from dlmrt.core.tasks import Example, is_correct

if TYPE_CHECKING:
    from dlmrt.runtime.backend import Backend
    from dlmrt.runtime.exported_model import ExportedModel

DEFAULT_THRESHOLDS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
# Uniform-noise models: the public bound (0.1), tighter and far looser ones.
DEFAULT_ENTROPY_BOUNDS = (0.01, 0.1, 0.3, 1, 3, 10)
DEFAULT_FACTORS = (1, 2, 4, 8)
JSONL_TASK = "jsonl"
PLOT_INSTALL_HINT = "the plot needs matplotlib: pip install 'dlmrt[plot]'"
# Label placement on the plot: a step in points, and a label's rough extent in axes fractions.
LABEL_STEP_PT = 9
LABEL_WIDTH, LABEL_HEIGHT = 0.25, 0.03


@dataclass(frozen=True)
class EvalScore:
    # Fraction of right answers, tasks in order of first appearance: exactly the answer, or for a
    # task with several right answers (`dlmrt.core.tasks.VERIFIERS`) what its verifier accepts.
    per_task: dict[str, float]
    metrics: GenerationMetrics  # all batches together
    correct: int = 0  # right answers over every task, of `total` examples
    total: int = 0

    @property
    def mean(self) -> float:
        """The mean over tasks (each task weighs the same, whatever its example count)."""
        return sum(self.per_task.values()) / len(self.per_task)


@dataclass(frozen=True)
class Setting:
    label: str  # the spec as written
    policy: Policy


@dataclass(frozen=True)
class SettingScore:
    setting: Setting
    score: EvalScore


# -- scoring ------------------------------------------------------------------------------------

def exact_match(model: Denoiser | ExportedModel, examples: Sequence[Example], settings: GenerationSettings,
                batch_size: int = 64, on_batch: Callable[[int], None] | None = None, *,
                mode: str = "auto", backend: Backend | None = None) -> EvalScore:
    """Exact-match per task of `examples` decoded with `settings`, batched `batch_size` rows at a time
    by `backend`, or else a TorchBackend of `model` in `mode`; every check runs before any compute.
    With a backend, `model` only encodes and decodes text (an export's ExportedModel will do)."""
    generator, prompts = _prepare(model, examples, batch_size, mode, backend)
    check_request(generator.spec, prompts, settings)
    return _score(generator, model, examples, prompts, settings, batch_size, on_batch)


def evaluate_grid(model: Denoiser | ExportedModel, examples: Sequence[Example], base: GenerationSettings,
                  grid: Sequence[Setting], batch_size: int = 64,
                  on_batch: Callable[[Setting, int], None] | None = None, *,
                  mode: str = "auto", backend: Backend | None = None) -> list[SettingScore]:
    """`exact_match` under each setting's policy (the rest from `base`), in the grid's order. Every
    setting is checked before the first one runs. `on_batch(setting, rows)` follows each batch, and
    comes with 0 rows as a setting starts."""
    if not grid:
        raise ArgumentError("the grid has no setting: give at least one")
    generator, prompts = _prepare(model, examples, batch_size, mode, backend)
    runs = [(setting, replace(base, policy=setting.policy)) for setting in grid]
    for setting, settings in runs:
        try:
            check_request(generator.spec, prompts, settings)
        except ArgumentError as error:
            raise ArgumentError(f"setting {setting.label!r}: {error}") from None
    # One untimed row first, so that one-off costs (allocator, kernel selection) do not land on the
    # first setting's tokens/s.
    generator.generate(prompts[:1], runs[0][1])
    results = []
    for setting, settings in runs:
        advance = None
        if on_batch is not None:
            on_batch(setting, 0)
            advance = functools.partial(on_batch, setting)
        results.append(SettingScore(setting, _score(generator, model, examples, prompts, settings,
                                                     batch_size, advance)))
    return results


def _prepare(model: Denoiser | ExportedModel, examples: Sequence[Example], batch_size: int, mode: str,
             backend: Backend | None) -> tuple[Generator, list[list[int]]]:
    """The Generator and every prompt's token ids, after the checks that do not depend on a setting."""
    if batch_size <= 0:
        raise ArgumentError(f"batch-size must be positive, got {batch_size}")
    if not examples:
        raise ArgumentError("no examples to evaluate")
    generator = Generator(backend) if backend is not None else Generator(model, mode=mode, max_batch=batch_size)
    generator.backend.ladder.batch_for(min(batch_size, len(examples)))  # a batch the backend cannot take, up front
    return generator, [text.encode(model, example.prompt) for example in examples]


def _score(generator: Generator, model: Denoiser | ExportedModel, examples: Sequence[Example], prompts: list[list[int]],
           settings: GenerationSettings, batch_size: int,
           on_batch: Callable[[int], None] | None) -> EvalScore:
    right: dict[str, int] = defaultdict(int)
    total: dict[str, int] = defaultdict(int)
    metrics = []
    for start in range(0, len(examples), batch_size):
        batch = examples[start:start + batch_size]
        result = generator.generate(prompts[start:start + batch_size], settings)
        for example, row in zip(batch, result.rows):
            total[example.task] += 1
            right[example.task] += is_correct(example, text.decode(model, row.token_ids))
        metrics.append(result.metrics)
        if on_batch is not None:
            on_batch(len(batch))
    return EvalScore({task: right[task] / total[task] for task in total}, GenerationMetrics.combine(metrics),
                     correct=sum(right.values()), total=sum(total.values()))


# -- examples from a file -------------------------------------------------------------------------

def load_jsonl(path: str | Path) -> list[Example]:
    """Examples from a JSONL file of `{"prompt": ..., "answer": ..., "task": ...}` objects ("task" is
    optional, default "jsonl"); blank lines are skipped."""
    path = Path(path)
    lines = file_reads.read_text(path, ArgumentError, most=limits.MAX_DATA_BYTES, what="eval data",
                                 too_large="split it, and evaluate the parts in turn").splitlines()
    examples = [_example(path, number, line) for number, line in enumerate(lines, start=1) if line.strip()]
    if not examples:
        raise ArgumentError(f"{path} holds no examples: write one JSON object per line, "
                            f'like {{"prompt": "add:1+2=", "answer": "3"}}')
    return examples


def _example(path: Path, number: int, line: str) -> Example:
    where = f"{path} line {number}"
    record = json_files.parse(line, where, ArgumentError)
    if not isinstance(record, dict):
        raise ArgumentError(f"{where}: expected a JSON object with \"prompt\" and \"answer\", "
                            f"got {type(record).__name__}")
    fields = {}
    for key, required in (("prompt", True), ("answer", True), ("task", False)):
        if key not in record:
            if required:
                raise ArgumentError(f"{where}: the object has no {key!r} field")
            continue
        if not isinstance(record[key], str):
            raise ArgumentError(f"{where}: {key!r} must be a string, got {json.dumps(record[key])}")
        fields[key] = record[key]
    return Example(fields.get("task", JSONL_TASK), fields["prompt"], fields["answer"])


# -- settings -----------------------------------------------------------------------------------

def parse_setting(spec: str) -> Setting:
    """A setting from `POLICY[:key=value,...]`; keys are the policy's options in POLICIES (`-` or `_`)."""
    label = spec.strip()
    name, colon, rest = label.partition(":")
    name = name.strip()
    if name not in POLICIES:
        raise ArgumentError(f"setting {label!r}: {unknown_policy(name)}")
    params = _setting_params(label, name, rest) if colon else {}
    if name == "residual" and "threshold" in params and "factor" in params:
        raise ArgumentError(f"setting {label!r}: residual takes a threshold or a factor, not both")
    return Setting(label, make_policy(name, **params))


def _setting_params(label: str, name: str, rest: str) -> dict[str, int | float | str]:
    allowed = POLICIES[name].options
    params: dict[str, int | float | str] = {}
    for item in rest.split(","):
        key, equals, value = (part.strip() for part in item.partition("="))
        key = key.replace("-", "_")
        if not equals or not key or not value:
            raise ArgumentError(f"setting {label!r}: expected key=value after {name}:, got {item.strip()!r} "
                                f"(e.g. {name}:{next(iter(allowed))}=...)")
        if key not in allowed:
            raise ArgumentError(f"setting {label!r}: {name} takes {', '.join(allowed)}; not {key!r}")
        if key in params:
            raise ArgumentError(f"setting {label!r}: {key} is given twice")
        params[key] = _convert(label, key, value, allowed[key])
    return params


def _convert(label: str, key: str, value: str, kind: type) -> int | float | str:
    try:
        return kind(value)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise ArgumentError(f"setting {label!r}: {key} must be {noun}, got {value!r}") from None


def default_grid(gen_length: int, block_length: int, noise: str = "mask") -> list[Setting]:
    """Fixed at one token per step, and at gen_length / 2 and / 4 steps where they divide into the
    blocks; then the threshold rule at DEFAULT_THRESHOLDS and the factor rule at DEFAULT_FACTORS.
    For a uniform-noise model: the entropy bound at DEFAULT_ENTROPY_BOUNDS."""
    if noise == "uniform":
        return [parse_setting(f"entropy_bound:entropy_bound={b:g}") for b in DEFAULT_ENTROPY_BOUNDS]
    num_blocks = gen_length // block_length
    steps = [gen_length // k for k in (1, 2, 4)
             if gen_length % k == 0 and (gen_length // k) % num_blocks == 0]
    specs = [f"fixed:steps={s}" for s in dict.fromkeys(steps)]
    specs += [f"threshold:threshold={t:g}" for t in DEFAULT_THRESHOLDS]
    specs += [f"factor:factor={f:g}" for f in DEFAULT_FACTORS]
    return [parse_setting(spec) for spec in specs]


def base_and_grid(model: Denoiser | ExportedModel, grid: Sequence[Setting], *, gen_length: int | None,
                  block_length: int | None, temperature: float, seed: int, cache: str,
                  steps_per_sync: int | None) -> tuple[GenerationSettings, list[Setting]]:
    """What every setting of the grid shares (its lengths at the model's defaults where not given), and the
    grid: `grid`, or the default one at those lengths."""
    from dlmrt.runtime import Fixed
    from dlmrt.runtime.settings import lengths_with_defaults

    lengths = lengths_with_defaults(model, gen_length, block_length)
    base = GenerationSettings(gen_length=lengths[0], block_length=lengths[1], policy=Fixed(),
                              temperature=temperature, seed=seed, cache=cache, steps_per_sync=steps_per_sync)
    base.validate()
    return base, list(grid) or default_grid(*lengths, model.noise)


def grid_work(model: Denoiser | ExportedModel, examples: Sequence[Example], base: GenerationSettings,
              grid: Sequence[Setting], batch_size: int):
    """The `cpu_mode.Work` of a grid: every setting decodes every example."""
    from dlmrt.runtime import cpu_mode

    prompts = [text.encode(model, example.prompt) for example in examples]
    return cpu_mode.work_of(model, base, prompts, batch_size, repeats=len(grid))


# -- reports ------------------------------------------------------------------------------------

def results_document(model_name: str, examples: int, base: GenerationSettings,
                     results: Sequence[SettingScore]) -> dict:
    """What `dlmrt eval --json` writes."""
    return {
        "model": model_name,
        "examples": examples,
        "settings": {"gen_length": base.gen_length, "block_length": base.block_length, "cache": base.cache,
                     "temperature": base.temperature, "seed": base.seed},
        "results": [{
            "setting": r.setting.label,
            "policy": {"name": r.setting.policy.name, **asdict(r.setting.policy)},
            "exact_match": r.score.per_task,
            "mean": r.score.mean,
            "metrics": r.score.metrics.to_dict(),
        } for r in results],
    }


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ArgumentError(PLOT_INSTALL_HINT) from None


def write_plot(results: Sequence[SettingScore], path: str | Path, title: str) -> None:
    """Mean exact-match (%) against tokens per forward, one line per policy, written as a PNG."""
    figure, axes = new_figure()
    by_policy: dict[str, list[SettingScore]] = defaultdict(list)
    for result in results:
        by_policy[result.setting.policy.name].append(result)
    for name, points in by_policy.items():
        _line(axes, points, label=name, marker="o")
    lowest = min(100 * r.score.mean for r in results)
    axes.set_ylim(max(0.0, lowest - 5), 101)
    for result, level in zip(results, _label_levels(results, axes.get_xlim(), axes.get_ylim())):
        leader = {"arrowstyle": "-", "color": "0.6", "linewidth": 0.5} if level else None
        axes.annotate(result.setting.label, (result.score.metrics.tpf, 100 * result.score.mean),
                      textcoords="offset points", xytext=(4, 4 + LABEL_STEP_PT * level), fontsize=7,
                      arrowprops=leader)
    save_figure(figure, axes, title, path)


def write_comparison_plot(curves: Mapping[str, Sequence[SettingScore]], path: str | Path, title: str) -> None:
    """The speed-quality curves of several models over one grid, as a PNG: for each model, a line
    through each policy's settings (solid for the threshold rule, dashed for factor, dotted for fixed)."""
    figure, axes = new_figure()
    styles = {"threshold": "-", "residual": "-", "factor": "--", "fixed": ":"}
    markers = {"threshold": "o", "residual": "o", "factor": "s", "fixed": "^"}
    for index, (model, results) in enumerate(curves.items()):
        color = f"C{index}"
        by_policy: dict[str, list[SettingScore]] = defaultdict(list)
        for result in results:
            by_policy[result.setting.policy.name].append(result)
        for policy, points in by_policy.items():
            _line(axes, points, label=f"{model}, {policy}", color=color, linestyle=styles.get(policy, "-."),
                  marker=markers.get(policy, "x"))
    lowest = min(100 * r.score.mean for results in curves.values() for r in results)
    axes.set_ylim(max(0.0, lowest - 5), 101)
    save_figure(figure, axes, title, path)


def new_figure():
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 5.5), dpi=120)
    FigureCanvasAgg(figure)
    return figure, figure.add_subplot()


def _line(axes, points: Sequence[SettingScore], **style) -> None:
    points = sorted(points, key=lambda r: r.score.metrics.tpf)
    axes.plot([r.score.metrics.tpf for r in points], [100 * r.score.mean for r in points], **style)


def save_figure(figure, axes, title: str, path: str | Path, xlabel: str = "tokens per forward (TPF)") -> None:
    """Label, title and grid the axes, and write the figure as a PNG, atomically."""
    axes.set_xlabel(xlabel)
    axes.set_ylabel("exact-match, mean over tasks (%)")
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    axes.legend(loc="lower left", fontsize=8)  # curves fall to the right, so the lower left is usually empty
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight")  # "tight" keeps labels near the edges
    atomic.write_bytes(path, buffer.getvalue())


def _label_levels(results: Sequence[SettingScore], xlim: tuple[float, float],
                  ylim: tuple[float, float]) -> list[int]:
    """How many label heights to lift each point's label so that it does not cover an earlier one:
    nearby settings (a threshold sweep often lands on the same point) would print on top of each other."""
    width, height = xlim[1] - xlim[0] or 1.0, ylim[1] - ylim[0] or 1.0
    placed: list[tuple[float, float]] = []  # labels' lower-left corners, in axes fractions
    levels = []
    for result in results:
        x = (result.score.metrics.tpf - xlim[0]) / width
        y = (100 * result.score.mean - ylim[0]) / height
        level = 0
        while any(abs(x - px) < LABEL_WIDTH and abs(y + level * LABEL_HEIGHT - py) < LABEL_HEIGHT
                  for px, py in placed):
            level += 1
        placed.append((x, y + level * LABEL_HEIGHT))
        levels.append(level)
    return levels
