"""ONNX Runtime against torch eager, side by side in one run, same policy and cache.

    python scripts/bench_ort.py --repeats 3 --json bench_ort.json

The tiny model on a batch of held-out task-suite prompts (gen 16, block 8), and the larger
random-weight LLaDA config of scripts/bench_step_loop.py (hidden 1024, 8 layers, prompt 32,
256 generated tokens in blocks of 32), both decoded with threshold 0.9 under each cache mode (the
larger config under prefix and dual only: without a cache a run takes minutes there).
Each model is exported once into a temporary directory first (the export time is reported).
Tables show medians of `--repeats` runs; "vs torch" is ORT's tokens/s over torch's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress

import dlmrt
from dlmrt.core import atomic, tasks
from dlmrt.bench.benchmark import measure, speed_table
from dlmrt.bench.case import Case
from dlmrt import models
from dlmrt.export.onnx_export import export
from dlmrt.runtime import GenerationSettings, Generator, Threshold, text
from dlmrt.runtime.ort_backend import OrtBackend

sys.path.insert(0, str(Path(__file__).parent))
from bench_step_loop import LARGE_LLADA, LARGE_TOKENS  # noqa: E402


def compare(model, export_dir, prompts, gen_length, block_length, cache, repeats, progress, title):
    settings = GenerationSettings(gen_length, block_length, Threshold(0.9), cache=cache, ignore_eos=True)
    torch_generator, ort_generator = Generator(model, mode="eager"), Generator(OrtBackend(export_dir))

    def warm_up():
        for generator in (torch_generator, ort_generator):
            generator.generate(prompts[:1], GenerationSettings(block_length, block_length, Threshold(0.9),
                                                               cache=cache))

    cases = [Case(f"torch eager, cache {cache}", lambda: torch_generator.generate(prompts, settings).metrics),
             Case(f"onnxruntime, cache {cache}", lambda: ort_generator.generate(prompts, settings).metrics,
                  pool="onnxruntime")]
    return measure(cases, repeats, progress, title, warm_up)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny-batch", type=int, default=32)
    parser.add_argument("--skip-large", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    console = Console(width=None if sys.stdout.isatty() else 140)
    results: dict[str, object] = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as scratch, Progress(console=console, transient=True) as progress:
        tiny = dlmrt.load()
        prompts = [text.encode(tiny, e.prompt) for e in tasks.examples("test", 100, seed=1234)[:args.tiny_batch]]
        targets = [("tiny", tiny, prompts, 16, 8, ("none", "prefix", "dual"))]
        if not args.skip_large:
            large = models.create(LARGE_LLADA, tokens=LARGE_TOKENS, seed=0)
            prompt = torch.randint(0, 4000, (32,), generator=torch.Generator().manual_seed(0)).tolist()
            targets.append(("large", large, [prompt], 256, 32, ("prefix", "dual")))  # none: minutes per run
        for name, model, batch, gen_length, block_length, caches in targets:
            started = time.perf_counter()
            export_dir = export(model, Path(scratch) / name, max_length=min(model.max_positions, 512))
            results[f"{name}_export_s"] = round(time.perf_counter() - started, 1)
            for cache in caches:
                rows = compare(model, export_dir, batch, gen_length, block_length, cache, args.repeats, progress,
                               f"{name}, cache {cache}")
                results[f"{name}_{cache}"] = rows
                progress.console.print(speed_table(
                    f"{name}: batch {len(batch)}, gen {gen_length}, block {block_length}, threshold 0.9, "
                    f"cache {cache} (export {results[f'{name}_export_s']} s)", rows, against="vs torch"))
    if args.json:
        atomic.write_text(args.json, json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
