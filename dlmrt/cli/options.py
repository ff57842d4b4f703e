"""The options the decoding commands share (`generate`, `eval`): the decoding knobs by name, how the torch
backend runs, which device and engine; and `--prompt-ids`' parser."""

from __future__ import annotations

from pathlib import Path

import click

from dlmrt.cli.types import FLOAT32, LENGTH
from dlmrt.core import limits
from dlmrt.runtime.policy_registry import LLADA21_PRESETS, POLICIES

DTYPE_CHOICES = ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "auto")
CACHE_NAMES = ("none", "prefix", "dual")
MODE_NAMES = ("auto", "eager", "compile", "cudagraph")
MODEL_HELP = ("A Hugging Face model directory, or an export for --backend ort/trt [default: the tiny model shipped "
              "with dlmrt].")


def parse_ids(value: str) -> list[int]:
    """Comma-separated token ids; spaces only around the commas ("1 3" is an error, not 13)."""
    parts = [part.strip() for part in value.split(",")]
    if not all(part.isascii() and part.isdigit() and len(part) <= 18 for part in parts):
        raise click.BadParameter(f"expected comma-separated token ids like 1,2,3, got {value!r}",
                                 param_hint="--prompt-ids")
    return [int(part) for part in parts]


# The decoding options by name; `generate` takes them all, `eval` the ones its grid does not set.
DECODING_OPTIONS = {
    "gen_length": click.option(
        "--gen-length", type=LENGTH, default=None,
        help="Tokens to generate [default: the model's generation_config, else 128]."),
    "block_length": click.option(
        "--block-length", type=LENGTH, default=None,
        help="Semi-autoregressive block size [default: the model's, if it divides --gen-length, else "
             "--gen-length]."),
    "policy": click.option(
        "--policy", type=str, default=None, metavar="NAME",
        help=f"Decoding policy: {'; '.join(f'{name} ({entry.description})' for name, entry in POLICIES.items())} "
             f"[default: llada2 for llada2_moe models, entropy_bound for uniform-noise models (diffusion_gemma), "
             f"else fixed]."),
    "steps": click.option(
        "--steps", type=LENGTH, default=None,
        help="fixed: denoising steps in all [default: --gen-length]; llada2: steps per block [default: 32]; "
             "entropy_bound: at most this many steps per block [default: the model's max_denoising_steps, else 48]."),
    "remasking": click.option(
        "--remasking", type=click.Choice(("low_confidence", "random")), default="low_confidence",
        show_default=True, help="fixed: how to pick the positions committed at each step."),
    "threshold": click.option(
        "--threshold", type=FLOAT32, default=None,
        help="threshold, residual: commit every position at least this confident [default: 0.9]; "
             "llada2, llada21: strictly above [default: 0.95]."),
    "factor": click.option(
        "--factor", type=FLOAT32, default=None, help="factor, residual: Fast-dLLM's factor rule [default: 1.0]."),
    "confidence": click.option(
        "--confidence", type=click.Choice(("prob", "margin", "entropy")), default="prob", show_default=True,
        help="Confidence measure for threshold, factor, llada2, residual."),
    "minimal_topk": click.option(
        "--minimal-topk", type=LENGTH, default=1, show_default=True,
        help="llada2: caps its steps per block at gen-length // minimal-topk."),
    "editing_threshold": click.option(
        "--editing-threshold", type=FLOAT32, default=None,
        help="llada21: overwrite a generated token of the block whose argmax differs, when its probability is "
             "strictly above this; 1 turns editing off [default: 0.9]."),
    "max_post_steps": click.option(
        "--max-post-steps", type=int, default=None,
        help="llada21: editing-only steps a block may take once it has no mask [default: 16]."),
    "preset": click.option(
        "--preset", type=click.Choice(tuple(LLADA21_PRESETS)), default=None,
        help="llada21: LLaDA2.1's modes, quality (threshold 0.7, editing 0.5, 16 post steps) or speed "
             "(threshold 0.5, editing off); explicit options override them."),
    "entropy_bound": click.option(
        "--entropy-bound", type=FLOAT32, default=None,
        help="entropy_bound: keep the lowest-entropy samples while the entropies before them sum to at most "
             "this [default: the model's sampler_config, else 0.1]."),
    "cache": click.option(
        "--cache", type=click.Choice(CACHE_NAMES), default="none", show_default=True,
        help="K/V cache: none, prefix (the exact block cache for block-causal models) or dual."),
    "max_block_steps": click.option(
        "--max-block-steps", type=LENGTH, default=None,
        help="Step budget per block; the last step commits what is left."),
    "steps_per_sync": click.option(
        "--steps-per-sync", type=LENGTH, default=None,
        help="Steps run on the device between two reads of whether the block is done [default: 1 on a CPU; "
             "on CUDA, what the tokens per forward so far say the block needs]."),
    "temperature": click.option(
        "--temperature", type=FLOAT32, default=0.0, show_default=True,
        help="Gumbel-noise temperature; 0 is greedy."),
    "cfg_scale": click.option(
        "--cfg-scale", type=FLOAT32, default=0.0, show_default=True,
        help="Classifier-free guidance scale; 0 turns it off."),
    "seed": click.option(
        "--seed", type=click.IntRange(0, limits.MAX_SEED), default=0, show_default=True,
        help="Seed for sampling and random remasking (row i uses seed + i)."),
    "dtype": click.option(
        "--dtype", type=click.Choice(DTYPE_CHOICES), default="float32", show_default=True,
        help="Weights' dtype; auto takes config.json's."),
}


def options(*names: str):
    """A decorator adding the named DECODING_OPTIONS, in the order given."""
    def decorate(command):
        for name in reversed(names):
            command = DECODING_OPTIONS[name](command)
        return command
    return decorate


decoding_options = options(*DECODING_OPTIONS)
eval_decoding_options = options("gen_length", "block_length", "cache", "temperature", "seed", "dtype",
                                "steps_per_sync")


def torch_backend_options(command):
    """--mode and --max-batch: how the torch backend runs the step loop."""
    command = click.option(
        "--max-batch", type=click.IntRange(min=1), default=64, show_default=True,
        help="torch backend: the largest batch bucket (prompts decoded together).")(command)
    return click.option(
        "--mode", type=click.Choice(MODE_NAMES), default="auto", show_default=True,
        help="torch backend: eager (op by op), compile (torch.compile of the steps; compiled once per "
             "shape, cached under $DLMRT_HOME/inductor), cudagraph (CUDA graphs); auto is cudagraph on CUDA, and "
             "on a CPU compile where the command's work repays compiling, else eager.")(command)


def backend_options(command):
    """--device, where the torch and ort backends run; --engines and --precision, which stored TensorRT
    engine --backend trt runs."""
    command = click.option(
        "--device", type=click.Choice(("auto", "cpu", "cuda")), default="auto", show_default=True,
        help="torch and ort backends: where to run; auto is the GPU where one is visible (and, for ort, "
             "onnxruntime-gpu is installed), else the CPU. trt runs on the GPU.")(command)
    command = click.option(
        "--precision", type=click.Choice(("bf16", "fp16", "fp8", "nvfp4")), default=None,
        help="trt backend: which stored engine to run [default: this GPU's default precision]; torch backend: "
             "fp8 runs the transformer blocks' linear layers in FP8 (e4m3, scaled per channel and per token; "
             "docs/fp8.md) [default: the model's --dtype].")(command)
    return click.option("--engines", type=click.Path(path_type=Path), default=None,
                        help="trt backend: the engine store [default: $DLMRT_HOME/engines].")(command)
