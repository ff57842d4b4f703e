"""How small a slowdown of dlmrt's step the paired timing of the regression gate catches, on this machine.

    .venv/bin/python scripts/gate_sensitivity.py            # about 4 minutes on 2 cores
    .venv/bin/python scripts/gate_sensitivity.py --busy     # while another process keeps one core busy

Builds the cases of one scenario of the gate's suite (benchmarks/ci.toml's tiny-threshold-dual: the
reference loop, torch eager, torch compile and ONNX Runtime) as `dlmrt bench` does, and the canary
(dlmrt.bench.canary), every one single-threaded (--threads). One paired timing (dlmrt.bench.paired)
without delay records the baseline. Then the gate runs --runs times at each delay d (the delays in
turn, run after run), every step the executor runs sleeping d ms, or with "10%" a tenth of its own
time: a pure delay, as a regression in the step would add (--delay-kind work: CPU time instead); the
reference loop runs no executor and is untouched. A run fails as the gate does: a case's speed ratio
to the reference is `slower` than the baseline's by more than the margin (each of --margins, on the
same timings), or the modes' sanity fails, and the same again in one rerun. Printed per d: how much
slower each case's step and how much lower its ratio to the reference came out (medians over the
runs), how many runs the ratios and the modes caught, and whom the canary blamed (d = 0: false
alarms).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from dlmrt.bench import canary, paired
from dlmrt.bench import suite as bench_suite
from dlmrt.bench.step_case import default_cache
from dlmrt.bench.models import open_model
from dlmrt.bench.scenario_run import make_cases
from dlmrt.cli.bench import parse_backends
from dlmrt.runtime import GenerationSettings, make_policy, ort_backend
from dlmrt.runtime.executor import Executor

REPO = Path(__file__).resolve().parents[1]
REFERENCE = "reference"


def work(seconds: float) -> None:
    """Busy the thread for `seconds` of its own CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def delayed_steps(delay: str, kind: str):
    """Every run of steps the executor makes takes longer: by `delay` ms a step ("0.4"), or by a share of
    its own time ("10%": each run pauses a tenth of what it took, so every case's step is 10% slower
    whatever its speed). The pause is a sleep (no core taken) or as much CPU work. Nothing is patched
    for no delay (a sleep of 0 still yields the core)."""
    if float(delay.rstrip("%")) == 0:
        return contextlib.nullcontext()
    original, pause = Executor.run, {"sleep": time.sleep, "work": work}[kind]
    share = float(delay[:-1]) / 100 if delay.endswith("%") else None

    def run(self, state, program, steps):
        started = time.perf_counter()
        original(self, state, program, steps)
        pause(share * (time.perf_counter() - started) if share is not None else steps * float(delay) / 1e3)
    return mock.patch.object(Executor, "run", run)


class BusyCore:
    """Another process keeping one core busy while the block runs (or nothing, when not `enabled`)."""

    def __init__(self, enabled: bool):
        self.enabled, self.process = enabled, None

    def __enter__(self):
        if self.enabled:
            self.process = subprocess.Popen([sys.executable, "-c", "while True: pass"])

    def __exit__(self, *exc):
        if self.process is not None:
            self.process.kill()
            self.process.wait()


def build_cases(scenario: bench_suite.Scenario, threads: int, scratch: Path, console: Console):
    """The scenario's cases as `dlmrt bench` builds them, on the same seeded prompts, and the canary."""
    model = open_model(scenario.model, scenario.dtype, scenario.device)
    policy = make_policy(scenario.policy, threshold=scenario.threshold, factor=scenario.factor, steps=scenario.steps,
                         generation_config=model.generation_config)
    settings = GenerationSettings(scenario.output_len, scenario.block_length or min(32, scenario.output_len), policy,
                                  cache=scenario.cache or default_cache(model), ignore_eos=True)
    special = {model.tokens.mask_id, model.tokens.pad_id, *model.tokens.eos_ids}
    allowed = torch.tensor([i for i in range(model.vocab_size) if i not in special])
    chosen = torch.randint(len(allowed), (scenario.batch_size, scenario.input_len),
                           generator=torch.Generator().manual_seed(scenario.seed))
    backends = parse_backends(",".join(scenario.backends))
    # ONNX Runtime at the torch cases' threads, and not spinning: the rounds run torch right after it
    ort = functools.partial(ort_backend.OrtBackend, threads=threads, spinning=False)
    with mock.patch.object(ort_backend, "OrtBackend", ort):
        cases, _ = make_cases(model, backends, allowed[chosen].tolist(), settings, scratch, console)
    return [*cases, canary.canary_case()]


def step_ms(rounds: paired.Rounds) -> dict[str, float]:
    """Each executor case's milliseconds per step executed, the median over the rounds."""
    return {label: 1e3 * statistics.median(seconds / metrics.forwards_executed
                                           for seconds, metrics in zip(rounds.seconds[label], rounds.results[label]))
            for label in rounds.seconds if label not in (REFERENCE, canary.LABEL)}


def judge(rounds: paired.Rounds, baseline: paired.Rounds, margin: float) -> dict:
    """One timing against the baseline: each case's step and ratio to the reference against the
    baseline's, the cases whose ratio is slower, the modes' findings, and whom the canary blames."""
    def recorded_ratio(base: str, label: str) -> float | None:
        if {base, label} <= set(baseline.seconds):
            return paired.median_with_ci(paired.paired_ratios(baseline.seconds[base], baseline.seconds[label])).median
        return None

    steps, base_steps = step_ms(rounds), step_ms(baseline)
    found = {"step_change": {}, "ratio_change": {}, "slower": []}
    for label in steps:
        base_ratio = recorded_ratio(REFERENCE, label)
        ratio = paired.median_with_ci(paired.paired_ratios(rounds.seconds[REFERENCE], rounds.seconds[label]))
        found["step_change"][label] = steps[label] / base_steps[label] - 1
        found["ratio_change"][label] = ratio.median / base_ratio - 1
        if paired.slower(ratio.high, base_ratio, margin):
            found["slower"].append(label)

    def slower_than_recorded(label: str) -> bool:
        recorded = statistics.median(baseline.seconds[label])
        return paired.slower(paired.median_with_ci([recorded / s for s in rounds.seconds[label]]).high, 1.0, margin)

    found["modes"] = paired.mode_findings(rounds.seconds, recorded_ratio(paired.EAGER, paired.ORT), margin,
                                          recorded_compile_vs_eager=recorded_ratio(paired.EAGER, paired.COMPILE))
    found["blame"] = canary.blame(any(map(slower_than_recorded, steps)), slower_than_recorded(canary.LABEL))
    return found


def gate_run(time_rounds: Callable[[int], paired.Rounds], baseline: paired.Rounds, margins: list[float],
             seed: int) -> dict[float, dict]:
    """One run of the gate at each margin, on the same timings: a timing, and a rerun when it fails at
    some margin; what fails in both is caught."""
    first_rounds, again_rounds = time_rounds(seed), None
    judged = {}
    for margin in margins:
        first = judge(first_rounds, baseline, margin)
        again = None
        if first["slower"] or first["modes"]:
            again_rounds = again_rounds or time_rounds(seed + 1000)
            again = judge(again_rounds, baseline, margin)
        judged[margin] = {"first": first, "rerun": again,
                          "caught": sorted(set(first["slower"]) & set(again["slower"])) if again else [],
                          "modes_caught": bool(again and first["modes"] and again["modes"])}
    return judged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", type=Path, default=REPO / "benchmarks" / "ci.toml")
    parser.add_argument("--scenario", default="tiny-threshold-dual")
    parser.add_argument("--delays", default="0,0.25,0.5,1,2",
                        help="comma-separated: ms added to every step, or with % a share of each run's own time")
    parser.add_argument("--runs", type=int, default=5, help="gate runs per delay")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds per timing")
    parser.add_argument("--margins", default=f"0.05,0.08,{paired.MAX_MARGIN}",
                        help="comma-separated: the gate's margins, each judged on the same timings")
    parser.add_argument("--delay-kind", choices=("sleep", "work"), default="sleep",
                        help="sleep: a pure delay; work: as much CPU time, a busy loop (under load, a sleep "
                             "is partly absorbed: the scheduler runs the process longer after it)")
    parser.add_argument("--threads", type=int, default=1, help="torch's and ONNX Runtime's threads")
    parser.add_argument("--busy", action="store_true", help="keep one core busy with another process throughout")
    parser.add_argument("--output-json", type=Path, default=None, help="also write every run's judgement")
    args = parser.parse_args()
    delays = [d.strip() for d in args.delays.split(",")]
    margins = [float(m) for m in args.margins.split(",")]
    torch.set_num_threads(args.threads)
    console = Console(stderr=True)
    started = time.perf_counter()
    _, scenarios = bench_suite.load_suite(args.suite)
    scenario = next(s for s in scenarios if s.name == args.scenario)
    runs: dict[str, list[dict[float, dict]]] = {}
    with tempfile.TemporaryDirectory() as scratch, BusyCore(args.busy), Progress(console=console) as progress:
        cases = build_cases(scenario, args.threads, Path(scratch), console)
        task = progress.add_task("warm-up and baseline", total=None)

        def time_rounds(seed: int, warmups: int = 0) -> paired.Rounds:
            progress.update(task, completed=0, total=len(cases) * (warmups + args.rounds))
            return paired.interleaved_rounds(cases, args.rounds, warmups, seed, advance=lambda: progress.advance(task))

        baseline = time_rounds(0, scenario.num_iters_warmup)
        for run in range(args.runs):  # every delay once a run: the machine's drift meets them all alike
            for delay in delays:
                progress.update(task, description=f"run {run + 1}/{args.runs}, delay {delay}")
                with delayed_steps(delay, args.delay_kind):
                    runs.setdefault(delay, []).append(gate_run(time_rounds, baseline, margins, seed=1 + run))
    wall = time.perf_counter() - started
    Console(width=None if sys.stdout.isatty() else 150).print(results_table(runs, step_ms(baseline), args, wall))
    if args.output_json is not None:
        args.output_json.write_text(json.dumps({"settings": vars(args) | {"suite": str(args.suite),
                                                                           "output_json": str(args.output_json)},
                                                "baseline_step_ms": step_ms(baseline), "baseline_s": baseline.seconds,
                                                "wall_s": wall, "runs": runs}, indent=2) + "\n")


def results_table(runs: dict[str, list[dict[float, dict]]], base_step: dict[str, float], args, wall: float) -> Table:
    kind = "a pure delay" if args.delay_kind == "sleep" else "CPU work"
    table = Table(title=f"the paired gate against {kind} in every step: {args.runs} runs a delay, "
                        f"{args.rounds} rounds a timing, {args.threads} thread(s)"
                        f"{', one core kept busy' if args.busy else ''}",
                  caption=f"per case: its step's change / its ratio to the reference's change (medians of the runs); "
                          f"steps without delay {', '.join(f'{k} {v:.2f} ms' for k, v in base_step.items())}; "
                          f"caught: in a run and its rerun; wall time {wall:.0f} s")
    table.add_column("delay a step", justify="right")
    for label in base_step:
        table.add_column(label, justify="right")
    for column in ("margin", "ratios caught", "modes caught", "gate fails", "canary blames"):
        table.add_column(column, justify="right")
    for delay, judged in runs.items():
        for margin in judged[0]:
            found = [run[margin] for run in judged]
            cells = [f"{statistics.median(r['first']['step_change'][label] for r in found):+.0%} / "
                     f"{statistics.median(r['first']['ratio_change'][label] for r in found):+.0%}"
                     for label in base_step]
            caught = [label for r in found for label in r["caught"]]
            blamed = [r["first"]["blame"] for r in found if r["first"]["blame"]]
            table.add_row(delay if delay.endswith("%") else f"{delay} ms", *cells, f"{margin:.0%}",
                          f"{sum(bool(r['caught']) for r in found)}/{len(found)}"
                          + "".join(f", {label} {caught.count(label)}" for label in dict.fromkeys(caught)),
                          f"{sum(r['modes_caught'] for r in found)}/{len(found)}",
                          f"{sum(bool(r['caught']) or r['modes_caught'] for r in found)}/{len(found)}",
                          ", ".join(f"{who} {blamed.count(who)}" for who in dict.fromkeys(blamed)) or "-")
    return table


if __name__ == "__main__":
    main()
