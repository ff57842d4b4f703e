"""Compare exported step graphs with the torch step they came from, using Polygraphy's runners
(ONNX Runtime on one side, the torch module on the other) and its fp32 tolerances."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dlmrt.models import Denoiser
from dlmrt.export.export_manifest import ExportManifest
from dlmrt.export.onnx_export import graph_file
from dlmrt.models.step_graph import StepGraph, input_names, output_names
from dlmrt.ops.parallel_unmask import MEASURE_CODES

# float32 outputs may differ by kernel rounding; ids, commit masks and counts must be equal.
ATOL, RTOL = 1e-4, 1e-4


def sample_feeds(model: Denoiser, graph: str, *, batch: int = 2, window: int = 10, prefix: int = 5,
                 block: int = 4, seed: int = 0) -> OrderedDict[str, np.ndarray]:
    """Plausible inputs: random tokens with masks, a block inside the window, mixed policies."""
    generator = torch.Generator().manual_seed(seed)
    start = prefix if graph.startswith("cached") else 0
    rows = 2 * batch if graph.endswith("_guided") else batch  # the model's rows
    ids = torch.randint(0, model.vocab_size, (batch, window), generator=generator)
    ids[torch.rand(batch, window, generator=generator) < 0.5] = model.tokens.mask_id
    values = {
        "ids": ids, "positions": (torch.arange(window) + start).repeat(batch, 1),
        "key_mask": torch.ones(batch, window, dtype=torch.bool),
        "block_index": torch.arange(window - block, window),
        "count": torch.randint(0, 3, (batch,), generator=generator),
        "threshold": torch.rand(batch, generator=generator), "factor": torch.rand(batch, generator=generator),
        "temperature": torch.tensor([0.0, 0.7] * batch)[:batch], "seed": torch.arange(batch),
        "step": torch.full((batch,), 3), "measure": torch.arange(batch) % len(MEASURE_CODES),
        "edit_threshold": torch.tensor([0.3, float("inf")] * batch)[:batch],
        "past_kv": torch.randn(model.num_layers, 2, rows, model.num_kv_heads, prefix, model.head_dim,
                               generator=generator),
        "past_positions": torch.arange(prefix).repeat(batch, 1),
        "past_key_mask": torch.ones(batch, prefix, dtype=torch.bool),
        "z": torch.randn(rows, window, model.hidden_size, generator=generator) * 0.1,
        "certainty": torch.rand(rows, window, generator=generator),
        "prompt_lengths": torch.full((batch,), start + 2), "cfg_scale": torch.tensor([1.5]),
    }
    names = input_names(graph, model.residual_config is not None)
    return OrderedDict((name, values[name].numpy()) for name in names)


@dataclass(frozen=True)
class GraphCheck:
    """One graph's comparison: the outputs compared, the largest absolute difference over them and the
    largest relative one over the float outputs, and the outputs beyond tolerance."""

    outputs: tuple[str, ...]
    max_abs: float
    max_rel: float
    failed: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.failed


def compare_with_torch(model: Denoiser, export_dir: str | Path, grid: int | None = None, *, verbose: bool = False,
                       on_graph: Callable[[str], None] = lambda graph: None) -> dict[str, GraphCheck]:
    """Per graph, how ONNX Runtime's outputs compare with the torch step's.

    ONNX Runtime runs under Polygraphy's OnnxrtRunner; the torch step's outputs join the run as a
    second result (Polygraphy's own torch runner needs CUDA), and Polygraphy's comparator decides:
    float outputs within ATOL or RTOL, the others (ids, commit masks, counts) equal. Its log prints
    only when `verbose`."""
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.comparator import Comparator, IterationResult
    from polygraphy.comparator.compare import SimpleCompareFunc

    residual = model.residual_config is not None
    results = {}
    with polygraphy_log(verbose):
        for graph in ExportManifest.read(export_dir).graphs:
            feeds = sample_feeds(model, graph)
            runner = OnnxrtRunner(SessionFromOnnx(str(Path(export_dir) / graph_file(graph))))
            run = Comparator.run([runner], data_loader=[feeds])
            with torch.no_grad():
                outputs = StepGraph(model, graph, grid, return_logits=True).eval()(
                    **{k: torch.from_numpy(v) for k, v in feeds.items()})
            expected = OrderedDict(zip(output_names(residual), (o.numpy() for o in outputs)))
            exact = [output for output, array in expected.items() if not np.issubdtype(array.dtype, np.floating)]
            run.append((f"torch-{graph}", [IterationResult(expected, runner_name=f"torch-{graph}")]))
            for _, iterations in run:
                for iteration in iterations:
                    # unmasked positions have confidence -inf on both sides; -inf - -inf is nan
                    iteration["confidence"] = np.where(np.isneginf(iteration["confidence"]), -1.0,
                                                       iteration["confidence"])
                    # as floats, so that the relative difference divides by Polygraphy's epsilon, not by 0
                    for output in exact:
                        iteration[output] = iteration[output].astype(np.float64)
            exactly = {output: 0.0 for output in exact}
            compare = SimpleCompareFunc(atol={"": ATOL, **exactly}, rtol={"": RTOL, **exactly})
            (accuracy,) = Comparator.compare_accuracy(run, compare_func=compare)  # one compare function
            [[compared]] = accuracy.values()  # one pair of runners, one iteration: output name -> result
            # a bare bool where the shapes differ, else the output's statistics
            stats = {output: result for output, result in compared.items() if not isinstance(result, bool)}
            max_abs = max((result.max_absdiff for result in stats.values()), default=math.inf)
            max_rel = max((result.max_reldiff for output, result in stats.items() if output not in exact),
                          default=math.inf)
            failed = tuple(output for output, result in compared.items() if not result)
            results[graph] = GraphCheck(tuple(compared), max_abs, max_rel, failed)
            on_graph(graph)
    return results


@contextmanager
def polygraphy_log(verbose: bool):
    """Polygraphy's log at its own level (INFO) when `verbose`, else silent; never in colour, which
    needs the `colored` package (Polygraphy prints a warning where that is missing)."""
    from polygraphy.logger import G_LOGGER

    colors, G_LOGGER.colors = G_LOGGER.colors, False
    try:
        with G_LOGGER.verbosity(G_LOGGER.INFO if verbose else G_LOGGER.CRITICAL):
            yield
    finally:
        G_LOGGER.colors = colors


def checks_table(checks: dict[str, GraphCheck]):
    """One row a graph: the largest differences over its outputs, and pass or the outputs that failed."""
    from rich.table import Table

    table = Table(title="ONNX Runtime vs the torch step", caption=f"floats within {ATOL:g} abs or {RTOL:g} rel, "
                                                                    f"the rest exactly")
    for column in ("graph", "outputs", "max abs diff", "max rel diff", "result"):
        table.add_column(column)
    for graph, check in checks.items():
        table.add_row(graph, str(len(check.outputs)), f"{check.max_abs:.1e}", f"{check.max_rel:.1e}",
                      "pass" if check.passed else f"FAIL: {', '.join(check.failed)}")
    return table
