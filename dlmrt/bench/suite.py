"""Benchmark suites of `dlmrt bench --suite`, and the history and plot of their runs.

A suite is a TOML file of named scenarios (benchmarks/ci.toml is dlmrt's own):

    format_version = 1
    name = "ci"
    [defaults]                      # any scenario key, for every scenario
    backends = ["reference", "torch:eager"]
    [scenarios.tiny-threshold]
    batch_size = 4
    output_len = 32

Its baseline and the regression gate are `dlmrt.bench.gate`'s.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlmrt.core import atomic, json_files
from dlmrt.core.errors import DlmrtError

SUITE_FORMAT_VERSION = 1
# A suite's timed cases run on one thread, torch's and ONNX Runtime's: on a shared machine a second
# thread waits, at every parallel region, for a core that another process holds. With one of 2 cores
# kept busy, the gate took 644 s with torch on 2 threads, and ONNX Runtime's ratio to eager fell from
# 1.62x to 1.31x with it on 2. The counted ort case keeps ONNX Runtime's default threads, what a user
# gets, so that a session pinned to fewer still changes a count.
GATE_THREADS = 1


class SuiteError(DlmrtError):
    """A suite or baseline file that cannot be used."""


@dataclass(frozen=True)
class Scenario:
    name: str = "bench"
    model: str | None = None  # a model directory or a random config; None: the tiny model
    backends: tuple[str, ...] = ("torch:eager",)
    batch_size: int = 1
    input_len: int = 32
    output_len: int = 32
    block_length: int | None = None
    policy: str = "threshold"
    threshold: float | None = None
    factor: float | None = None
    steps: int | None = None
    cache: str | None = None
    seed: int = 0
    num_iters: int = 5
    num_iters_warmup: int = 1
    dtype: str = "auto"
    device: str = "cpu"
    exact_match_per_task: int | None = None  # also score the task suite's exact match (torch eager)
    # How far a timed ratio may drop before the gate fails it, a share of the baseline's ratio, at most
    # dlmrt.bench.paired.MAX_MARGIN (None: that): set it from the scenario's measured spread.
    margin: float | None = None


_KINDS = typing.get_type_hints(Scenario)


def load_suite(path: Path) -> tuple[str, list[Scenario]]:
    """The suite's name and scenarios, every key and type checked."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise SuiteError(f"cannot read the suite {path}: {error}") from None
    except tomllib.TOMLDecodeError as error:
        raise SuiteError(f"{path} is not valid TOML ({error})") from None
    unknown = set(raw) - {"format_version", "name", "defaults", "scenarios"}
    if unknown:
        raise SuiteError(f"{path}: unknown key {sorted(unknown)[0]!r} (a suite holds format_version, name, "
                         f"defaults and scenarios)")
    if raw.get("format_version") != SUITE_FORMAT_VERSION:
        raise SuiteError(f"{path}: format_version must be {SUITE_FORMAT_VERSION}, got {raw.get('format_version')!r}")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise SuiteError(f"{path}: name must be a non-empty string")
    defaults = _fields(raw.get("defaults", {}), f"{path} [defaults]")
    scenarios = raw.get("scenarios")
    if not isinstance(scenarios, dict) or not scenarios:
        raise SuiteError(f"{path}: [scenarios.NAME] tables are missing")
    return name, [Scenario(**{**defaults, **_fields(table, f"{path} [scenarios.{label}]"), "name": label})
                  for label, table in scenarios.items()]


def _fields(table: Any, where: str) -> dict[str, Any]:
    from dlmrt.models.config import matches  # here: its package imports torch, and `dlmrt --help` need not

    if not isinstance(table, dict):
        raise SuiteError(f"{where} must be a table")
    found = {}
    for key, value in table.items():
        if key not in _KINDS or key == "name":
            raise SuiteError(f"{where}: unknown key {key!r} (known: {', '.join(k for k in _KINDS if k != 'name')})")
        kind = _KINDS[key]
        allowed = typing.get_args(kind) or (kind,)
        if key == "backends":
            if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
                raise SuiteError(f"{where}: backends must be a non-empty list of strings, got {value!r}")
            value = tuple(value)
        elif key == "margin":
            from dlmrt.bench.paired import MAX_MARGIN

            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_MARGIN:
                raise SuiteError(f"{where}: margin must be a number from 0 to {MAX_MARGIN} (a share of the "
                                 f"baseline's ratio), got {value!r}")
        elif not matches(value, kind):
            names = " or ".join(getattr(a, "__name__", str(a)) for a in allowed)
            raise SuiteError(f"{where}: {key} must be {names}, got {value!r}")
        found[key] = float(value) if float in allowed and isinstance(value, int) else value
    return found


def scenario_dict(scenario: Scenario) -> dict:
    return {**dataclasses.asdict(scenario), "backends": list(scenario.backends)}


# -- history and plots ----------------------------------------------------------------------------

def history_entry(suite: str | None, results: dict[str, dict], environment: dict) -> dict:
    """One run as a history line: per scenario and case, the speed ratio and the deterministic figures."""
    import datetime

    scenarios = {}
    for name, result in results.items():
        scenarios[name] = {"exact_match": result.get("exact_match"), "cases": {
            case["setting"]: {"ratio": case["speedup"], "tokens_per_s": case["tokens_per_s"],
                              "tpf": case["tpf"], "nfe": case["nfe"], "tokens_sha256": case["tokens_sha256"]}
            for case in result["cases"]}}
    return {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "suite": suite,
            "environment": environment, "scenarios": scenarios}


def append_history(path: Path, entry: dict) -> None:
    """One JSON line appended in a single write (whole lines, even with writers side by side)."""
    import os

    line = (json.dumps(entry) + "\n").encode("utf-8")
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(descriptor, line)
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def read_history(path: Path) -> list[dict]:
    if not Path(path).is_file():
        return []
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [json_files.parse(line, f"{path} line {number}", SuiteError)
            for number, line in enumerate(lines, start=1) if line.strip()]


def write_plot(history: list[dict], path: Path, title: str) -> None:
    """Two panels: each case's speed ratio run after run (the trend), and TPF against exact match for
    the scenarios that score it, in the latest run (the speed-quality points)."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 5), dpi=110)
    FigureCanvasAgg(figure)
    trend, quality = figure.subplots(1, 2)
    series: dict[str, list[tuple[int, float]]] = {}
    for index, entry in enumerate(history):
        for scenario, found in entry["scenarios"].items():
            for case, figures in list(found["cases"].items())[1:]:  # the first case is every ratio's 1.0
                series.setdefault(f"{scenario}: {case}", []).append((index, figures["ratio"]))
    for label, points in series.items():
        trend.plot([i for i, _ in points], [r for _, r in points], marker="o", label=label)
    trend.set_xlabel("run")
    trend.set_ylabel("speed against the scenario's first case (x)")
    trend.set_title("speed ratios, run after run")
    trend.grid(True, alpha=0.3)
    if series:
        trend.legend(fontsize=7)
    latest = history[-1]["scenarios"] if history else {}
    for scenario, found in latest.items():
        if found.get("exact_match") is not None:
            tpf = max(figures["tpf"] for figures in found["cases"].values())
            percent = 100 * found["exact_match"]["correct"] / found["exact_match"]["total"]
            quality.scatter([tpf], [percent])
            quality.annotate(scenario, (tpf, percent), textcoords="offset points",
                             xytext=(4, 4), fontsize=7)
    quality.set_xlabel("tokens per forward (TPF)")
    quality.set_ylabel("exact match (%)")
    quality.set_title("speed and quality, latest run")
    quality.grid(True, alpha=0.3)
    figure.suptitle(title)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight")
    atomic.write_bytes(path, buffer.getvalue())
