"""Side-by-side timing of generate calls: medians over repeats with their range, ratios against the
first case, and a rich table. The benchmark scripts in scripts/ are thin layers over this."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from rich.progress import Progress
from rich.table import Table

from dlmrt.bench.case import Case
from dlmrt.bench.paired import interleaved_rounds
from dlmrt.runtime.metrics import GenerationMetrics


def measure(cases: Sequence[Case], repeats: int, progress: Progress, title: str,
            warm_up: Callable[[], object] | None = None, warmups: int = 1) -> list[dict]:
    """Run every case `warmups` times untimed (where it compiles or captures), then `repeats` rounds in
    which every case of a pool runs once, in turn (`dlmrt.bench.paired.interleaved_rounds`), pools one
    after another: one row of medians and ranges a case, with its speed-up against the first case.
    `warm_up` runs once before all."""
    task = progress.add_task(title, total=len(cases) * (repeats + warmups) + 1)
    if warm_up is not None:
        warm_up()
    progress.advance(task)
    rows = {}
    for pool in dict.fromkeys(case.pool for case in cases):
        rounds = interleaved_rounds([case for case in cases if case.pool == pool], repeats, warmups,
                                    advance=lambda: progress.advance(task))
        for label, found in rounds.results.items():
            rows[label] = summarize(label, found, rounds.seconds[label], rounds.warmups[label])
    ordered = [rows[case.label] for case in cases]
    for row in ordered:
        row["speedup"] = row["tokens_per_s"] / ordered[0]["tokens_per_s"]
    return ordered


def summarize(label: str, found: Sequence[GenerationMetrics], seconds: Sequence[float],
              warmed: Sequence[GenerationMetrics] = ()) -> dict:
    """One case's row from its timed runs: medians, percentiles and ranges, and the wall seconds of each
    run (`seconds_runs`, in round order, which pairs them with the other cases' runs); its compile time
    is the warm-up runs' (`warmed`) and the timed runs'."""
    speeds = [m.tokens_per_s for m in found]
    latencies = [m.latency_s for m in found]
    steps = [m.latency_s / max(1, m.forwards_executed or m.nfe) for m in found]  # the reference counts NFE only
    return {"setting": label,
            "latency_p50_s": percentile(latencies, 50), "latency_p90_s": percentile(latencies, 90),
            "step_p50_s": percentile(steps, 50), "step_p90_s": percentile(steps, 90),
            "peak_memory_bytes": max(m.peak_memory_bytes for m in found),
            "tokens_per_s": statistics.median(speeds), "tokens_per_s_range": [min(speeds), max(speeds)],
            "tokens_per_s_runs": speeds, "seconds_runs": list(seconds),
            "latency_s": statistics.median(latencies),
            "host_fraction": statistics.median(m.host_fraction for m in found),
            "host_per_step_s": statistics.median(m.host_s / max(1, m.forwards_executed) for m in found),
            "tpf": found[0].tpf, "nfe": found[0].nfe, "forwards_executed": found[0].forwards_executed,
            "compile_s": sum(m.compile_s for m in (*warmed, *found))}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile, linearly interpolated between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def environment() -> dict:
    """What a figure was measured on: CPU, threads, library versions, GPU and driver."""
    import platform

    import torch

    from dlmrt.bench.machine import cpu_info, machine_class

    info = cpu_info()
    found = {"cpu": info.model, "machine_class": machine_class(info), "avx2": "avx2" in info.flags,
             "avx512f": "avx512f" in info.flags, "threads": torch.get_num_threads(),
             "python": platform.python_version(), "torch": torch.__version__}
    for name in ("onnxruntime", "triton", "tensorrt"):
        try:
            found[name] = __import__(name).__version__
        except ImportError:
            found[name] = None
    if torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name()
        found["cuda"] = torch.version.cuda
        try:
            import pynvml

            pynvml.nvmlInit()
            found["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # noqa: BLE001  (the driver version is informative only)
            found["driver"] = None
    return found


def speed_table(title: str, rows: list[dict], against: str = "vs reference") -> Table:
    table = Table(title=title)
    for column in ("setting", "tokens/s (median)", against, "TPF", "NFE", "latency", "host overhead"):
        table.add_column(column, justify="left" if column == "setting" else "right")
    for row in rows:
        table.add_row(row["setting"], f"{row['tokens_per_s']:.1f}", f"{row['speedup']:.2f}x",
                      f"{row['tpf']:.2f}", str(row["nfe"]), f"{row['latency_s'] * 1e3:.0f} ms",
                      f"{row['host_fraction']:.1%}")
    return table
