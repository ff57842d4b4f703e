"""Compare exported step graphs with the torch step they came from, using Polygraphy's runners
(ONNX Runtime on one side, the torch module on the other) and its fp32 tolerances."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from dlmrt.export.models import Denoiser
from dlmrt.export.export_manifest import ExportManifest
from dlmrt.export.onnx_export import graph_file
from dlmrt.export.step_graph import StepGraph, input_names, output_names
from dlmrt.plugins.parallel_unmask import MEASURE_CODES

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


def compare_with_torch(model: Denoiser, export_dir: str | Path, grid: int | None = None) -> dict[str, bool]:
    """Per graph, whether ONNX Runtime's outputs match the torch step's within the tolerances.

    ONNX Runtime runs under Polygraphy's OnnxrtRunner; the torch step's outputs join the run as a
    second result (Polygraphy's own torch runner needs CUDA), and Polygraphy's comparator decides."""
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.comparator import Comparator, IterationResult
    from polygraphy.comparator.compare import SimpleCompareFunc

    residual = model.residual_config is not None
    results = {}
    for graph in ExportManifest.read(export_dir).graphs:
        feeds = sample_feeds(model, graph)
        runner = OnnxrtRunner(SessionFromOnnx(str(Path(export_dir) / graph_file(graph))))
        run = Comparator.run([runner], data_loader=[feeds])
        with torch.no_grad():
            outputs = StepGraph(model, graph, grid).eval()(**{k: torch.from_numpy(v) for k, v in feeds.items()})
        name = f"torch-{graph}"
        run.append((name, [IterationResult(OrderedDict(zip(output_names(residual), (o.numpy() for o in outputs))),
                                           runner_name=name)]))
        for _, iterations in run:  # unmasked positions have confidence -inf on both sides; -inf - -inf is nan
            for iteration in iterations:
                iteration["confidence"] = np.where(np.isneginf(iteration["confidence"]), -1.0,
                                                   iteration["confidence"])
        accuracy = Comparator.compare_accuracy(run, compare_func=SimpleCompareFunc(atol=ATOL, rtol=RTOL))
        results[graph] = bool(accuracy)
    return results
