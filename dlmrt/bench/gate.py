"""The regression gate of `dlmrt bench --suite --check`, and the baseline file it checks against.

A baseline (JSON, written only by `--update-baseline`) holds two kinds of figures:

- counted, per scenario and case, which must not change at all on any machine: the generated tokens'
  digest, NFE, TPF, each count of `dlmrt.bench.counted`, and the exact-match count of an
  `exact_match_per_task` scenario;
- timed, per machine class (`dlmrt.bench.machine`), per scenario: each case's speed ratio to the
  scenario's first case and the first case's speed against the canary (`dlmrt.bench.canary`), each
  the median of ratios paired round by round (`dlmrt.bench.paired`).

The gate (`check`): a counted figure that differs fails; a ratio fails when even the upper end of its
bootstrap interval lies below the ratio recorded for this machine class less the scenario's `margin`
(at most and by default MAX_MARGIN, 15%); compile and ONNX Runtime must hold their recorded ratios to
eager in the same rounds. On a machine class with no recorded timings only the counted figures and
"compile is not slower than eager" are checked, and the gate says so. A scenario whose timing fails is
run again, and only a failure seen in both runs counts.
"""

from __future__ import annotations

import json
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dlmrt.bench.suite import SuiteError
from dlmrt.core import atomic, json_files

BASELINE_FORMAT_VERSION = 3  # 3: timings per machine class; 2 had one set of timings


def record(suite: str, results: dict[str, dict], machine: str) -> dict:
    """A baseline from one run on `machine`: `results` maps scenario name to its run (`cases`,
    `exact_match`, `canary`)."""
    scenarios, timings = {}, {}
    for name, result in results.items():
        counted, ratios = {}, {}
        for case in result["cases"]:
            low, high = case["speedup_ci"]
            counted[case["setting"]] = {"tokens_sha256": case["tokens_sha256"], "nfe": case["nfe"],
                                        "tpf": case["tpf"], "work": case.get("work")}
            ratios[case["setting"]] = {"ratio": case["speedup"], "ratio_low": low, "ratio_high": high}
        scenarios[name] = {"cases": counted, "exact_match": result.get("exact_match")}
        timings[name] = {"cases": ratios, "canary": result.get("canary")}
    return {"format_version": BASELINE_FORMAT_VERSION, "suite": suite, "scenarios": scenarios,
            "timings": {machine: timings}}


def updated(kept: dict | None, recorded: dict, subset: bool) -> dict:
    """`recorded` (one machine's run) written over `kept`: the other machine classes' timings stay for
    the scenarios the run covered, and with `subset` the scenarios it did not run stay whole."""
    if kept is None:
        return recorded
    names = set(recorded["scenarios"])
    scenarios = {**(kept["scenarios"] if subset else {}), **recorded["scenarios"]}
    timings = {machine: {name: found for name, found in by_scenario.items() if subset or name in names}
               for machine, by_scenario in kept["timings"].items()}
    for machine, by_scenario in recorded["timings"].items():
        timings[machine] = {**timings.get(machine, {}), **by_scenario}
    return {**recorded, "scenarios": scenarios, "timings": {m: t for m, t in timings.items() if t}}


def load_baseline(path: Path, suite: str) -> dict:
    baseline = json_files.read(Path(path), SuiteError, "record one with --update-baseline")
    if baseline.get("format_version") != BASELINE_FORMAT_VERSION:
        raise SuiteError(f"{path} has format_version {baseline.get('format_version')!r}, this dlmrt reads "
                         f"{BASELINE_FORMAT_VERSION}: record it again with --update-baseline")
    if baseline.get("suite") != suite:
        raise SuiteError(f"{path} is the baseline of suite {baseline.get('suite')!r}, not {suite!r}: give that "
                         f"suite's baseline, or record one with --update-baseline")
    for key in ("scenarios", "timings"):
        if not isinstance(baseline.get(key), dict):
            raise SuiteError(f"{path}: {key} is missing: record it again with --update-baseline")
    return baseline


def save_baseline(path: Path, baseline: dict) -> None:
    atomic.write_text(path, json.dumps(baseline, indent=2) + "\n")


@dataclass(frozen=True)
class Finding:
    scenario: str
    case: str
    figure: str
    message: str  # what was measured against what the baseline holds

    def __str__(self) -> str:
        return f"scenario {self.scenario}, {self.case}: {self.message}"


def check(name: str, result: dict, baseline: dict, machine: str, margin: float | None = None
          ) -> tuple[list[Finding], list[Finding]]:
    """(changed counted figures, slower timings) of one scenario's run on `machine` against its
    baseline. Counted figures (tokens, NFE, TPF, each count of work, the exact-match count) must be
    equal; a speed ratio is slower when its interval's upper end lies below the ratio recorded for
    `machine` less `margin` (None: MAX_MARGIN; `dlmrt.bench.paired`), and the modes are checked against
    each other in the same rounds. The speed against the canary keeps MAX_MARGIN."""
    from dlmrt.bench.paired import COMPILE, EAGER, MAX_MARGIN, ORT, mode_findings, slower

    margin = MAX_MARGIN if margin is None else margin

    recorded = baseline["scenarios"].get(name)
    if recorded is None:
        return [Finding(name, "-", "scenario", "the scenario is not in the baseline: record it with "
                                               "--update-baseline")], []
    timed = baseline["timings"].get(machine, {}).get(name, {"cases": {}, "canary": None})
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
    ratios = {label: expected["ratio"] for label, expected in timed["cases"].items()}
    for label, ratio in ratios.items():
        case = found.get(label)
        if case is None or label == first:
            continue
        low, high = case["speedup_ci"]
        if slower(high, ratio, margin):
            slowed.append(Finding(name, label, "speed", (
                f"speed vs {first} is {case['speedup']:.2f}x ({low:.2f}-{high:.2f}x), below the baseline's "
                f"{ratio:.2f}x by more than {margin:.0%}")))
    if timed.get("canary") and result.get("canary"):
        expected, measured = timed["canary"]["median"], result["canary"]
        # the canary holds a speed against the machine itself, which moves between machines: the widest margin
        if slower(measured["high"], expected, MAX_MARGIN):
            slowed.append(Finding(name, first, "speed vs canary", (
                f"speed against the canary is {measured['median']:.2f}x ({measured['low']:.2f}-"
                f"{measured['high']:.2f}x), below the baseline's {expected:.2f}x by more than {MAX_MARGIN:.0%}: "
                f"code every case shares (the model, torch) slowed, and the canary did not")))
    seconds = {case["setting"]: case["seconds_runs"] for case in result["cases"]}

    def recorded_vs_eager(mode: str) -> float | None:  # the baseline's ratios share their first case
        return ratios[mode] / ratios[EAGER] if mode in ratios and EAGER in ratios else None

    slowed += [Finding(name, "modes", "modes", line) for line in mode_findings(
        seconds, recorded_vs_eager(ORT), margin, recorded_compile_vs_eager=recorded_vs_eager(COMPILE))]
    return changed, slowed


def run_gate(suite_name: str, scenarios, results: dict, expected: dict, machine: str,
             run_again: Callable[[object], dict], summary: Path | None, junit: Path | None, started: float
             ) -> tuple[list[Finding], str]:
    """Check every scenario (`results` is updated with any second run): a slower ratio is run again with
    `run_again(scenario)` and counts only if it repeats (unless a count changed, which fails the
    scenario anyway). Writes the summaries; returns the findings and the verdict, which says how long
    the gate took since `started` (time.monotonic), after a line on a machine class the baseline has
    no timings for."""
    note = ""
    if machine not in expected["timings"]:
        note = (f"the baseline has no timings for this machine class ({machine}; it has: "
             f"{', '.join(sorted(expected['timings'])) or 'none'}): only counted figures and compile against "
             f"eager are checked. Record its timings with --update-baseline on such a machine\n")
    findings = []
    for scenario in scenarios:
        changed, slower = check(scenario.name, results[scenario.name], expected, machine, scenario.margin)
        if slower and not changed:  # a changed count fails the scenario already: no second run to confirm
            results[scenario.name] = again = run_again(scenario)
            changed, slower_again = check(scenario.name, again, expected, machine, scenario.margin)
            repeated = {(f.case, f.figure) for f in slower}
            slower = [f for f in slower_again if (f.case, f.figure) in repeated]
        findings += changed + slower
    write_summaries(findings, [s.name for s in scenarios], summary, junit)
    took = f"in {time.monotonic() - started:.0f} s"
    if findings:
        return findings, note + f"the benchmark gate failed {took} on {machine}:\n  " + "\n  ".join(map(str, findings))
    return findings, note + (f"the benchmark gate passed {took} on {machine}: {len(scenarios)} scenarios of suite "
                      f"{suite_name} match the baseline")


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
