"""Side-by-side timing of generate calls: medians over repeats with their range, ratios against the
first case, and a rich table. The benchmark scripts in scripts/ are thin layers over this."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import NamedTuple

from rich.progress import Progress
from rich.table import Table

from dlmrt.runtime.metrics import GenerationMetrics


class Case(NamedTuple):
    label: str
    run: Callable[[], GenerationMetrics]
    # The runtime whose threads run the case. ONNX Runtime's threads spin after a run and slow torch
    # down for a second after (to half speed on 2 cores), so cases of one pool never alternate with
    # another's.
    pool: str = "torch"


def measure(cases: Sequence[Case], repeats: int, progress: Progress, title: str,
            warm_up: Callable[[], object] | None = None) -> list[dict]:
    """Run every case once untimed (where it compiles or captures: its `compile_s`), then `repeats`
    rounds of every case of a pool in turn, so that a machine that drifts favours none of them (pools
    one after another): medians and ranges, and speed-up against the first case. `warm_up` runs once
    before all."""
    task = progress.add_task(title, total=len(cases) * (repeats + 1) + 1)
    if warm_up is not None:
        warm_up()
    progress.advance(task)
    firsts: list[GenerationMetrics | None] = [None] * len(cases)
    runs: list[list[GenerationMetrics]] = [[] for _ in cases]
    for pool in dict.fromkeys(case.pool for case in cases):
        members = [index for index, case in enumerate(cases) if case.pool == pool]
        for index in members:
            firsts[index] = cases[index].run()
            progress.advance(task)
        for _ in range(repeats):
            for index in members:
                runs[index].append(cases[index].run())
                progress.advance(task)
    rows = []
    for case, first, found in zip(cases, firsts, runs):
        speeds = [m.tokens_per_s for m in found]
        rows.append({"setting": case.label,
                     "tokens_per_s": statistics.median(speeds), "tokens_per_s_range": [min(speeds), max(speeds)],
                     "latency_s": statistics.median(m.latency_s for m in found),
                     "host_fraction": statistics.median(m.host_fraction for m in found),
                     "host_per_step_s": statistics.median(m.host_s / max(1, m.forwards_executed) for m in found),
                     "tpf": found[0].tpf, "nfe": found[0].nfe, "forwards_executed": found[0].forwards_executed,
                     "compile_s": first.compile_s})
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows


def speed_table(title: str, rows: list[dict], against: str = "vs reference") -> Table:
    table = Table(title=title)
    for column in ("setting", "tokens/s (median)", against, "TPF", "NFE", "latency", "host overhead"):
        table.add_column(column, justify="left" if column == "setting" else "right")
    for row in rows:
        table.add_row(row["setting"], f"{row['tokens_per_s']:.1f}", f"{row['speedup']:.2f}x",
                      f"{row['tpf']:.2f}", str(row["nfe"]), f"{row['latency_s'] * 1e3:.0f} ms",
                      f"{row['host_fraction']:.1%}")
    return table
