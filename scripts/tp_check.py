"""Tensor parallelism on this machine's devices: the tiny LLaDA and the tiny DiffusionGemma decoded on N ranks
against one process, in each mode the device runs.

    python scripts/tp_check.py --device cuda --json tp.json     # NCCL: one rank per GPU, up to --ranks
    python scripts/tp_check.py --device cpu --ranks 2           # gloo, anywhere

On CUDA the ranks are the visible GPUs, at most --ranks; with one GPU the check runs one NCCL rank (the
whole split path: every all-reduce and the vocabulary-parallel step, over a group of one) and says so.
Each row: the model, ranks, the collective backend, the mode, whether the tokens equal the one-process run's
(they must), and the seconds of the ranks' decode (after one untimed run that compiles or captures). Then
the median time of one all-reduce of a tiny step's hidden states (4 x 16 x 128 float32) over 500 calls:
what each of a step's collectives costs before any compute. The exit status is 0 only where every row's
tokens agree.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import dlmrt
from dlmrt import TINY_MODEL_DIR
from dlmrt.core import atomic
from dlmrt.parallel.launch import run_ranks
from dlmrt.parallel.tensor_parallel import shard_model
from dlmrt.runtime import GenerationSettings, Generator, Threshold
from dlmrt.runtime.torch_backend import TorchBackend

MODELS = {"tiny-llada": (TINY_MODEL_DIR, GenerationSettings(16, 8, Threshold(0.9), cache="dual")),
          "tiny-diffusion-gemma": (TINY_MODEL_DIR.parent / "tiny-diffusion-gemma", None)}
PROMPTS = ["add:762+139=", "rev:hello=", "sort:dcba="]
DECODING_OPTIONS = ("block_length", "policy", "steps", "threshold", "factor", "editing_threshold", "max_post_steps",
                    "preset", "entropy_bound", "max_block_steps", "steps_per_sync")
COMMAND_LINE_DEFAULTS = {"gen_length": 16, "remasking": "low_confidence", "confidence": "prob", "minimal_topk": 1,
                         "cache": "none", "temperature": 0.0, "cfg_scale": 0.0, "seed": 0}  # dlmrt generate's


def decode(ranks, model_dir: Path, settings, mode: str, device: str) -> dict:
    """The prompts' tokens and the decode's seconds, on this rank (or in one process when `ranks` is None)."""
    from dlmrt.runtime import text
    from dlmrt.runtime.settings import settings_with_defaults

    model = dlmrt.load(model_dir, device=device)  # on CUDA, the rank's own GPU (init_rank made it current)
    if ranks is not None:
        shard_model(model, ranks)
    if settings is None:  # the model's own defaults (DiffusionGemma's entropy-bound policy)
        settings = settings_with_defaults(model, **dict.fromkeys(DECODING_OPTIONS), **COMMAND_LINE_DEFAULTS)
    generator = Generator(TorchBackend(model, mode=mode))
    prompts = [text.encode(model, prompt) for prompt in PROMPTS]
    generator.generate(prompts, settings)  # compiles or captures
    backend = generator.backend
    backend.synchronize()
    start = time.perf_counter()
    tokens = generator.generate(prompts, settings).tokens
    backend.synchronize()
    return {"tokens": tokens.cpu(), "seconds": time.perf_counter() - start}


def all_reduce_seconds(ranks, numel: int, repeats: int = 500) -> float:
    """The median seconds of one all-reduce of `numel` float32 values, its result read."""
    import statistics

    values = torch.ones(numel, device="cuda" if torch.distributed.get_backend() == "nccl" else "cpu")
    times = []
    for _ in range(repeats + 20):
        start = time.perf_counter()
        ranks.all_reduce(values).sum().item()
        times.append(time.perf_counter() - start)
    return statistics.median(times[20:])


def lockstep_message_seconds(ranks, repeats: int = 500) -> float:
    """The median seconds of one message of a served split model (`dlmrt.parallel.lockstep`): a block's
    decisions, with one row of a 40-token prompt added, from rank 0 to every rank."""
    import statistics

    from dlmrt.parallel.lockstep import Channel
    from dlmrt.runtime import GenerationSettings

    channel = Channel(ranks)
    message = [("add", 0, list(range(40)), GenerationSettings(16, 8), 0), ("run_block",)]
    times = []
    for _ in range(repeats + 20):
        start = time.perf_counter()
        channel.share(message)
        times.append(time.perf_counter() - start)
    return statistics.median(times[20:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ranks", type=int, default=2, help="the most ranks to run [2]")
    parser.add_argument("--modes", default=None, help="comma-separated [cuda: eager,cudagraph; cpu: eager,compile]")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    console = Console(width=120)
    world = min(args.ranks, torch.cuda.device_count()) if args.device == "cuda" else args.ranks
    if args.device == "cuda" and world == 1:
        console.print("one GPU here: running one NCCL rank (the split path over a group of one)")
    modes = (args.modes or ("eager,cudagraph" if args.device == "cuda" else "eager,compile")).split(",")
    rows = []
    for name, (model_dir, settings) in MODELS.items():
        for mode in modes:
            row = {"model": name, "ranks": world, "collectives": "nccl" if args.device == "cuda" else "gloo",
                   "mode": mode}
            try:
                alone = decode(None, model_dir, settings, mode, args.device)
                split = run_ranks(decode, world, (model_dir, settings, mode, args.device), device=args.device)
                row.update(same_tokens=all(torch.equal(r["tokens"], alone["tokens"]) for r in split),
                           seconds_alone=alone["seconds"], seconds_split=max(r["seconds"] for r in split))
            except Exception as error:  # noqa: BLE001  (a row records its failure; the others still run)
                row.update(same_tokens=False, error=f"{type(error).__name__}: {error}"[:300])
            rows.append(row)
    table = Table(title=f"tensor parallelism on {args.device}")
    for column in ("model", "ranks", "collectives", "mode", "same tokens", "s alone", "s split", "error"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["model"], str(row["ranks"]), row["collectives"], row["mode"], str(row["same_tokens"]),
                      f"{row.get('seconds_alone', float('nan')):.3f}", f"{row.get('seconds_split', float('nan')):.3f}",
                      row.get("error", ""))
    console.print(table)
    latency = run_ranks(all_reduce_seconds, world, (4 * 16 * 128,), device=args.device)
    console.print(f"one all-reduce of 32 KB over {world} rank(s): " +
                  ", ".join(f"rank {rank} {seconds * 1e6:.0f} µs" for rank, seconds in enumerate(latency)) +
                  " (median of 500)")
    message = run_ranks(lockstep_message_seconds, world, device=args.device)
    console.print(f"one lockstep message (a served block's decisions, gloo) over {world} rank(s): " +
                  ", ".join(f"rank {rank} {seconds * 1e6:.0f} µs" for rank, seconds in enumerate(message)) +
                  " (median of 500)")
    if args.json is not None:
        atomic.write_text(args.json, json.dumps({"rows": rows, "all_reduce_s": latency, "lockstep_message_s": message},
                                                indent=2))
    return 0 if all(row["same_tokens"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
