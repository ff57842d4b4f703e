"""Every backend on one export, side by side: token agreement with torch eager, and step latency.

    python scripts/bench_backends.py --export DIR --json backends.json          # on a GPU (gpu_check.sh)
    python scripts/bench_backends.py --device cpu --repeats 3                   # the CPU cases, anywhere

The tiny model (or --model) decodes the same prompts (--batch task-suite prompts; gen 32 in blocks
of 8, threshold 0.9, dual cache) through each backend that runs on the device:

- CUDA: torch eager, torch with CUDA graphs (the baseline of the ratios), ONNX Runtime's CUDA
  provider with and without its CUDA graphs, and TensorRT for each stored engine precision of the
  export (`--precisions`, where TensorRT is installed and `dlmrt build` stored the engines);
- CPU: torch eager (the baseline), torch.compile, ONNX Runtime, and ONNX Runtime on the export's int8,
  int4 and int8-dynamic copies (`dlmrt export --precision`; weight-only in symmetric blocks of 32).

Per case: whether its tokens equal torch eager's, and the share of generated tokens that do (a
quantized engine may differ in a few), ms per step (the median over `--repeats` runs after one
untimed run, where compiling and capturing happen, of the latency over the forwards run, with its
range), the baseline's over it (above 1 is faster), and tokens/s. A case that fails records its
error in its row, and the others still run. The export's graphs are float32, which every backend
runs; TensorRT's engines compute in bf16, fp8 or nvfp4, so their agreement is reported, and the
exit status asks every other case for torch eager's tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import dlmrt
from dlmrt import TINY_MODEL_DIR
from dlmrt.core import atomic, tasks
from dlmrt.bench.benchmark import measure
from dlmrt.bench.case import Case
from dlmrt.runtime import GenerationSettings, Generator, Threshold, text

SETTINGS = GenerationSettings(32, 8, Threshold(0.9), cache="dual")


def backends(device: str, model_dir: Path, export_dir: Path, engines: Path | None, precisions: list[str],
             quantized: dict[str, Path]) -> dict:
    """label -> a function making the case's Generator, and its thread pool; the baseline first.
    `quantized`: the export's int8/int4 copies by precision (the CPU cases)."""
    from dlmrt.runtime.ort_backend import OrtBackend

    model = dlmrt.load(model_dir, device=device)
    if device == "cpu":
        cases = {"torch eager": (lambda: Generator(model, mode="eager"), "torch"),
                 "torch compile": (lambda: Generator(model, mode="compile"), "torch"),
                 "onnxruntime cpu": (lambda: Generator(OrtBackend(export_dir)), "onnxruntime")}
        for precision, copy in quantized.items():
            cases[f"onnxruntime cpu {precision}"] = (lambda copy=copy: Generator(OrtBackend(copy)), "onnxruntime")
        return cases
    from dlmrt.runtime.trt_backend import TrtBackend

    cases = {"torch cudagraph": (lambda: Generator(model, mode="cudagraph"), "torch"),
             "torch eager": (lambda: Generator(model, mode="eager"), "torch"),
             "onnxruntime cuda, CUDA graphs": (lambda: Generator(OrtBackend(export_dir, device=device)), "torch"),
             "onnxruntime cuda": (lambda: Generator(OrtBackend(export_dir, device=device, cuda_graph=False)), "torch")}
    for precision in precisions:
        cases[f"tensorrt {precision}"] = (
            lambda precision=precision: Generator(TrtBackend(export_dir, engines, precision=precision)), "torch")
    return cases


def run_cases(cases: dict, prompts, repeats: int, progress: Progress, console: Console) -> list[dict]:
    tokens: dict[str, torch.Tensor] = {}
    runnable, failed = [], []
    for label, (make, pool) in cases.items():
        try:
            generator = make()
        except Exception as error:  # noqa: BLE001  (recorded in its row; the next case runs)
            failed.append({"setting": label, "error": f"{type(error).__name__}: {error}"})
            console.print(traceback.format_exc(limit=3))
            continue

        def run(label=label, generator=generator):
            result = generator.generate(prompts, SETTINGS)
            tokens[label] = result.tokens.cpu()
            return result.metrics
        runnable.append(Case(label, run, pool=pool))
    rows = measure(runnable, repeats, progress, "decoding") if runnable else []
    reference = tokens.get("torch eager")
    for row in rows:
        found = tokens[row["setting"]]
        row["ms_per_step"] = row["latency_s"] * 1e3 / row["forwards_executed"]
        if reference is not None:
            row["same_tokens"] = torch.equal(found, reference)
            row["token_agreement"] = (found == reference).float().mean().item()
    return rows + failed


def results_table(rows: list[dict], device: str) -> Table:
    table = Table(title=f"backends on {device}: the tiny model, gen {SETTINGS.gen_length} in blocks of "
                        f"{SETTINGS.block_length}, threshold 0.9, dual cache")
    baseline = rows[0] if rows and "error" not in rows[0] else None
    for column in ("case", "same tokens as torch eager", "tokens agreeing", "ms per step (median, range)",
                   f"speed vs {baseline['setting'] if baseline else 'baseline'}", "tokens/s", "NFE"):
        table.add_column(column, justify="left" if column == "case" else "right")
    for row in rows:
        if "error" in row:
            table.add_row(row["setting"], f"failed: {row['error'][:90]}", "", "", "", "", "")
            continue
        # every run generates the same tokens in the same forwards: ms per step goes as 1 / tokens/s
        low, high = (row["ms_per_step"] * row["tokens_per_s"] / s for s in reversed(row["tokens_per_s_range"]))
        table.add_row(row["setting"], "yes" if row.get("same_tokens") else "NO", f"{row.get('token_agreement', 0):.1%}",
                      f"{row['ms_per_step']:.2f} ({low:.2f}-{high:.2f})",
                      f"{baseline['ms_per_step'] / row['ms_per_step']:.2f}x" if baseline else "",
                      f"{row['tokens_per_s']:.0f}", str(row["nfe"]))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=TINY_MODEL_DIR, help="the torch checkpoint [default: tiny]")
    parser.add_argument("--export", type=Path, default=None, help="its export [default: exported to a temp dir]")
    parser.add_argument("--engines", type=Path, default=None, help="the engine store [default: $DLMRT_HOME/engines]")
    parser.add_argument("--precisions", default="", help="TensorRT engines to run, comma-separated (e.g. bf16,fp8)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--batch", type=int, default=4, help="prompts decoded together")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 170)
    model = dlmrt.load(args.model)
    prompts = [text.encode(model, e.prompt) for e in tasks.examples("test", args.batch, seed=0)[:args.batch]]
    with tempfile.TemporaryDirectory() as scratch, Progress(console=console, transient=True) as progress:
        export_dir = args.export
        if export_dir is None:
            from dlmrt.export.onnx_export import export

            export_dir = export(model, Path(scratch) / "export", max_batch=max(8, args.batch), max_length=64)
        precisions = [p for p in args.precisions.split(",") if p]
        quantized = {}
        if args.device == "cpu":
            from dlmrt.quant.cpu_int import quantize_export
            from dlmrt.export.cpu_quantized import PRECISIONS

            quantized = {precision: quantize_export(export_dir, Path(scratch) / precision, precision=precision)
                         for precision in PRECISIONS}
        cases = backends(args.device, args.model, export_dir, args.engines, precisions, quantized)
        rows = run_cases(cases, prompts, args.repeats, progress, console)
    console.print(results_table(rows, args.device))
    if args.json:
        atomic.write_text(args.json, json.dumps({"device": args.device, "cases": rows}, indent=2))
    # TensorRT's engines compute in 16 bits or fewer, the int8/int4 exports in fewer still: their agreement
    # is reported, not required
    exact = [row for row in rows if not row["setting"].startswith("tensorrt") and not row["setting"].endswith(
        ("int8", "int4", "int8-dynamic"))]
    return 0 if all(row.get("same_tokens") for row in exact) else 1


if __name__ == "__main__":
    sys.exit(main())
