"""The CPU step loop, side by side in one run: eager, compile and ONNX Runtime, against the GEMM rate.

    python scripts/bench_device_loop.py --repeats 5 --json bench.json [--profile] [--work fixed]

A random-weight LLaDA checkpoint (hidden 512, 6 layers, vocab 2048; written to a temporary
directory and loaded back) decodes one prompt of 32 tokens: gen 128 in blocks of 32, the full length
(--ignore-eos), with threshold 0.9 and the dual cache (`--work usual`, the default), or with 128 fixed
steps and no cache (`--work fixed`: a forward over the whole 160-token canvas each step, the work of
scripts/bench_llamacpp.py). Cases:

- TorchBackend `eager` and `compile`, each with K = 1 and K = a whole block (steps run between two
  host reads), and OrtBackend on the exported graphs;
- every case must give exactly the tokens of eager K = 1 (the table says whether it does);
- tokens/s is the median of `--repeats` runs after one untimed run (where compiling happens; its
  time is the compile column), the torch cases in turn round by round, then ONNX Runtime's (whose
  spinning threads would slow the torch case run after them); host time per step is the loop's
  time outside the backend, per forward run.

The GEMM rate: every linear layer call of one eager generate (its weight and row count) is
recorded, then replayed alone, with torch's default BLAS (`F.linear`) and with oneDNN on prepacked
weights (what the compile mode runs). "GEMM share" is the time the replayed matmuls take over a
case's latency: the part of the wall time that runs at the GEMM rate. `--profile` adds a profile by
op of the compiled loop, to show where the rest goes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import dlmrt
from dlmrt.core import atomic
from dlmrt.bench.benchmark import environment, measure
from dlmrt.bench.case import Case
from dlmrt import models
from dlmrt.models import checkpoint
from dlmrt.models import SpecialTokens
from dlmrt.runtime import Fixed, GenerationSettings, Generator, Threshold

CONFIG = {
    "architectures": ["LLaDAModelLM"], "model_type": "llada", "d_model": 512, "n_heads": 8, "n_layers": 6,
    "mlp_hidden_size": 1408, "vocab_size": 2048, "max_sequence_length": 1024, "rope_theta": 10000.0,
    "block_type": "llama", "activation_type": "silu", "layer_norm_type": "rms", "rope": True, "alibi": False,
    "weight_tying": False,
}
TOKENS = SpecialTokens(mask_id=2047, eos_ids=(2046,), pad_id=2046)
WORK = {"usual": ("threshold 0.9, dual cache", GenerationSettings(128, 32, Threshold(0.9), cache="dual",
                                                                  ignore_eos=True)),
        "fixed": ("fixed 128 steps, no cache", GenerationSettings(128, 32, Fixed(steps=128), cache="none",
                                                                  ignore_eos=True))}


def random_checkpoint(directory: Path):
    """The random LLaDA of CONFIG, saved as a Hugging Face checkpoint and loaded back."""
    saved = checkpoint.save(models.create(CONFIG, tokens=TOKENS, seed=0), directory)
    return dlmrt.load(saved, mask_id=TOKENS.mask_id, eos_id=list(TOKENS.eos_ids), pad_id=TOKENS.pad_id)


def linear_calls(model, prompts, settings) -> list[tuple[torch.nn.Linear, int]]:
    """(layer, rows) of every linear layer call of one eager generate."""
    calls = []
    hooks = [module.register_forward_pre_hook(lambda m, args: calls.append((m, args[0].numel() // m.in_features)))
             for module in model.modules() if isinstance(module, torch.nn.Linear)]
    try:
        Generator(model, mode="eager").generate(prompts, settings)
    finally:
        for hook in hooks:
            hook.remove()
    return calls


def gemm_replay(calls, repeats: int) -> dict[str, dict]:
    """Median time and FLOP/s of the recorded matmuls alone, per library."""
    flops = sum(2 * rows * layer.in_features * layer.out_features for layer, rows in calls)
    inputs = [torch.randn(rows, layer.in_features) for layer, rows in calls]
    packed = {id(layer): torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach()) for layer, _ in calls}
    libraries = {
        "torch default BLAS (F.linear)": lambda x, layer: F.linear(x, layer.weight),
        "oneDNN, prepacked": lambda x, layer: torch.ops.mkldnn._linear_pointwise(x, packed[id(layer)], None, "none",
                                                                                 [], ""),
    }
    results = {}
    with torch.no_grad():
        for name, linear in libraries.items():
            times = []
            for _ in range(repeats + 1):
                started = time.perf_counter()
                for x, (layer, _) in zip(inputs, calls):
                    linear(x, layer)
                times.append(time.perf_counter() - started)
            seconds = statistics.median(times[1:])
            results[name] = {"seconds": seconds, "gflops": flops / seconds / 1e9}
    return results


def profile_compiled(generator, prompts, settings, console) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        generator.generate(prompts, settings)
    console.print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def results_table(rows: list[dict], gemm: dict, same_tokens: dict[str, bool], work: str) -> Table:
    table = Table(title=f"random LLaDA 512 x 6 layers, vocab 2048: prompt 32, gen 128, block 32, {work}")
    blas, onednn = (gemm[name]["seconds"] for name in gemm)
    for column in ("case", "tokens/s (median, range)", "vs eager", "NFE", "forwards run", "host per step",
                   "compile", "GEMM share: BLAS", "GEMM share: oneDNN", "same tokens"):
        table.add_column(column, justify="left" if column == "case" else "right")
    for row in rows:
        low, high = row["tokens_per_s_range"]
        table.add_row(row["setting"], f"{row['tokens_per_s']:.1f} ({low:.1f}-{high:.1f})", f"{row['speedup']:.2f}x",
                      str(row["nfe"]), str(row["forwards_executed"]), f"{row['host_per_step_s'] * 1e6:.0f} us",
                      f"{row['compile_s']:.1f} s", f"{blas / row['latency_s']:.0%}", f"{onednn / row['latency_s']:.0%}",
                      "yes" if same_tokens[row["setting"]] else "NO")
    return table


def gemm_table(gemm: dict) -> Table:
    table = Table(title="the same run's matmuls alone (every linear layer call of one generate, replayed)")
    for column in ("library", "GFLOP/s", "time per generate"):
        table.add_column(column, justify="left" if column == "library" else "right")
    for name, entry in gemm.items():
        table.add_row(name, f"{entry['gflops']:.0f}", f"{entry['seconds'] * 1e3:.0f} ms")
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per case (median)")
    parser.add_argument("--threads", type=int, default=None, help="torch and ONNX Runtime threads [default: torch's]")
    parser.add_argument("--profile", action="store_true", help="also print a profile by op of the compiled loop")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--work", choices=tuple(WORK), default="usual",
                        help="usual: threshold 0.9, dual cache; fixed: 128 steps, no cache")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(width=None if sys.stdout.isatty() else 160)
    from dlmrt.export.onnx_export import export
    from dlmrt.runtime.ort_backend import OrtBackend

    with tempfile.TemporaryDirectory() as scratch, Progress(console=console, transient=True) as progress:
        model = random_checkpoint(Path(scratch) / "model")
        prompt = torch.randint(0, 2000, (32,), generator=torch.Generator().manual_seed(0)).tolist()
        work, settings = WORK[args.work]
        started = time.perf_counter()
        export_dir = export(model, Path(scratch) / "onnx", max_length=256)
        export_s = time.perf_counter() - started
        generators = {
            "eager, K=1": (Generator(model, mode="eager"), 1),
            "eager, K=block": (Generator(model, mode="eager"), 32),
            "compile, K=1": (Generator(model, mode="compile"), 1),
            "compile, K=block": (Generator(model, mode="compile"), 32),
            "onnxruntime, K=1": (Generator(OrtBackend(export_dir, threads=torch.get_num_threads())), 1),
        }
        tokens = {}

        def case(label):
            generator, k = generators[label]
            run_settings = dataclasses.replace(settings, steps_per_sync=k)

            def run():
                result = generator.generate([prompt], run_settings)
                tokens[label] = result.tokens
                return result.metrics
            return Case(label, run, pool="onnxruntime" if label.startswith("onnxruntime") else "torch")

        rows = measure([case(label) for label in generators], args.repeats, progress, "decoding")
        time.sleep(2)  # until ONNX Runtime's spinning threads go idle: they would slow the replay
        calls = linear_calls(model, [prompt], settings)
        gemm = gemm_replay(calls, args.repeats)
        reference = tokens["eager, K=1"]
        same_tokens = {label: torch.equal(found, reference) for label, found in tokens.items()}
        console.print(results_table(rows, gemm, same_tokens, work))
        console.print(gemm_table(gemm))
        console.print(f"export to ONNX: {export_s:.1f} s; environment: {environment()}")
        if args.profile:
            profile_compiled(generators["compile, K=1"][0], [prompt], settings, console)
    if args.json:
        document = {"environment": environment(), "work": work, "cases": rows, "gemm": gemm,
                    "same_tokens": same_tokens, "export_s": export_s}
        atomic.write_text(args.json, json.dumps(document, indent=2))
    return 0 if all(same_tokens.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
