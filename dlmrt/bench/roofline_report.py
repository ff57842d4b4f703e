"""`dlmrt bench --roofline`: the roofline of a model's step at each batch size, as rich tables and JSON,
and with a device, the step's measured time per row beside its floor (docs/roofline.md)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dlmrt.bench.hardware import Gpu
from dlmrt.bench.op_costs import Cost
from dlmrt.bench.roofline import Roofline, count_step
from dlmrt.bench.step_case import StepCase, default_cache
from dlmrt.models import Denoiser

ROOFLINE_FORMAT_VERSION = 1
MB, GB = 1e6, 1e9


def run(meta: Denoiser, gpu: Gpu, batch_sizes: Sequence[int], *, input_len: int, output_len: int,
        block_length: int | None, cache: str | None, console: Console,
        measured_on: Denoiser | None = None, output_json: Path | None = None) -> dict:
    """Print one table a batch size and the summary across them. `measured_on`, the model with weights on
    a device, adds each row's time there (`step_profile.profile_step`)."""
    block = block_length or min(32, output_len)
    cases = [StepCase(batch, input_len, output_len, block, cache or default_cache(meta)) for batch in batch_sizes]
    results = []
    for case in cases:
        with console.status(f"counting the step of {meta.name} at batch {case.batch}"):
            roofline = count_step(meta, case)
        measured = None
        if measured_on is not None:
            from dlmrt.bench.step_profile import profile_step

            with console.status(f"profiling the step of {meta.name} on {measured_on.device} at batch {case.batch}"):
                measured = profile_step(measured_on, case)
        console.print(rows_table(roofline, gpu, measured))
        results.append(case_dict(roofline, gpu, measured))
    console.print(summary_table(results, f"{meta.name} {roofline.label}" if roofline.precision else meta.name, gpu))
    document = {"format_version": ROOFLINE_FORMAT_VERSION, "model": meta.name, "dtype": str(meta.dtype),
                "precision": roofline.precision or None,
                "gpu": {"name": gpu.name, "label": gpu.label, "bandwidth": gpu.bandwidth,
                        "bf16_flops": gpu.bf16_flops, "fp8_flops": gpu.fp8_flops, "fp32_flops": gpu.fp32_flops},
                "cases": results}
    if output_json is not None:
        from dlmrt.core import atomic

        atomic.write_text(output_json, json.dumps(document, indent=2) + "\n")
    return document


def case_dict(roofline: Roofline, gpu: Gpu, measured: dict[str, float] | None) -> dict:
    def row(name: str, cost: Cost, floor: float) -> dict:
        entry = {"name": name, "ops": cost.ops, "bytes_read": cost.bytes_read, "bytes_written": cost.bytes_written,
                 "weight_bytes": round(cost.weight_bytes), "flops": cost.flops, "floor_s": floor}
        if measured is not None:
            entry["measured_s"] = measured.get(name, 0.0) if name != "total" else sum(measured.values())
        return entry

    case = roofline.case
    floor = roofline.floor_s(gpu)
    return {"batch": case.batch, "input_len": case.input_len, "output_len": case.output_len,
            "block_length": case.block_length, "cache": case.cache, "step": case.step,
            "rows": [row(name, cost, roofline.row_floor_s(cost, gpu)) for name, cost in roofline.rows.items()],
            "total": row("total", roofline.total, floor), "floor_s": floor,
            "weights_floor_s": roofline.weights_floor_s(gpu), "weights_bytes": roofline.weights_bytes,
            "experts_per_token": roofline.top_k, "description": case.describe()}


def rows_table(roofline: Roofline, gpu: Gpu, measured: dict[str, float] | None) -> Table:
    floor = roofline.floor_s(gpu)
    table = Table(title=f"{roofline.model} {roofline.label}: {roofline.case.describe()}; floors on {gpu.label}")
    table.caption = on(gpu)
    for header in ("row", "ops", "read MB", "written MB", "GFLOP", "floor µs", "share",
                   *(("measured µs", "measured / floor") if measured is not None else ())):
        table.add_column(header, justify="left" if header == "row" else "right")

    def cells(name: str, cost: Cost, row_floor: float, seconds: float | None) -> list[str]:
        found = [name, str(cost.ops), f"{cost.bytes_read / MB:,.1f}", f"{cost.bytes_written / MB:,.1f}",
                 f"{cost.flops / GB:,.2f}", f"{row_floor * 1e6:,.1f}", f"{row_floor / floor:.1%}"]
        if seconds is not None:
            found += [f"{seconds * 1e6:,.1f}", f"{seconds / row_floor:,.1f}x" if row_floor else "-"]
        return found

    for name, cost in roofline.rows.items():
        table.add_row(*cells(name, cost, roofline.row_floor_s(cost, gpu),
                             None if measured is None else measured.get(name, 0.0)))
    table.add_section()
    table.add_row(*cells("total (the sum of the rows' floors)", roofline.total, floor,
                         None if measured is None else sum(measured.values())))
    return table


def on(gpu: Gpu) -> str:
    return f"{gpu.bandwidth / 1e12:g} TB/s, {gpu.bf16_flops / 1e12:g} TFLOP/s bf16"


def summary_table(results: list[dict], model: str, gpu: Gpu) -> Table:
    measured = "measured_s" in results[0]["total"]
    table = Table(title=f"{model}: the step's floor on {gpu.label}, {on(gpu)}",
                  caption="weights read: the weight bytes the step reads (routed experts: those expected to be "
                          "touched); tokens/s at one token a step per row")
    for header in ("batch", "floor ms", "weights floor ms", "weights read GB", "all weights GB", "moved GB",
                   "GFLOP", "tokens/s ceiling", *(("measured ms", "measured / floor") if measured else ())):
        table.add_column(header, justify="right")
    for result in results:
        total = result["total"]
        cells = [str(result["batch"]), f"{result['floor_s'] * 1e3:.2f}", f"{result['weights_floor_s'] * 1e3:.2f}",
                 f"{total['weight_bytes'] / GB:.2f}", f"{result['weights_bytes'] / GB:.2f}",
                 f"{(total['bytes_read'] + total['bytes_written']) / GB:.2f}", f"{total['flops'] / GB:,.0f}",
                 f"{result['batch'] / result['floor_s']:,.0f}"]
        if measured:
            cells += [f"{total['measured_s'] * 1e3:.2f}", f"{total['measured_s'] / result['floor_s']:.2f}x"]
        table.add_row(*cells)
    return table
