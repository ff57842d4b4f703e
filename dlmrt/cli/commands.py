"""The `dlmrt` command line: one click group, one subcommand per verb."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import click

from dlmrt import TINY_MODEL_DIR, __version__
from dlmrt.core import limits
from dlmrt.core.home import keep_compiled_steps
from dlmrt.cli.model_param import model_param
from dlmrt.cli.parallel import checked_plan, parallel_options
from dlmrt.quant.cpu_int import BLOCK_SIZES as CPU_INT_BLOCK_SIZES
from dlmrt.export.cpu_quantized import PRECISIONS as CPU_INT_PRECISIONS
from dlmrt.cli.errors import UserError, guarded, reports_errors, require_onnx_extra, show_warning
from dlmrt.cli.types import FLOAT32, LENGTH
from dlmrt.cli.bench import bench_command
from dlmrt.cli.serve import serve_command
from dlmrt.cli.engines import build_command, inspect_command
from dlmrt.cli.backends import BACKENDS, check_precision, open_backend
from dlmrt.runtime.policy_registry import LLADA21_PRESETS, POLICIES

if TYPE_CHECKING:
    from rich.table import Table

    from dlmrt.eval.evaluation import Setting, SettingScore
    from dlmrt.runtime.backend import Backend
    from dlmrt.runtime import GenerationSettings
    from dlmrt.core.tasks import Example

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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dlmrt")
@click.option("--debug", is_flag=True, help="Show the traceback of an internal error (or set DLMRT_DEBUG=1).")
def main(debug: bool) -> None:
    """dlmrt: fast inference for diffusion language models (LLaDA, LLaDA2.x, ORL)."""


def run() -> None:
    """The installed `dlmrt` command: the group under the guard of last resort."""
    keep_compiled_steps()  # so that a later process compiles nothing
    sys.exit(guarded(main, sys.argv[1:]))


main.add_command(bench_command)
main.add_command(serve_command)
main.add_command(build_command)
main.add_command(inspect_command)


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


@main.command()
@model_param(help=MODEL_HELP)
@click.option("--prompt", "prompts", multiple=True, metavar="TEXT",
              help="Prompt text (no chat template is applied). Repeat for a batch.")
@click.option("--prompt-ids", "prompt_ids", multiple=True, metavar="1,2,3",
              help="Prompt as raw token ids. Repeat for a batch.")
@decoding_options
@click.option("--ignore-eos", is_flag=True,
              help="Decode the full length after end-of-sequence, as the research scripts do.")
@click.option("--backend", type=click.Choice((*BACKENDS, "reference")), default="torch",
              show_default=True,
              help="torch: the step loop in PyTorch (see --mode); ort: the exported ONNX step graphs in ONNX Runtime "
                   "(--model is an export directory, or a model directory exported on first use); trt: the "
                   "TensorRT engines `dlmrt build` stored for this GPU (--model is the export directory they were "
                   "built from); reference: LLaDA's plain loop (fixed policy, no cache), the oracle the others are "
                   "tested against.")
@torch_backend_options
@backend_options
@click.option("--stream", is_flag=True, help="Print committed text block by block as it is decoded.")
@click.option("--metrics", "show_metrics", is_flag=True, help="Print a metrics table on stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print outputs and metrics as JSON.")
@parallel_options
@reports_errors
def generate(model_dir, prompts, prompt_ids, ignore_eos, backend, mode, max_batch, device, engines, precision,
             stream, show_metrics, as_json, dtype, tp, ep, **decoding):
    """Generate from prompts with a decoding policy and cache mode."""
    if prompts and prompt_ids:
        raise click.UsageError("give either --prompt or --prompt-ids, not both")
    if not prompts and not prompt_ids:
        raise click.UsageError("give at least one --prompt or --prompt-ids")
    id_prompts = [parse_ids(value) for value in prompt_ids]
    run = functools.partial(_generate, model_dir, prompts, id_prompts, ignore_eos, backend, mode, max_batch, device,
                            engines, precision, stream, show_metrics, as_json, dtype, decoding)
    if max(tp, ep) == 1:
        return run(None)
    from dlmrt.parallel import launch

    check_precision(backend, precision, engines, parallel=True)
    plan, rank_device = checked_plan(tp, ep, backend, model_dir, dtype, device)
    if launch.launched_by_torchrun():
        return launch.run_as_launched_rank(_generate_on_rank, (plan, run), device=rank_device)
    launch.run_ranks(_generate_on_rank, plan.world, (plan, run), device=rank_device)
    return None


def once(function):
    """`function(model)` computed at its first call and returned again after: a command's settings, which
    `open_backend` may need first (for `--mode auto`'s work), and which warn only once."""
    results = []

    def first_result(model):
        if not results:
            results.append(function(model))
        return results[0]
    return first_result


def _generate_on_rank(ranks, plan, run):
    """`dlmrt generate` on one rank: rank 0 alone prints, streams, reports and warns (in one line, as the
    command does)."""
    if ranks.rank == 0:
        with warnings.catch_warnings():
            warnings.showwarning = show_warning
            return run((plan, ranks))
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        return run((plan, ranks))


def _generate(model_dir, prompts, id_prompts, ignore_eos, backend, mode, max_batch, device, engines, precision, stream,
              show_metrics, as_json, dtype, decoding, parallel):
    """The body of `dlmrt generate`, on one process or on each rank of `parallel` (a plan and its Ranks)."""
    from rich.console import Console

    from dlmrt.runtime import Generator, cpu_mode, reference, text
    from dlmrt.runtime.settings import settings_with_defaults
    from dlmrt.runtime.torch_backend import TorchBackend

    console = Console(stderr=True)

    @once
    def settings_and_batch(model):
        settings = settings_with_defaults(model, ignore_eos=ignore_eos, **decoding)
        for number, prompt in enumerate(prompts, start=1):
            text.require_utf8(prompt, f"--prompt {number}" if len(prompts) > 1 else "--prompt")
        return settings, [text.encode(model, p) for p in prompts] if prompts else id_prompts

    model, backend_impl = open_backend(
        backend, model_dir, dtype=dtype, mode=mode, max_batch=max_batch, device=device, engines=engines,
        precision=precision, console=console, parallel=parallel,
        work=lambda model: cpu_mode.work_of(model, *settings_and_batch(model), max_batch))
    settings, batch = settings_and_batch(model)

    if backend == "reference":
        if stream:
            raise click.UsageError("--stream needs --backend torch")
        out = reference.generate(model, batch, settings)
        completions = [text.completion(row, model.tokens.eos_ids) for row in out.tokens.tolist()]
        rows = [(ids, "eos" if len(ids) < settings.gen_length else "length") for ids in completions]
        metrics = out.metrics
    else:
        generator = Generator(backend_impl)
        with step_progress(console) as advance:
            if isinstance(backend_impl, TorchBackend):
                backend_impl.on_compile = advance.note
            run = generator.stream(batch, settings, on_step=advance)
            for update in run:
                if stream:
                    print_update(model, update, len(batch), as_json)
        rows = [(r.token_ids, r.finish_reason) for r in run.result.rows]
        metrics = run.result.metrics

    outputs = []
    for ids, reason in rows:
        outputs.append({"token_ids": ids, "text": text.decode(model, ids), "finish_reason": reason})
    if as_json:
        click.echo(json.dumps({"outputs": outputs, "metrics": metrics.to_dict()}))
    elif not stream:
        for output in outputs:
            click.echo(output["text"] if output["text"] is not None else ",".join(map(str, output["token_ids"])))
    if show_metrics:
        console.print(metrics.table())


@main.command("export")
@click.argument("model_dir", type=click.Path(path_type=Path), required=False)
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="The export directory.")
@click.option("--opset", type=int, default=18, show_default=True, help="ONNX opset (18 or newer).")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="float32", show_default=True,
              help="Weights' dtype in the graphs (ONNX Runtime's CPU provider runs float32).")
@click.option("--block-length", type=int, default=None,
              help="Block-causal models: the block grid built into the graphs [default: the model's].")
@click.option("--max-batch", type=int, default=64, show_default=True, help="Largest batch the graphs take.")
@click.option("--max-length", type=int, default=None,
              help="Longest canvas (prompt + generated) the graphs take [default: the model's context].")
@click.option("--guidance", is_flag=True,
              help="Also export the classifier-free-guidance graphs (for generate --cfg-scale).")
@click.option("--verify", is_flag=True,
              help="Compare each graph with the torch step under Polygraphy (fp32 tolerances).")
@click.option("--verbose", is_flag=True, help="With --verify: also print Polygraphy's comparison log.")
@click.option("--precision", type=click.Choice(tuple(CPU_INT_PRECISIONS)), default=None,
              help="Quantize for ONNX Runtime on a CPU: int8 or int4 stores every weight MatMul as onnxruntime's "
                   "MatMulNBits, in blocks along its input width; int8-dynamic as MatMulInteger, its activations "
                   "quantized at each call (docs/engines.md#quantization) [default: float weights].")
@click.option("--quant-block-size", type=click.Choice(tuple(map(str, CPU_INT_BLOCK_SIZES))), default="32",
              show_default=True, help="With --precision int8 or int4: the weights' block size.")
@click.option("--asymmetric", is_flag=True,
              help="With --precision int8 or int4: a zero point for each block [default: symmetric].")
@reports_errors
def export_command(model_dir, output, opset, dtype, block_length, max_batch, max_length, guidance, verify,
                   verbose, precision, quant_block_size, asymmetric):
    """Export the step graphs of MODEL_DIR (default: the tiny model) to ONNX, with a manifest."""
    require_onnx_extra()
    from rich.console import Console
    from rich.table import Table

    import dlmrt
    from dlmrt.export.export_manifest import CANVAS_GRAPHS, ExportManifest
    from dlmrt.export.onnx_export import GRAPHS, export

    if precision not in ("int8", "int4") and (quant_block_size != "32" or asymmetric):
        raise click.UsageError("--quant-block-size and --asymmetric apply with --precision int8 or int4")
    if precision is not None and (verify or dtype != "float32"):
        raise click.UsageError(f"--precision {precision} quantizes a float32 export"
                               + (" (--verify compares at float32 tolerances, which quantized weights do not meet: "
                                  "measure it with dlmrt eval)" if verify else ": drop --dtype"))
    console = Console(stderr=True)
    model = dlmrt.load(model_dir or TINY_MODEL_DIR, dtype=dtype)
    if verify and model.noise == "uniform":
        raise click.UsageError("--verify runs the mask models' step graphs and does not cover a uniform-noise "
                               "export yet: drop --verify")
    graphs = len(CANVAS_GRAPHS) if model.noise == "uniform" else len(GRAPHS) * (1 + guidance)
    with contextlib.ExitStack() as stack:
        floats = output if precision is None else Path(stack.enter_context(tempfile.TemporaryDirectory())) / "float"
        with step_progress(console, "exporting: graph {task.completed} of %d" % graphs) as advance:
            export(model, floats, opset=opset, block_length=block_length, max_batch=max_batch,
                   max_length=max_length, guidance=guidance, on_graph=lambda graph: advance())
        if precision is not None:
            from dlmrt.quant.cpu_int import quantize_export

            with step_progress(console, f"quantizing to {precision}: graph {{task.completed}} of {graphs}") as advance:
                quantize_export(floats, output, precision=precision, block_size=int(quant_block_size),
                                symmetric=not asymmetric, on_graph=lambda graph: advance())
    manifest = ExportManifest.read(output)
    table = Table(title=f"{output} ({manifest.exported_s} s)")
    for column in ("file", "bytes", "sha256"):
        table.add_column(column)
    for name, digest in manifest.files.items():
        table.add_row(name, f"{(output / name).stat().st_size:,}", digest[:16])
    Console().print(table)
    if verify:
        from dlmrt.export.verify import checks_table, compare_with_torch

        with step_progress(console, "verifying: graph {task.completed} of %d" % len(manifest.graphs)) as advance:
            checks = compare_with_torch(model, output, manifest.model.block_grid, verbose=verbose,
                                        on_graph=lambda graph: advance())
        Console().print(checks_table(checks))
        failed = [graph for graph, check in checks.items() if not check.passed]
        if failed:
            raise UserError(f"{', '.join(failed)}: ONNX Runtime's outputs differ from the torch step's "
                            f"beyond fp32 tolerances")
        compared = ", ".join(next(iter(checks.values())).outputs)
        click.echo(f"verified: every graph's outputs ({compared}) match the torch step's")


def step_progress(console, label: str = "denoising: step {task.completed}"):
    """A transient "denoising step N" display on a terminal (a no-op elsewhere). It yields `advance()`;
    `advance.note(text)` shows `text` instead until the next advance (e.g. while compiling)."""
    from contextlib import contextmanager

    from rich.progress import Progress, SpinnerColumn, TextColumn

    @contextmanager
    def progress():
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), transient=True,
                      console=console, disable=not console.is_terminal) as bar:
            task = bar.add_task("", total=None)

            def show_count():
                bar.update(task, description=label.format(task=bar.tasks[0]))

            def advance():
                bar.advance(task)
                show_count()

            advance.note = lambda text: bar.update(task, description=text)
            show_count()
            yield advance
    return progress()


def print_update(model, update, batch_size, as_json):
    """One streamed block: its text (prefixed by the row in a batch), or a JSON line."""
    from dlmrt.runtime import text

    chunk = text.decode(model, update.token_ids)
    if as_json:
        click.echo(json.dumps({"row": update.row, "block": update.block, "token_ids": update.token_ids,
                               "text": chunk, "finish_reason": update.finish_reason}))
        return
    if chunk is None:
        chunk = ",".join(map(str, update.token_ids)) + ("," if update.token_ids else "")
    if batch_size == 1:
        click.echo(chunk, nl=update.finish_reason is not None)
    elif update.token_ids or update.finish_reason:
        click.echo(f"[{update.row}] {chunk}" + (f" <{update.finish_reason}>" if update.finish_reason else ""))


@main.command(name="eval")
@model_param(help=MODEL_HELP)
@click.option("--data", type=click.Path(path_type=Path, dir_okay=False), default=None, metavar="FILE.jsonl",
              help='Examples as JSONL: {"prompt": ..., "answer": ..., "task": ...} per line ("task" is '
                   "optional) [default: the task suite].")
@click.option("--tasks", "task_names", default=None, metavar="rev,sort,add",
              help="Task-suite tasks, comma-separated [default: rev,sort,add,same; the headroom tasks psum and "
                   "mul, which need --gen-length 32, only by name].")
@click.option("--per-task", type=click.IntRange(min=1), default=None,
              help="Task-suite examples per task [default: 100].")
@click.option("--split", type=click.Choice(("test", "train")), default=None,
              help="Task-suite split [default: test, the held-out prompts].")
@click.option("--data-seed", type=int, default=None, help="Seed that picks the task-suite examples [default: 0].")
@click.option("--setting", "setting_specs", multiple=True, metavar="POLICY[:key=value,...]",
              help="A decoding setting, e.g. fixed:steps=8, threshold:threshold=0.9,confidence=margin, "
                   "factor:factor=2, llada2:threshold=0.9,steps=8. Repeat for a grid [default: fixed at 1, "
                   "1/2 and 1/4 token per step, threshold 0.5-0.99, factor 1, 2, 4, 8].")
@eval_decoding_options
@click.option("--backend", type=click.Choice(BACKENDS), default="torch", show_default=True,
              help="torch: the step loop in PyTorch (see --mode); ort: the exported graphs in ONNX Runtime (--model "
                   "an export, or a model directory exported on first use); trt: the TensorRT engines stored for "
                   "this GPU (--model the export they were built from).")
@click.option("--mode", type=click.Choice(MODE_NAMES), default="auto", show_default=True,
              help="torch backend: eager, compile, cudagraph; auto is cudagraph on CUDA, and on a CPU compile "
                   "where the evaluation's work repays compiling, else eager.")
@backend_options
@click.option("--batch-size", type=click.IntRange(min=1), default=64, show_default=True,
              help="Examples decoded together.")
@click.option("--json", "json_path", type=click.Path(path_type=Path, dir_okay=False), default=None,
              metavar="PATH", help="Also write the results as JSON.")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path, dir_okay=False), default=None,
              metavar="PATH.png", help="Also plot exact-match against tokens per forward (needs matplotlib).")
@reports_errors
def evaluate(model_dir, data, task_names, per_task, split, data_seed, setting_specs, gen_length, block_length,
             cache, temperature, seed, dtype, steps_per_sync, backend, mode, device, engines, precision,
             batch_size, json_path, plot_path):
    """Exact-match and speed over a grid of decoding settings: the speed-quality curve."""
    suite_options = {"--tasks": task_names, "--per-task": per_task, "--split": split, "--data-seed": data_seed}
    if data is not None and any(value is not None for value in suite_options.values()):
        given = ", ".join(name for name, value in suite_options.items() if value is not None)
        raise click.UsageError(f"--data replaces the task suite: drop {given}")

    from dlmrt.eval import evaluation

    if plot_path is not None:
        if plot_path.suffix.lower() != ".png":
            raise click.BadParameter(f"the plot is a PNG: give a path ending in .png, got {str(plot_path)!r}",
                                     param_hint="--plot")
        evaluation.require_matplotlib()
    grid = [evaluation.parse_setting(spec) for spec in setting_specs]
    if data is not None:
        examples = evaluation.load_jsonl(data)
    else:
        examples = suite_examples(task_names, per_task or 100, split or "test", data_seed or 0)

    from rich.console import Console

    from dlmrt.runtime import Fixed, GenerationSettings, cpu_mode, text
    from dlmrt.runtime.settings import lengths_with_defaults

    @once
    def base_and_grid(model):
        lengths = lengths_with_defaults(model, gen_length, block_length)
        base = GenerationSettings(gen_length=lengths[0], block_length=lengths[1], policy=Fixed(),
                                  temperature=temperature, seed=seed, cache=cache, steps_per_sync=steps_per_sync)
        base.validate()
        return base, grid or evaluation.default_grid(*lengths, model.noise)

    def work(model):  # every setting of the grid decodes every example
        base, settings = base_and_grid(model)
        prompts = [text.encode(model, example.prompt) for example in examples]
        return cpu_mode.work_of(model, base, prompts, batch_size, repeats=len(settings))

    model, backend_impl = open_backend(backend, model_dir, dtype=dtype, mode=mode, max_batch=batch_size,
                                       device=device, engines=engines, precision=precision,
                                       console=Console(stderr=True), work=work)
    base, grid = base_and_grid(model)
    gen_length, block_length = base.gen_length, base.block_length
    results = run_grid(model, backend_impl, examples, base, grid, batch_size)

    title = f"{model.name}: {len(examples)} examples, gen-length {gen_length}, block-length {block_length}"
    print_table(results_table(results, title))
    if json_path is not None:
        from dlmrt.core import atomic

        document = evaluation.results_document(model.name, len(examples), base, results)
        atomic.write_text(json_path, json.dumps(document, indent=2) + "\n")
    if plot_path is not None:
        evaluation.write_plot(results, plot_path, title)


def suite_examples(task_names: str | None, per_task: int, split: str, seed: int) -> list[Example]:
    from dlmrt.core import tasks

    chosen = tuple(tasks.TASKS) if task_names is None else \
        tuple(dict.fromkeys(name.strip() for name in task_names.split(",") if name.strip()))
    unknown = [name for name in chosen if name not in tasks.ALL_TASKS]
    if unknown or not chosen:
        raise click.BadParameter(f"expected task names from {', '.join(tasks.ALL_TASKS)}, comma-separated; "
                                 f"got {task_names!r}", param_hint="--tasks")
    return tasks.examples(split, per_task, seed, chosen)


def run_grid(model, backend: Backend, examples: Sequence[Example], base: GenerationSettings,
             grid: Sequence[Setting], batch_size: int) -> list[SettingScore]:
    """evaluation.evaluate_grid with a progress bar on stderr (on a terminal)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from dlmrt.eval import evaluation

    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("evaluating", total=len(examples) * len(grid))

        def advance(setting: Setting, count: int) -> None:
            bar.update(task, advance=count, description=setting.label)

        return evaluation.evaluate_grid(model, examples, base, grid, batch_size, on_batch=advance, backend=backend)


def print_table(table: Table) -> None:
    """On stdout: fitted to a terminal, at full width elsewhere (a file or pipe gets whole labels)."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        unbounded = console.options.update_width(10_000)
        console.width = max(console.width, console.measure(table, options=unbounded).maximum)
    console.print(table)


def results_table(results: Sequence[SettingScore], title: str) -> Table:
    """One row per setting, in the order given: exact-match per task and mean, then speed."""
    from rich.table import Table

    task_names = list(dict.fromkeys(task for r in results for task in r.score.per_task))
    table = Table(title=title)
    table.add_column("setting")
    for name in (*task_names, "mean"):
        table.add_column(name, justify="right")
    for name in ("TPF", "tokens/s", "NFE"):
        table.add_column(name, justify="right")
    for r in results:
        scores = [f"{r.score.per_task[name]:.1%}" for name in task_names]
        metrics = r.score.metrics
        table.add_row(r.setting.label, *scores, f"{r.score.mean:.1%}", f"{metrics.tpf:.2f}",
                      f"{metrics.tokens_per_s:.0f}", f"{metrics.nfe}")
    return table
