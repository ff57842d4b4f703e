"""Step latency on a GPU: eager, compile and CUDA graphs at K = 1 and K = a whole block, against the
HBM floor, and the Triton unmask kernels against the torch reference. Part of scripts/gpu_check.sh.

    python scripts/bench_step_latency.py --json latency.json                 # LLaDA-8B shapes, CUDA
    python scripts/bench_step_latency.py --shape small --device cpu          # a smoke run anywhere

The model has LLaDA-8B's shapes (hidden 4096, 32 layers, 32 heads, MLP 12288, vocab 126464) with
random bf16 weights made on the device; nothing is downloaded. One prompt of 512 tokens decodes one
block of 32 under the dual cache (threshold 0.9; random weights commit one token a step, so every
step of the block does work): the block's refresh forward, then 31 steps of the block over the cache.

- per mode and K: ms per step (the call's wall time over the forwards it ran, compile excluded),
  tokens/s, and compile or capture time;
- the HBM floor: the weights' bytes over the device-to-device copy bandwidth measured in this run,
  the time a step cannot beat if it reads every weight once;
- the unmask step on the block's logits [1, 32, vocab]: the torch reference against the Triton
  kernels (two kernels, and the fused one TensorRT's plugin runs), greedy and sampled.

Every part is timed on its own and a failure is recorded in its row, so one broken mode does not
cost the others. Sized for under 8 minutes on one H200.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from dlmrt.core import atomic
from dlmrt.export import models
from dlmrt.export.models import SpecialTokens
from dlmrt.plugins.parallel_unmask import MEASURE_CODES, UnmaskParams, parallel_unmask
from dlmrt.runtime import GenerationSettings, Generator, Threshold

SHAPES = {
    "llada-8b": {"d_model": 4096, "n_heads": 32, "n_layers": 32, "mlp_hidden_size": 12288, "vocab_size": 126464,
                 "max_sequence_length": 4096},
    "small": {"d_model": 256, "n_heads": 4, "n_layers": 2, "mlp_hidden_size": 512, "vocab_size": 4096,
              "max_sequence_length": 1024},
}
BASE = {"architectures": ["LLaDAModelLM"], "model_type": "llada", "rope_theta": 500000.0, "block_type": "llama",
        "activation_type": "silu", "layer_norm_type": "rms", "rope": True, "alibi": False, "weight_tying": False}
PROMPT, BLOCK = 512, 32


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, megabytes: int = 2048) -> float:
    """Device-to-device copy bandwidth in bytes/s (a copy reads and writes each byte)."""
    source = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    synchronize(device)
    times = []
    for _ in range(5):
        started = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        times.append(time.perf_counter() - started)
    return 2 * source.numel() / statistics.median(times)


def decode_rows(model, modes: list[str], ks: list[int], repeats: int, console: Console) -> list[dict]:
    prompt = torch.randint(0, model.vocab_size - 2, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    base = GenerationSettings(BLOCK, BLOCK, Threshold(0.9), cache="dual", ignore_eos=True)
    rows = []
    for mode in modes:
        try:
            generator = Generator(model, mode=mode)
        except Exception as error:  # noqa: BLE001  (recorded, and the next mode runs)
            rows += [{"mode": mode, "k": k, "error": f"{type(error).__name__}: {error}"} for k in ks]
            continue
        for k in ks:
            row = {"mode": mode, "k": k}
            try:
                settings = dataclasses.replace(base, steps_per_sync=k)
                first = generator.generate([prompt], settings).metrics
                runs = [generator.generate([prompt], settings).metrics for _ in range(repeats)]
                per_step = [m.latency_s / m.forwards_executed for m in runs]
                row.update(ms_per_step=1e3 * statistics.median(per_step), ms_range=[1e3 * min(per_step),
                                                                                    1e3 * max(per_step)],
                           tokens_per_s=statistics.median(m.tokens_per_s for m in runs), nfe=runs[0].nfe,
                           forwards_executed=runs[0].forwards_executed, compile_s=first.compile_s,
                           host_ms_per_step=1e3 * statistics.median(m.host_s / m.forwards_executed for m in runs))
            except Exception as error:  # noqa: BLE001
                row["error"] = f"{type(error).__name__}: {error}"
                console.print(traceback.format_exc(limit=4))
            rows.append(row)
            console.print(f"  {mode} K={k}: {row.get('ms_per_step', row.get('error'))}")
    return rows


def unmask_rows(vocab: int, device: torch.device, repeats: int) -> list[dict]:
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(1, BLOCK, vocab, device=device, generator=generator)
    ids = torch.full((1, BLOCK), vocab - 1, dtype=torch.long, device=device)
    positions = torch.arange(PROMPT, PROMPT + BLOCK, device=device)[None]
    measure = torch.full((1,), MEASURE_CODES["prob"], dtype=torch.long, device=device)

    def params(temperature: float) -> UnmaskParams:
        row = dict(dtype=torch.float32, device=device)
        return UnmaskParams(torch.ones(1, dtype=torch.long, device=device), torch.full((1,), 0.9, **row),
                            torch.zeros(1, **row), torch.full((1,), temperature, **row),
                            torch.zeros(1, dtype=torch.long, device=device), torch.zeros(1, dtype=torch.long,
                                                                                          device=device))
    kernels = {"torch reference": lambda p, sampling: parallel_unmask(logits, ids, positions, p, mask_id=vocab - 1,
                                                                      confidence=measure, sampling=sampling)}
    if device.type == "cuda":
        try:
            from dlmrt.plugins.parallel_unmask import triton_kernels

            kernels["triton, 2 kernels"] = lambda p, sampling: triton_kernels.parallel_unmask(
                logits, ids, positions, p, vocab - 1, measure)
            kernels["triton, fused"] = lambda p, sampling: triton_kernels.parallel_unmask(
                logits, ids, positions, p, vocab - 1, measure, fused=True)
        except Exception as error:  # noqa: BLE001
            kernels["triton"] = error
    rows = []
    reference = {}
    for name, kernel in kernels.items():
        for temperature in (0.0, 0.8):
            row = {"kernel": name, "temperature": temperature}
            if isinstance(kernel, Exception):
                row["error"] = f"{type(kernel).__name__}: {kernel}"
                rows.append(row)
                continue
            try:
                p = params(temperature)
                out = kernel(p, temperature > 0)
                key = temperature
                reference.setdefault(key, out)
                row["same_as_reference"] = bool(torch.equal(out.ids, reference[key].ids)
                                                and torch.equal(out.commit, reference[key].commit))
                times = []
                for _ in range(repeats * 10):
                    synchronize(device)
                    started = time.perf_counter()
                    kernel(p, temperature > 0)
                    synchronize(device)
                    times.append(time.perf_counter() - started)
                row["us"] = 1e6 * statistics.median(times)
            except Exception as error:  # noqa: BLE001
                row["error"] = f"{type(error).__name__}: {error}"
            rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=tuple(SHAPES), default="llada-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--modes", default=None, help="comma-separated [default: eager,compile,cudagraph on CUDA]")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    console = Console(width=None if sys.stdout.isatty() else 150)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    modes = args.modes.split(",") if args.modes else (["eager", "compile", "cudagraph"] if device.type == "cuda"
                                                       else ["eager", "compile"])
    config = {**BASE, **SHAPES[args.shape]}
    vocab = config["vocab_size"]
    tokens = SpecialTokens(mask_id=vocab - 1, eos_ids=(vocab - 2,), pad_id=vocab - 2)
    started = time.perf_counter()
    model = models.create(config, tokens=tokens, seed=0, dtype=dtype, device=device)
    console.print(f"model: {args.shape}, {dtype}, on {device}, made in {time.perf_counter() - started:.0f} s")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth(device)
    floor_ms = 1e3 * weight_bytes / bandwidth
    rows = decode_rows(model, modes, [1, BLOCK], args.repeats, console)
    unmask = unmask_rows(vocab, device, args.repeats)

    table = Table(title=f"{args.shape}: batch 1, prompt {PROMPT}, one block of {BLOCK}, dual cache; HBM floor "
                        f"{floor_ms:.2f} ms/step ({weight_bytes / 2**30:.1f} GiB of weights at "
                        f"{bandwidth / 1e9:.0f} GB/s copy bandwidth)")
    for column in ("mode", "K", "ms/step (median, range)", "x floor", "tokens/s", "host ms/step", "NFE",
                   "forwards run", "compile/capture s"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for row in rows:
        if "error" in row:
            table.add_row(row["mode"], str(row["k"]), f"error: {row['error'][:70]}", *[""] * 6)
            continue
        low, high = row["ms_range"]
        table.add_row(row["mode"], str(row["k"]), f"{row['ms_per_step']:.2f} ({low:.2f}-{high:.2f})",
                      f"{row['ms_per_step'] / floor_ms:.2f}", f"{row['tokens_per_s']:.1f}",
                      f"{row['host_ms_per_step']:.3f}", str(row["nfe"]), str(row["forwards_executed"]),
                      f"{row['compile_s']:.1f}")
    console.print(table)
    kernels = Table(title=f"unmask step on logits [1, {BLOCK}, {vocab}]")
    for column in ("kernel", "temperature", "us (median)", "same tokens as the reference"):
        kernels.add_column(column)
    for row in unmask:
        kernels.add_row(row["kernel"], str(row["temperature"]), f"{row['us']:.1f}" if "us" in row else
                        f"error: {row.get('error', '')[:60]}", str(row.get("same_as_reference", "")))
    console.print(kernels)
    if args.json:
        atomic.write_text(args.json, json.dumps({"shape": args.shape, "device": str(device),
                                                 "gpu": torch.cuda.get_device_name(device) if device.type == "cuda"
                                                 else None, "weight_bytes": weight_bytes,
                                                 "copy_bandwidth": bandwidth, "floor_ms": floor_ms, "decode": rows,
                                                 "unmask": unmask}, indent=2))
    return 0 if all("error" not in row for row in rows + unmask) else 1


if __name__ == "__main__":
    sys.exit(main())
