"""`dlmrt bench`: latency and throughput of generate, backends and modes side by side, with the flags
of `vllm bench latency` and the diffusion knobs.

    dlmrt bench                                                  # the tiny model, torch eager
    dlmrt bench --model llada-512x6 --backend torch:eager,torch:compile,ort --batch-size 4 \
        --input-len 64 --output-len 128 --num-iters 5 --output-json bench.json

Every case decodes the same seeded random prompts (`--batch-size` of `--input-len` ids) to the full
`--output-len` (end-of-sequence ignored, as `vllm bench latency` does). Cases of one runtime run in
turn, round by round, after `--num-iters-warmup` untimed runs each. The first case is the baseline
of the speed ratios, and each case's tokens are hashed: "same tokens" compares them with the first.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import click

from dlmrt import limits
from dlmrt.cli_errors import reports_errors
from dlmrt.cli_types import FLOAT32, LENGTH
from dlmrt.errors import ArgumentError

BENCH_FORMAT_VERSION = 1
TORCH_MODES = ("eager", "compile", "cudagraph", "auto")
POLICIES = ("fixed", "threshold", "factor", "llada2")


def parse_backends(spec: str) -> list[tuple[str, str | None]]:
    """`torch:eager,torch:compile,ort` -> [("torch", "eager"), ("torch", "compile"), ("ort", None)]."""
    found = []
    for part in (p.strip() for p in spec.split(",")):
        name, _, mode = part.partition(":")
        if name == "torch" and (mode or "auto") in TORCH_MODES:
            found.append(("torch", mode or "auto"))
        elif name == "ort" and not mode:
            found.append(("ort", None))
        else:
            raise click.BadParameter(f"unknown backend {part!r}: give torch[:{'|'.join(TORCH_MODES)}] or ort, "
                                     f"comma-separated", param_hint="--backend")
    if len(set(found)) != len(found):
        raise click.BadParameter(f"{spec!r} names a backend twice", param_hint="--backend")
    return found


def open_model(name: str | None, dtype: str, device: str):
    """A model directory (default: the tiny model), or a named random config (dlmrt.bench_models)."""
    import dlmrt
    from dlmrt import TINY_MODEL_DIR
    from dlmrt.bench_models import RANDOM_CONFIGS, random_model
    from dlmrt.export.checkpoint import resolve_dtype

    if name in RANDOM_CONFIGS:
        return random_model(name, dtype=resolve_dtype("float32" if dtype == "auto" else dtype), device=device)
    path = Path(name) if name else TINY_MODEL_DIR
    if name and not path.exists():
        raise ArgumentError(f"--model {name!r} is neither a model directory nor a random config "
                            f"({', '.join(RANDOM_CONFIGS)})")
    return dlmrt.load(path, dtype=dtype, device=device)


def token_hash(tokens) -> str:
    """A short digest of generated tokens: equal digests, equal tokens."""
    return hashlib.sha256(tokens.cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


@click.command("bench")
@click.option("--model", "model_name", default=None, metavar="DIR|NAME",
              help="A model directory, or a random-weight config: llada-512x6, llada-1024x8, llada-8b (for a GPU), "
                   "llada2-moe-small [default: the tiny model].")
@click.option("--backend", "backend_spec", default="torch:eager", show_default=True,
              metavar="torch[:MODE],ort", help="Backends and modes compared side by side, comma-separated; the "
                                              "first is the baseline.")
@click.option("--batch-size", type=click.IntRange(1, limits.MAX_BATCH), default=1, show_default=True)
@click.option("--input-len", type=LENGTH, default=32, show_default=True, help="Prompt tokens.")
@click.option("--output-len", type=LENGTH, default=32, show_default=True, help="Generated tokens (gen-length).")
@click.option("--num-iters", type=click.IntRange(1, 100_000), default=5, show_default=True,
              help="Timed runs per case.")
@click.option("--num-iters-warmup", type=click.IntRange(0, 1000), default=1, show_default=True,
              help="Untimed runs per case first (where compiling happens).")
@click.option("--policy", type=click.Choice(POLICIES), default="threshold", show_default=True)
@click.option("--threshold", type=FLOAT32, default=None,
              help="threshold and llada2 policies [default: 0.9; llada2: 0.95].")
@click.option("--factor", type=FLOAT32, default=None, help="factor policy [default: 1.0].")
@click.option("--steps", type=LENGTH, default=None, help="fixed: steps in all; llada2: per block.")
@click.option("--cache", type=click.Choice(("none", "prefix", "dual")), default=None,
              help="[default: dual; prefix for block-causal models, whose exact block cache it is]")
@click.option("--block-length", type=LENGTH, default=None, help="[default: 32, or --output-len if smaller]")
@click.option("--dtype", type=click.Choice(("auto", "float32", "bfloat16", "float16")), default="auto",
              show_default=True, help="auto: float32 (a model directory: its config's dtype).")
@click.option("--device", type=click.Choice(("cpu", "cuda")), default="cpu", show_default=True)
@click.option("--seed", type=click.IntRange(0, limits.MAX_SEED), default=0, show_default=True,
              help="Seeds the prompts.")
@click.option("--output-json", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Also write the results, settings and environment as JSON.")
@reports_errors
def bench_command(model_name, backend_spec, batch_size, input_len, output_len, num_iters, num_iters_warmup,
                  policy, threshold, factor, steps, cache, block_length, dtype, device, seed, output_json):
    """Latency and throughput of generate: tokens/s, TPF, NFE, latency per request and per step."""
    import torch
    from rich.console import Console
    from rich.progress import Progress

    from dlmrt import atomic
    from dlmrt.benchmark import environment
    from dlmrt.runtime import GenerationSettings, make_policy

    backends = parse_backends(backend_spec)
    model = open_model(model_name, dtype, device)
    block_length = block_length or min(32, output_len)
    cache = cache or ("prefix" if model.block_causal else "dual")
    policy_impl = make_policy(policy, threshold=threshold, factor=factor, steps=steps)
    settings = GenerationSettings(output_len, block_length, policy_impl, cache=cache, ignore_eos=True)
    settings.validate(model.block_causal)
    special = {model.tokens.mask_id, model.tokens.pad_id, *model.tokens.eos_ids}
    allowed = torch.tensor([i for i in range(model.vocab_size) if i not in special])
    chosen = torch.randint(len(allowed), (batch_size, input_len), generator=torch.Generator().manual_seed(seed))
    prompts = allowed[chosen].tolist()

    console = Console(stderr=True)
    with tempfile.TemporaryDirectory() as scratch, Progress(console=console, transient=True) as progress:
        cases, tokens = make_cases(model, backends, prompts, settings, Path(scratch), console)
        rows = run_cases(cases, num_iters, num_iters_warmup, progress)
    for row in rows:
        row["tokens_sha256"] = tokens[row["setting"]]
        row["same_tokens"] = tokens[row["setting"]] == tokens[rows[0]["setting"]]
    Console(width=None if sys.stdout.isatty() else 170).print(results_table(rows, model.name, batch_size, input_len,
                                                                            settings))
    if output_json is not None:
        document = {"format_version": BENCH_FORMAT_VERSION, "environment": environment(), "model": model.name,
                    "request": {"batch_size": batch_size, "input_len": input_len, "output_len": output_len,
                                "seed": seed},
                    "settings": {"policy": policy_impl.name, **dataclasses.asdict(policy_impl),
                                 "cache": cache, "block_length": block_length, "dtype": str(model.dtype),
                                 "device": device},
                    "cases": rows}
        atomic.write_text(output_json, json.dumps(document, indent=2) + "\n")


def make_cases(model, backends, prompts, settings, scratch: Path, console):
    """One benchmark Case per backend; `tokens` fills with each case's token digest as it runs."""
    from dlmrt.benchmark import Case
    from dlmrt.runtime import Generator
    from dlmrt.runtime.torch_backend import TorchBackend

    tokens: dict[str, str] = {}
    cases = []
    for name, mode in backends:
        label = f"{name}:{mode}" if mode else name
        if name == "torch":
            generator = Generator(TorchBackend(model, mode=mode, max_batch=len(prompts)))
        else:
            from dlmrt.cli_errors import require_onnx_extra
            from dlmrt.export.onnx_export import export
            from dlmrt.runtime.ort_backend import OrtBackend

            require_onnx_extra()
            with console.status(f"exporting {model.name} for ONNX Runtime"):
                export_dir = export(model, scratch / "export", max_batch=len(prompts),
                                    max_length=len(prompts[0]) + settings.gen_length + settings.block_length)
            generator = Generator(OrtBackend(export_dir))

        def run(label=label, generator=generator):
            result = generator.generate(prompts, settings)
            tokens[label] = token_hash(result.tokens)
            return result.metrics
        cases.append(Case(label, run, pool="onnxruntime" if name == "ort" else "torch"))
    return cases, tokens


def run_cases(cases, iters: int, warmups: int, progress) -> list[dict]:
    from dlmrt.benchmark import measure

    return measure(cases, iters, progress, "benchmarking", warmups=warmups)


def results_table(rows: list[dict], model: str, batch: int, input_len: int, settings):
    from rich.table import Table

    from dlmrt.limits import size

    table = Table(title=f"{model}: batch {batch}, input {input_len}, output {settings.gen_length} in blocks of "
                        f"{settings.block_length}, {settings.policy.name}, cache {settings.cache}")
    for column in ("case", "tokens/s (median, range)", f"vs {rows[0]['setting']}", "TPF", "NFE",
                   "latency p50 / p90", "step p50 / p90", "host", "peak memory", "tokens", "same tokens"):
        table.add_column(column, justify="left" if column in ("case", "tokens") else "right")
    for row in rows:
        low, high = row["tokens_per_s_range"]
        table.add_row(row["setting"], f"{row['tokens_per_s']:.1f} ({low:.1f}-{high:.1f})", f"{row['speedup']:.2f}x",
                      f"{row['tpf']:.2f}", str(row["nfe"]),
                      f"{row['latency_p50_s'] * 1e3:.1f} / {row['latency_p90_s'] * 1e3:.1f} ms",
                      f"{row['step_p50_s'] * 1e3:.2f} / {row['step_p90_s'] * 1e3:.2f} ms",
                      f"{row['host_fraction']:.1%}", size(row["peak_memory_bytes"]), row["tokens_sha256"][:12],
                      "yes" if row["same_tokens"] else "NO")
    return table
