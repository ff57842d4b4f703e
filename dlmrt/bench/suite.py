"""Benchmark suites, their baselines, and the regression gate of `dlmrt bench --suite`.

A suite is a TOML file of named scenarios (benchmarks/ci.toml is dlmrt's own):

    format_version = 1
    name = "ci"
    [defaults]                      # any scenario key, for every scenario
    backends = ["reference", "torch:eager"]
    [scenarios.tiny-threshold]
    batch_size = 4
    output_len = 32

A baseline (JSON, written only by `--update-baseline`) records, per scenario and case, the counted
figures, which must not change at all (the generated tokens' digest, NFE, TPF, each count of
`dlmrt.bench.counted`, and the exact-match count of an `exact_match_per_task` scenario), and the
timed ones: each case's speed ratio to the scenario's first case, the first case's speed against the
canary (`dlmrt.bench.canary`), each the median of ratios paired round by round
(`dlmrt.bench.paired`). The gate (`check`):

- a counted figure that differs from the baseline fails;
- a ratio fails when even the upper end of its bootstrap interval lies below the baseline's ratio
  less the scenario's `margin` (at most and by default MAX_MARGIN, 15%); compile and ONNX Runtime
  must hold their ratios to eager (the baseline's ratios to the first case, divided) in the same
  rounds. A scenario whose timing fails is run again, and only a failure seen in both runs counts.
"""

from __future__ import annotations

import dataclasses
import json
import typing
import xml.etree.ElementTree as ET
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
BASELINE_FORMAT_VERSION = 2  # 2: counted work, paired ratios with their intervals, the canary


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
    from dlmrt.export.models.config import matches  # here: its package imports torch, and `dlmrt --help` need not

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


# -- baselines ------------------------------------------------------------------------------------

def record(suite: str, results: dict[str, dict]) -> dict:
    """A baseline from one run: `results` maps scenario name to its run (`cases`, `exact_match`,
    `canary`)."""
    scenarios = {}
    for name, result in results.items():
        cases = {}
        for case in result["cases"]:
            low, high = case["speedup_ci"]
            cases[case["setting"]] = {"tokens_sha256": case["tokens_sha256"], "nfe": case["nfe"], "tpf": case["tpf"],
                                      "work": case.get("work"), "ratio": case["speedup"], "ratio_low": low,
                                      "ratio_high": high}
        scenarios[name] = {"cases": cases, "exact_match": result.get("exact_match"), "canary": result.get("canary")}
    return {"format_version": BASELINE_FORMAT_VERSION, "suite": suite, "scenarios": scenarios}


def load_baseline(path: Path, suite: str) -> dict:
    baseline = json_files.read(Path(path), SuiteError, "record one with --update-baseline")
    if baseline.get("format_version") != BASELINE_FORMAT_VERSION:
        raise SuiteError(f"{path} has format_version {baseline.get('format_version')!r}, this dlmrt reads "
                         f"{BASELINE_FORMAT_VERSION}: record it again with --update-baseline")
    if baseline.get("suite") != suite:
        raise SuiteError(f"{path} is the baseline of suite {baseline.get('suite')!r}, not {suite!r}: give that "
                         f"suite's baseline, or record one with --update-baseline")
    if not isinstance(baseline.get("scenarios"), dict):
        raise SuiteError(f"{path}: scenarios is missing: record it again with --update-baseline")
    return baseline


def save_baseline(path: Path, baseline: dict) -> None:
    atomic.write_text(path, json.dumps(baseline, indent=2) + "\n")


# -- the gate -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Finding:
    scenario: str
    case: str
    figure: str
    message: str  # what was measured against what the baseline holds

    def __str__(self) -> str:
        return f"scenario {self.scenario}, {self.case}: {self.message}"


def check(name: str, result: dict, baseline: dict, margin: float | None = None
          ) -> tuple[list[Finding], list[Finding]]:
    """(changed counted figures, slower timings) of one scenario's run against its baseline. Counted
    figures (tokens, NFE, TPF, each count of work, the exact-match count) must be equal; a speed ratio is
    slower when its interval's upper end lies below the baseline ratio less `margin` (None: MAX_MARGIN;
    `dlmrt.bench.paired`), and the modes are checked against each other in the same rounds. The speed
    against the canary keeps MAX_MARGIN."""
    from dlmrt.bench.paired import COMPILE, EAGER, MAX_MARGIN, ORT, mode_findings, slower

    margin = MAX_MARGIN if margin is None else margin

    recorded = baseline["scenarios"].get(name)
    if recorded is None:
        return [Finding(name, "-", "scenario", "the scenario is not in the baseline: record it with "
                                               "--update-baseline")], []
    changed, slowed = [], []

    def unequal(case: str, figure: str, expected, measured) -> None:
        if expected != measured:
            changed.append(Finding(name, case, figure, f"{figure} is {measured}, the baseline holds {expected} "
                                                       f"(it must not change)"))

    unequal("torch:eager", "exact_match", recorded.get("exact_match"), result.get("exact_match"))
    found = {case["setting"]: case for case in result["cases"]}
    first = result["cases"][0]["setting"]
    for label, expected in recorded["cases"].items():
        case = found.get(label)
        if case is None:
            changed.append(Finding(name, label, "case", "the case is in the baseline but did not run"))
            continue
        for figure in ("tokens_sha256", "nfe", "tpf"):
            unequal(label, figure, expected[figure], case[figure])
        for figure, count in (expected.get("work") or {}).items():
            unequal(label, figure, count, (case.get("work") or {}).get(figure))
        low, high = case["speedup_ci"]
        if label != first and slower(high, expected["ratio"], margin):
            slowed.append(Finding(name, label, "speed", (
                f"speed vs {first} is {case['speedup']:.2f}x ({low:.2f}-{high:.2f}x), below the baseline's "
                f"{expected['ratio']:.2f}x by more than {margin:.0%}")))
    if recorded.get("canary") and result.get("canary"):
        expected, measured = recorded["canary"]["median"], result["canary"]
        # the canary holds a speed against the machine itself, which moves between machines: the widest margin
        if slower(measured["high"], expected, MAX_MARGIN):
            slowed.append(Finding(name, first, "speed vs canary", (
                f"speed against the canary is {measured['median']:.2f}x ({measured['low']:.2f}-"
                f"{measured['high']:.2f}x), below the baseline's {expected:.2f}x by more than {MAX_MARGIN:.0%}: "
                f"code every case shares (the model, torch) slowed, and the canary did not")))
    seconds = {case["setting"]: case["seconds_runs"] for case in result["cases"]}
    ratios = {label: expected["ratio"] for label, expected in recorded["cases"].items()}

    def recorded_vs_eager(mode: str) -> float | None:  # the baseline's ratios share their first case
        return ratios[mode] / ratios[EAGER] if mode in ratios and EAGER in ratios else None

    slowed += [Finding(name, "modes", "modes", line) for line in mode_findings(
        seconds, recorded_vs_eager(ORT), margin, recorded_compile_vs_eager=recorded_vs_eager(COMPILE))]
    return changed, slowed


def write_summaries(findings: list[Finding], scenarios: list[str], markdown: Path | None, junit: Path | None) -> None:
    """A Markdown summary for a CI page, and JUnit XML (one test case per scenario)."""
    by_scenario = {name: [f for f in findings if f.scenario == name] for name in scenarios}
    if markdown is not None:
        lines = ["# dlmrt bench gate", "", "| scenario | result |", "|---|---|"]
        lines += [f"| {name} | {'pass' if not found else '<br>'.join(map(str, found))} |"
                  for name, found in by_scenario.items()]
        atomic.write_text(markdown, "\n".join(lines) + "\n")
    if junit is not None:
        suite = ET.Element("testsuite", name="dlmrt-bench", tests=str(len(scenarios)),
                           failures=str(sum(bool(f) for f in by_scenario.values())))
        for name, found in by_scenario.items():
            case = ET.SubElement(suite, "testcase", classname="dlmrt.bench", name=name)
            for finding in found:
                ET.SubElement(case, "failure", message=str(finding))
        atomic.write_bytes(junit, ET.tostring(suite, encoding="utf-8", xml_declaration=True))


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
