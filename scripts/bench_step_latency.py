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
- the unmask step on the block's logits [batch, 32, vocab] (`--batches`, default 1): the torch reference
  (float32 logits), the torch step on bf16 logits by slices, and the Triton kernels (two kernels, the
  fused one TensorRT's plugin runs, the vocabulary-split ones on float32 and on bf16), greedy and at
  temperature 0.8. `--unmask-only --batches 1,64` times only these (gpu_check.sh's unmask step).

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
from dlmrt import models
from dlmrt.models import SpecialTokens
from dlmrt.ops.parallel_unmask import MEASURE_CODES, UnmaskParams, chunked, parallel_unmask
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


def gpu_name(device: torch.device) -> str | None:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


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


def unmask_kernels(device: torch.device) -> dict:
    """name -> (the logits it takes: "fp32" or "bf16", its launch), or name -> the import's error."""
    def torch_reference(logits, ids, positions, p, measure, sampling):
        return parallel_unmask(logits, ids, positions, p, mask_id=logits.shape[-1] - 1,
                               confidence=measure, sampling=sampling)

    def torch_sliced(logits, ids, positions, p, measure, sampling):
        return chunked.parallel_unmask(logits, ids, positions, p, mask_id=logits.shape[-1] - 1, confidence=measure,
                                       sampling=sampling)

    kernels = {"torch reference": ("fp32", torch_reference), "torch, bf16 by slices": ("bf16", torch_sliced)}
    if device.type != "cuda":
        return kernels
    try:
        from dlmrt.ops.parallel_unmask import split_kernels, triton_kernels
    except Exception as error:  # noqa: BLE001  (recorded in the rows)
        return {**kernels, "triton": error}

    def triton_launch(module, **options):
        return lambda logits, ids, positions, p, measure, sampling: module.parallel_unmask(
            logits, ids, positions, p, logits.shape[-1] - 1, measure, **options)
    return {**kernels, "triton, 2 kernels": ("fp32", triton_launch(triton_kernels)),
            "triton, fused": ("fp32", triton_launch(triton_kernels, fused=True)),
            "triton, split": ("fp32", triton_launch(split_kernels)),
            "triton, split, bf16": ("bf16", triton_launch(split_kernels))}


def unmask_rows(vocab: int, device: torch.device, repeats: int, batches: list[int]) -> list[dict]:
    """Each kernel on the logits [batch, 32, vocab] of every batch, greedy and at temperature 0.8: the
    median µs and whether its ids and commits are the torch reference's on the same (bf16, upcast) logits."""
    kernels = unmask_kernels(device)
    rows = []
    for batch in batches:
        generator = torch.Generator(device=device).manual_seed(0)
        bf16 = torch.randn(batch, BLOCK, vocab, device=device, generator=generator).to(torch.bfloat16)
        logits = {"bf16": bf16, "fp32": bf16.float()}
        ids = torch.full((batch, BLOCK), vocab - 1, dtype=torch.long, device=device)
        positions = torch.arange(PROMPT, PROMPT + BLOCK, device=device).expand(batch, BLOCK).contiguous()
        measure = torch.full((batch,), MEASURE_CODES["prob"], dtype=torch.long, device=device)
        for temperature in (0.0, 0.8):
            row_of = dict(dtype=torch.float32, device=device)
            p = UnmaskParams(torch.ones(batch, dtype=torch.long, device=device), torch.full((batch,), 0.9, **row_of),
                             torch.zeros(batch, **row_of), torch.full((batch,), temperature, **row_of),
                             torch.arange(batch, device=device), torch.zeros(batch, dtype=torch.long, device=device))
            reference = None
            for name, kernel in kernels.items():
                row = {"kernel": name, "batch": batch, "temperature": temperature}
                rows.append(row)
                if isinstance(kernel, Exception):
                    row["error"] = f"{type(kernel).__name__}: {kernel}"
                    continue
                dtype, launch = kernel
                row["logits"] = dtype

                def call(launch=launch, x=logits[dtype], p=p, sampling=temperature > 0):
                    return launch(x, ids, positions, p, measure, sampling)
                try:
                    out = call()
                    reference = reference or out
                    row["same_as_reference"] = bool(torch.equal(out.ids, reference.ids)
                                                    and torch.equal(out.commit, reference.commit))
                    times = []
                    for _ in range(repeats * 10):
                        synchronize(device)
                        started = time.perf_counter()
                        call()
                        synchronize(device)
                        times.append(time.perf_counter() - started)
                    row["us"] = 1e6 * statistics.median(times)
                except Exception as error:  # noqa: BLE001
                    row["error"] = f"{type(error).__name__}: {error}"
    return rows


def unmask_table(rows: list[dict], vocab: int) -> Table:
    table = Table(title=f"unmask step on logits [batch, {BLOCK}, {vocab}]")
    for column in ("kernel", "logits", "batch", "temperature", "us (median)", "same tokens as the reference"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["kernel"], row.get("logits", ""), str(row["batch"]), str(row["temperature"]),
                      f"{row['us']:.1f}" if "us" in row else f"error: {row.get('error', '')[:60]}",
                      str(row.get("same_as_reference", "")))
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=tuple(SHAPES), default="llada-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--modes", default=None, help="comma-separated [default: eager,compile,cudagraph on CUDA]")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--unmask-only", action="store_true", help="time only the unmask step's kernels")
    parser.add_argument("--batches", default="1", help="the unmask step's batch sizes, comma-separated [default: 1]")
    args = parser.parse_args()
    console = Console(width=None if sys.stdout.isatty() else 150)
    device = torch.device(args.device)
    batches = [int(b) for b in args.batches.split(",")]
    if args.unmask_only:
        vocab = SHAPES[args.shape]["vocab_size"]
        unmask = unmask_rows(vocab, device, args.repeats, batches)
        console.print(unmask_table(unmask, vocab))
        if args.json:
            atomic.write_text(args.json, json.dumps({"shape": args.shape, "device": str(device),
                                                     "gpu": gpu_name(device), "unmask": unmask}, indent=2))
        return 0 if all("error" not in row for row in unmask) else 1
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
    unmask = unmask_rows(vocab, device, args.repeats, batches)

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
    console.print(unmask_table(unmask, vocab))
    if args.json:
        atomic.write_text(args.json, json.dumps({"shape": args.shape, "device": str(device),
                                                 "gpu": gpu_name(device), "weight_bytes": weight_bytes,
                                                 "copy_bandwidth": bandwidth, "floor_ms": floor_ms, "decode": rows,
                                                 "unmask": unmask}, indent=2))
    return 0 if all("error" not in row for row in rows + unmask) else 1


if __name__ == "__main__":
    sys.exit(main())
