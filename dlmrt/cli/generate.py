"""`dlmrt generate`: decode prompts with a policy and cache mode, on one process or on the ranks of a split model,
and print the text (streamed block by block, or as JSON) and the metrics."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import warnings

import click

from dlmrt.cli.backends import BACKENDS, check_precision, once, open_backend
from dlmrt.cli.errors import reports_errors, show_warning
from dlmrt.cli.model_param import model_param
from dlmrt.cli.options import MODEL_HELP, backend_options, decoding_options, parse_ids, torch_backend_options
from dlmrt.cli.parallel import checked_plan, parallel_options
from dlmrt.cli.progress import CompileNotes, step_progress


@click.command("generate")
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

    console = Console(stderr=True)

    @once
    def settings_and_batch(model):
        settings = settings_with_defaults(model, ignore_eos=ignore_eos, **decoding)
        for number, prompt in enumerate(prompts, start=1):
            text.require_utf8(prompt, f"--prompt {number}" if len(prompts) > 1 else "--prompt")
        return settings, [text.encode(model, p) for p in prompts] if prompts else id_prompts

    notes = CompileNotes()
    model, backend_impl = open_backend(
        backend, model_dir, dtype=dtype, mode=mode, max_batch=max_batch, device=device, engines=engines,
        precision=precision, console=console, parallel=parallel,
        work=lambda model: cpu_mode.work_of(model, *settings_and_batch(model), max_batch), on_compile=notes)
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
        with step_progress(console, notes=notes) as advance:
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
