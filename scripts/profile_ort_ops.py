"""Where ONNX Runtime's CPU time goes, by operator: the float32 export and its CPU-quantized copies.

    python scripts/profile_ort_ops.py                                 # the bench's llada-512x6
    python scripts/profile_ort_ops.py --model DIR --precisions int8-dynamic --graph cached

Exports the model once, quantizes it (`dlmrt export --precision`), and runs one step graph on inputs
recorded from the real step loop (random-id prompts), `--repeats` times over `--count` recorded steps,
with ONNX Runtime's profiler on. Prints each export's kernel time
per run, split by operator (the largest first).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dlmrt.bench.models import RANDOM_CONFIGS, random_model
from dlmrt.bench.models import open_model
from dlmrt.quant.cpu_int import quantize_export
from dlmrt.export.cpu_quantized import PRECISIONS
from dlmrt.export.onnx_export import export


def recorded_inputs(export_dir: Path, graph: str, count: int, vocab_size: int) -> list[dict]:
    """The first `count` runs of `graph`'s inputs in a real step loop (2 seeded prompts of random ids; the
    cached graph runs under a dual cache), as numpy arrays."""
    import torch

    from dlmrt.runtime import GenerationSettings, Generator, Threshold
    from dlmrt.runtime.ort_backend import OrtBackend

    feeds: list[dict] = []

    def observe(name: str, inputs) -> None:
        if name == graph and len(feeds) < count:
            feeds.append({key: value.detach().cpu().numpy().copy() for key, value in inputs.items()})

    prompts = torch.randint(0, vocab_size - 2, (2, 16), generator=torch.Generator().manual_seed(0)).tolist()
    settings = GenerationSettings(32, 8, Threshold(0.9), cache="dual" if graph == "cached" else "none")
    Generator(OrtBackend(export_dir, observe=observe)).generate(prompts, settings)
    return feeds


def profile(graph_path: Path, feeds: list[dict], repeats: int, threads: int | None, prefix: str) -> dict[str, float]:
    """Milliseconds of kernel time per run, by operator type."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.enable_profiling, options.profile_file_prefix = True, prefix
    if threads is not None:
        options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(graph_path), options, providers=["CPUExecutionProvider"])
    names = [value.name for value in session.get_inputs()]
    for _ in range(repeats):
        for feed in feeds:
            session.run(None, {name: feed[name] for name in names})
    by_op: collections.Counter = collections.Counter()
    for event in json.loads(Path(session.end_profiling()).read_text()):
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            by_op[event["args"]["op_name"]] += event["dur"]
    return {op: microseconds / 1000 / (repeats * len(feeds)) for op, microseconds in by_op.most_common()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llada-512x6", help=f"a model directory or {', '.join(RANDOM_CONFIGS)}")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated [all]")
    parser.add_argument("--graph", default="full", choices=("full", "cached"))
    parser.add_argument("--count", type=int, default=4, help="recorded steps [4]")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads [ONNX Runtime's default]")
    args = parser.parse_args(argv)
    model = random_model(args.model) if args.model in RANDOM_CONFIGS else open_model(args.model, "float32", "cpu")
    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        floats = export(model, Path(scratch) / "float32", max_batch=8, max_length=min(model.max_positions, 256))
        feeds = recorded_inputs(floats, args.graph, args.count, model.vocab_size)
        exports = {"float32": floats}
        for precision in (p for p in args.precisions.split(",") if p):
            exports[precision] = quantize_export(floats, Path(scratch) / precision, precision=precision)
        for name, directory in exports.items():
            rows[name] = profile(directory / f"step_{args.graph}.onnx", feeds, args.repeats, args.threads,
                                 str(Path(scratch) / f"profile-{name}"))
    table = Table(title=f"ONNX Runtime CPU, {model.name}, step_{args.graph}: kernel ms per run, by operator")
    for column in ("export", "total", "largest operators"):
        table.add_column(column)
    for name, by_op in rows.items():
        table.add_row(name, f"{sum(by_op.values()):.2f}",
                      ", ".join(f"{op} {ms:.2f}" for op, ms in list(by_op.items())[:6]))
    Console(width=160).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
