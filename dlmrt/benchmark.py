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


def measure(cases: Sequence[Case], repeats: int, progress: Progress, title: str,
            warm_up: Callable[[], object] | None = None) -> list[dict]:
    """Run every case once untimed (where it compiles or captures: its `compile_s`), then `repeats`
    times: medians and ranges, and speed-up against the first case. `warm_up` runs once before all."""
    task = progress.add_task(title, total=len(cases) * (repeats + 1) + 1)
    if warm_up is not None:
        warm_up()
    progress.advance(task)
    rows = []
    for case in cases:
        first = case.run()
        progress.advance(task)
        runs = []
        for _ in range(repeats):
            runs.append(case.run())
            progress.advance(task)
        speeds = [m.tokens_per_s for m in runs]
        rows.append({"setting": case.label,
                     "tokens_per_s": statistics.median(speeds), "tokens_per_s_range": [min(speeds), max(speeds)],
                     "latency_s": statistics.median(m.latency_s for m in runs),
                     "host_fraction": statistics.median(m.host_fraction for m in runs),
                     "host_per_step_s": statistics.median(m.host_s / max(1, m.forwards_executed) for m in runs),
                     "tpf": runs[0].tpf, "nfe": runs[0].nfe, "forwards_executed": runs[0].forwards_executed,
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
