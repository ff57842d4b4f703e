"""The `dlmrt` command line: one click group, one subcommand per verb."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click

from dlmrt import TINY_MODEL_DIR, __version__
from dlmrt.errors import DlmrtError

DTYPE_CHOICES = ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "auto")


class UserError(click.ClickException):
    """A DlmrtError shown as one line, with exit status 2 (as click does for usage errors)."""

    exit_code = 2


def reports_errors(command):
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except DlmrtError as error:
            raise UserError(str(error)) from None
    return wrapper


def parse_ids(value: str) -> list[int]:
    try:
        return [int(part) for part in value.replace(" ", "").split(",") if part]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers like 1,2,3, got {value!r}",
                                 param_hint="--prompt-ids") from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dlmrt")
def main() -> None:
    """dlmrt: fast inference for diffusion language models (LLaDA, LLaDA2.x, ORL)."""


@main.command()
@click.option("--model", "model_dir", type=click.Path(path_type=Path), default=None,
              help="Hugging Face model directory (default: the tiny model shipped with dlmrt).")
@click.option("--prompt", "prompts", multiple=True, metavar="TEXT",
              help="Prompt text (no chat template is applied). Repeat for a batch.")
@click.option("--prompt-ids", "prompt_ids", multiple=True, metavar="1,2,3",
              help="Prompt as raw token ids. Repeat for a batch.")
@click.option("--gen-length", type=int, default=None,
              help="Tokens to generate [default: the model's generation_config, else 128].")
@click.option("--block-length", type=int, default=None,
              help="Semi-autoregressive block size [default: the model's, if it divides "
                   "--gen-length, else --gen-length].")
@click.option("--steps", type=int, default=None,
              help="Denoising steps in all [default: --gen-length, one token per step].")
@click.option("--remasking", type=click.Choice(("low_confidence", "random")), default="low_confidence",
              show_default=True, help="How to pick the positions committed at each step.")
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help="Gumbel-noise temperature; 0 is greedy.")
@click.option("--cfg-scale", type=float, default=0.0, show_default=True,
              help="Classifier-free guidance scale; 0 turns it off.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for sampling and random remasking.")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="float32", show_default=True,
              help="Weights' dtype; auto takes config.json's.")
@click.option("--json", "as_json", is_flag=True, help="Print outputs and metrics as JSON.")
@reports_errors
def generate(model_dir, prompts, prompt_ids, gen_length, block_length, steps, remasking, temperature,
             cfg_scale, seed, dtype, as_json):
    """Generate with the reference LLaDA loop (plain eager torch)."""
    if prompts and prompt_ids:
        raise click.UsageError("give either --prompt or --prompt-ids, not both")
    if not prompts and not prompt_ids:
        raise click.UsageError("give at least one --prompt or --prompt-ids")
    id_prompts = [parse_ids(value) for value in prompt_ids]

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    import dlmrt
    from dlmrt.runtime import reference, text

    model = dlmrt.load(model_dir or TINY_MODEL_DIR, dtype=dtype)
    defaults = model.generation_config
    if gen_length is None:
        gen_length = defaults.get("gen_length", 128)
    if block_length is None:
        default_block = defaults.get("block_length", gen_length)
        block_length = default_block if default_block > 0 and gen_length % default_block == 0 else gen_length
    settings = reference.GenerationSettings(
        gen_length=gen_length, block_length=block_length, steps=gen_length if steps is None else steps,
        remasking=remasking, temperature=temperature, cfg_scale=cfg_scale, seed=seed)
    batch = [text.encode(model, p) for p in prompts] if prompts else id_prompts

    console = Console(stderr=True)
    with Progress(TextColumn("denoising"), BarColumn(), MofNCompleteColumn(), transient=True,
                  console=console, disable=not console.is_terminal) as progress:
        bar = progress.add_task("steps", total=settings.steps)
        result = reference.generate(model, batch, settings, on_step=lambda: progress.advance(bar))

    outputs = []
    for row in result.tokens.tolist():
        ids = text.completion(row, model.tokens.eos_ids)
        outputs.append({"token_ids": ids, "text": text.decode(model, ids),
                        "finish_reason": "eos" if len(ids) < len(row) else "length"})
    if as_json:
        click.echo(json.dumps({"outputs": outputs, "metrics": result.metrics.to_dict()}))
    else:
        for output in outputs:
            click.echo(output["text"] if output["text"] is not None else ",".join(map(str, output["token_ids"])))


if __name__ == "__main__":
    sys.exit(main())
