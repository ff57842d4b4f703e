"""The step of a roofline case run for real, under torch.profiler, its time summed per roofline row.

    measured = profile_step(model, case)   # {row: seconds per step}

The model runs eagerly on its own device, with real weights, inside the same `GroupScopes` as the
roofline's count, so every op lands in the row of the same name. On CUDA a row's time is the device
time of the kernels its ops launch (what the row's floor bounds; launch gaps are not in it); on a
CPU it is the ops' own CPU time. A kernel under an SDPA op counts in its group's attention row.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from dlmrt.bench.step_case import StepCase, step_graph, step_inputs, step_shapes
from dlmrt.bench.step_scopes import ATTENTION, SCOPE, GroupScopes, row_name
from dlmrt.models import Denoiser


def profile_step(model: Denoiser, case: StepCase, *, repeats: int = 5, warmups: int = 2) -> dict[str, float]:
    """Seconds per step of each row, the mean of `repeats` profiled steps after `warmups` unprofiled ones."""
    shapes = step_shapes(model, case)
    graph = step_graph(model, shapes, case.block_length)
    inputs = step_inputs(model, case, shapes, model.device)
    cuda = model.device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with torch.no_grad(), GroupScopes(graph):
        for _ in range(warmups):
            graph(**inputs)
        _synchronize(model.device)
        with profile(activities=activities) as profiler:
            for _ in range(repeats):
                graph(**inputs)
            _synchronize(model.device)
    return {row: seconds / repeats for row, seconds in measured_rows(profiler.events(), device_time=cuda).items()}


def measured_rows(events, *, device_time: bool) -> dict[str, float]:
    """Seconds by row: each event's kernels (`device_time`) or own CPU time, in the row of the innermost
    roofline scope around it. Time outside every scope (a synchronize) belongs to no row."""
    rows: dict[str, float] = defaultdict(float)
    for event in events:
        if event.device_type != DeviceType.CPU or event.is_async:
            continue  # a kernel's own event: its time is in the kernels of the op that launched it
        if device_time:
            own = sum(kernel.duration for kernel in event.kernels)
        else:
            own = 0 if event.name.startswith(SCOPE) else event.self_cpu_time_total
        row = _row_of(event) if own else None
        if row is not None:
            rows[row] += own * 1e-6
    return dict(rows)


def _row_of(event) -> str | None:
    op = ""
    while event is not None:
        if event.name.startswith(SCOPE):
            return row_name(event.name.removeprefix(SCOPE), op)
        if ATTENTION in event.name:
            op = event.name
        event = event.cpu_parent
    return None


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
