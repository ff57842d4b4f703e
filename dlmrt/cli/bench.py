"""`dlmrt bench`: latency and throughput of generate, backends and modes side by side, with the flags
of `vllm bench latency` and the diffusion knobs.

    dlmrt bench                                                  # the tiny model, torch eager
    dlmrt bench --model llada-512x6 --backend torch:eager,torch:compile,ort --batch-size 4 \
        --input-len 64 --output-len 128 --num-iters 5 --output-json bench.json

Every case decodes the same seeded random prompts (`--batch-size` of `--input-len` ids) to the full
`--output-len` (end-of-sequence ignored, as `vllm bench latency` does). Cases of one runtime run in
turn, round by round, after `--num-iters-warmup` untimed runs each. The first case is the baseline
of the speed ratios, and each case's tokens are hashed: "same tokens" compares them with the first.
`ort:int8`, `ort:int4` and `ort:int8-dynamic` run the ort case's export quantized for a CPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from dlmrt.bench import gate as bench_gate
from dlmrt.bench import suite as bench_suite
from dlmrt.bench.backend_specs import TORCH_SPEC, torch_case
from dlmrt.bench.machine import machine_class
from dlmrt.core import file_reads, limits
from dlmrt.bench.suite import Scenario
from dlmrt.cli.errors import reports_errors, require_onnx_extra
from dlmrt.cli.model_param import model_param
from dlmrt.cli.types import BATCH_SIZES, FLOAT32, LENGTH
from dlmrt.core.errors import ArgumentError

POLICIES = ("fixed", "threshold", "factor", "llada2", "entropy_bound")
# The results table's width where the output is no terminal (on a terminal, the terminal's): the
# default table fits 100 columns, the --wide one about 170.
TABLE_WIDTH, WIDE_TABLE_WIDTH = 100, 180
COMMANDLINE = click.core.ParameterSource.COMMANDLINE


def parse_backends(spec: str) -> list[tuple[str, str | None]]:
    """`torch:eager,torch:fp8,ort,ort:int8,reference` -> [("torch", "eager"), ("torch", "auto:fp8"), ("ort", None),
    ("ort", "int8"), ("reference", None)]: a torch case with fp8 runs the blocks' linears in FP8, an ort case with
    a precision the export quantized for a CPU (`dlmrt export --precision`)."""
    from dlmrt.export.cpu_quantized import PRECISIONS

    found = []
    for part in (p.strip() for p in spec.split(",")):
        name, _, mode = part.partition(":")
        if name == "torch" and torch_case(mode) is not None:
            found.append(("torch", torch_case(mode)))
        elif name == "ort" and (not mode or mode in PRECISIONS):
            found.append((name, mode or None))
        elif name == "reference" and not mode:
            found.append((name, None))
        else:
            raise click.BadParameter(f"unknown backend {part!r}: give {TORCH_SPEC}, "
                                     f"ort[:{'|'.join(PRECISIONS)}] or reference, comma-separated",
                                     param_hint="--backend")
    if len(set(found)) != len(found):
        raise click.BadParameter(f"{spec!r} names a backend twice", param_hint="--backend")
    return found


def option_name(ctx: click.Context, dest: str) -> str:
    """The option a user typed for a parameter (`model_name` is --model)."""
    return next(param.opts[0] for param in ctx.command.params if param.name == dest)


SCENARIO_OPTIONS = ("model_name", "backend_spec", "batch_size", "input_len", "output_len", "num_iters",
                    "num_iters_warmup", "policy", "threshold", "factor", "steps", "cache", "block_length", "dtype",
                    "device", "seed")


@click.command("bench")
@model_param("model_name", metavar="DIR|NAME", path=False,
             help="A model directory, or a random-weight config: llada-512x6, llada-1024x8, llada-8b (for a GPU), "
                  "llada2-moe-small, llada2.1-mini (for a GPU) [default: the tiny model].")
@click.option("--backend", "backend_spec", default="torch:eager", show_default=True,
              metavar="torch[:MODE][:fp8],ort[:PRECISION],reference",
              help="Backends and modes compared side by side, comma-separated; the first is the baseline of the "
                   "speed ratios. torch:fp8 and torch:cudagraph:fp8 run the blocks' linears in FP8 (docs/fp8.md); "
                   "ort:int8, ort:int4 and ort:int8-dynamic run the export quantized for a CPU.")
@click.option("--batch-size", type=BATCH_SIZES, default="1", show_default=True,
              help="Rows of the batch; with --roofline, a comma-separated list (1,8,64).")
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
@click.option("--steps", type=LENGTH, default=None,
              help="fixed: steps in all; llada2 and entropy_bound: at most per block.")
@click.option("--cache", type=click.Choice(("none", "prefix", "dual")), default=None,
              help="[default: dual; prefix for block-causal models, whose exact block cache it is; none for "
                   "uniform-noise models]")
@click.option("--block-length", type=LENGTH, default=None, help="[default: 32, or --output-len if smaller]")
@click.option("--dtype", type=click.Choice(("auto", "float32", "bfloat16", "float16")), default="auto",
              show_default=True, help="auto: float32, with --roofline bfloat16 (a model directory: its config's).")
@click.option("--device", type=click.Choice(("cpu", "cuda")), default="cpu", show_default=True)
@click.option("--seed", type=click.IntRange(0, limits.MAX_SEED), default=0, show_default=True,
              help="Seeds the prompts.")
@click.option("--wide", is_flag=True, help="A wider table: also each case's tokens/s range, p90 step time, latency, "
                                           "host share, peak memory and token digest.")
@click.option("--output-json", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Also write the results, settings and environment as JSON.")
@click.option("--suite", type=click.Path(path_type=Path, dir_okay=False, exists=True), default=None,
              help="Run a suite's scenarios (TOML) instead of one scenario from the options.")
@click.option("--scenario", "scenario_names", multiple=True, metavar="NAME", help="With --suite: only these.")
@click.option("--baseline", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="With --suite: the baseline to --check against, or to write with --update-baseline.")
@click.option("--check", is_flag=True, help="Fail (exit 1) on a changed output or a slower ratio than the baseline.")
@click.option("--update-baseline", is_flag=True, help="Write this run as the new baseline (atomically).")
@click.option("--summary", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="With --check: a Markdown summary of the gate.")
@click.option("--junit", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="With --check: JUnit XML, one test case per scenario.")
@click.option("--history", type=click.Path(path_type=Path, dir_okay=False), default=None, metavar="FILE.jsonl",
              help="Append this run (ratios, digests, environment) as one JSON line.")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path, dir_okay=False), default=None,
              metavar="PATH.png", help="Plot each speed ratio's trend over --history (or this run) and the "
                                       "speed-quality points (needs matplotlib).")
@click.option("--roofline", is_flag=True, help="Count one step on meta tensors instead: each row's bytes, FLOPs and "
              "floor on --gpu, per --batch-size; with --device given, also measured there (docs/roofline.md).")
@click.option("--gpu", "gpu_name", default=None, metavar="NAME", help="With --roofline: h100, h200 (4.2 TB/s "
              "measured), h200-nominal, rtx5090 or b200 [default: h200].")
@click.option("--precision", type=click.Choice(("fp8",)), default=None, help="With --roofline: the blocks' linears "
              "in FP8 (timed cases name it in --backend: torch:cudagraph:fp8) [default: the model's --dtype].")
@click.pass_context
@reports_errors
def bench_command(ctx, wide, output_json, suite, scenario_names, baseline, check, update_baseline, summary, junit,
                  history, plot_path, roofline, gpu_name, precision, **options):
    """Latency and throughput of generate: tokens/s, TPF, NFE, latency per request and per step."""
    import time

    if roofline:
        return run_roofline(ctx, options, gpu_name or "h200", output_json, precision)
    if gpu_name is not None:
        raise click.UsageError("--gpu names the GPU of a roofline's floors: it needs --roofline")
    if precision is not None:
        raise click.UsageError("--precision applies to --roofline: a timed case names fp8 in --backend, as "
                               "torch:cudagraph:fp8")
    if len(options["batch_size"]) > 1:
        raise click.UsageError("a list of batch sizes needs --roofline: a timed scenario runs one batch size")
    options["batch_size"] = options["batch_size"][0]
    started = time.monotonic()
    if plot_path is not None:
        from dlmrt.eval.evaluation import require_matplotlib

        if plot_path.suffix.lower() != ".png":
            raise click.BadParameter(f"the plot is a PNG: give a path ending in .png, got {str(plot_path)!r}",
                                     param_hint="--plot")
        require_matplotlib()
    # dlmrt.bench reads these itself: a FIFO or a device there would hold the command, so they are checked first
    read_here = ((suite, limits.MAX_CONFIG_BYTES, "a bench suite"), (history, limits.MAX_DATA_BYTES, "a bench history"))
    for path, most, what in read_here:
        if path is not None and path.exists():
            file_reads.check_regular(path, bench_suite.SuiteError, most=most, what=what)
    past = bench_suite.read_history(history) if history is not None else []  # a bad history fails first
    failed = None
    if suite is None:
        if scenario_names or baseline or check or update_baseline or summary or junit:
            raise click.UsageError("--scenario, --baseline, --check, --update-baseline, --summary and --junit "
                                   "need --suite")
        scenario = Scenario(model=options["model_name"], backends=tuple(options["backend_spec"].split(",")),
                            **{k: v for k, v in options.items() if k not in ("model_name", "backend_spec")})
        results = {scenario.name: run_and_show(scenario, wide)}
        suite_name = None
    else:
        given = [name for name in SCENARIO_OPTIONS
                 if ctx.get_parameter_source(name) == COMMANDLINE]
        if given:
            raise click.UsageError(f"--suite sets every scenario's options: drop {option_name(ctx, given[0])}, "
                                   f"or set it in the suite")
        if (check or update_baseline) and baseline is None:
            raise click.UsageError("--check and --update-baseline need --baseline FILE")
        if check and update_baseline:
            raise click.UsageError("give --check or --update-baseline, not both")
        suite_name, scenarios = bench_suite.load_suite(suite)
        expected = bench_gate.load_baseline(baseline, suite_name) if check else None
        known = {s.name for s in scenarios}
        unknown = [name for name in scenario_names if name not in known]
        if unknown:
            raise ArgumentError(f"{suite} has no scenario {unknown[0]!r} (it has: {', '.join(sorted(known))})")
        scenarios = [s for s in scenarios if not scenario_names or s.name in scenario_names]
        results = {s.name: run_and_show(s, wide, gated=True) for s in scenarios}
        if check:  # a failed gate's run still goes into the history and the plot
            findings, verdict = bench_gate.run_gate(
                suite_name, scenarios, results, expected, machine_class(),
                lambda again: run_and_show(again, wide, gated=True), summary, junit, started)
            if findings:
                failed = click.ClickException(verdict)
            else:
                click.echo(verdict, err=True)
        if update_baseline:  # other machine classes' timings are kept, and with a subset the other scenarios
            kept = bench_gate.load_baseline(baseline, suite_name) if baseline.exists() else None
            recorded = bench_gate.record(suite_name, results, machine_class())
            bench_gate.save_baseline(baseline, bench_gate.updated(kept, recorded, subset=bool(scenario_names)))
    if output_json is not None:
        from dlmrt.bench.scenario_run import write_results

        write_results(output_json, suite_name, results)
    if history is not None or plot_path is not None:
        from dlmrt.bench.benchmark import environment

        entry = bench_suite.history_entry(suite_name, results, environment())
        if history is not None:
            bench_suite.append_history(history, entry)
        if plot_path is not None:
            bench_suite.write_plot([*past, entry], plot_path, f"dlmrt bench: {suite_name or 'one scenario'}")
    if failed is not None:
        raise failed


# What --roofline reads; any other option given with it is refused.
ROOFLINE_OPTIONS = ("model_name", "batch_size", "input_len", "output_len", "block_length", "cache", "dtype", "device",
                    "output_json", "roofline", "gpu_name", "precision")


def run_roofline(ctx: click.Context, options: dict, gpu_name: str, output_json: Path | None,
                 precision: str | None) -> None:
    """`--roofline` (dlmrt.bench.roofline_report); with --device given, the step is also measured there."""
    from rich.console import Console

    from dlmrt.bench import hardware, roofline_report
    from dlmrt.bench.models import meta_model
    from dlmrt.bench.roofline import in_precision

    source = ctx.get_parameter_source
    given = [p.name for p in ctx.command.params if p.name not in ROOFLINE_OPTIONS and source(p.name) == COMMANDLINE]
    if given:
        raise click.UsageError(f"--roofline counts one step of the model: drop {option_name(ctx, given[0])}")
    gpu = hardware.gpu(gpu_name)
    meta = in_precision(meta_model(options["model_name"], options["dtype"]), precision)
    measured_on = None
    if source("device") == COMMANDLINE:
        from dlmrt.bench.models import open_model

        measured_on = in_precision(open_model(options["model_name"], str(meta.dtype).removeprefix("torch."),
                                              options["device"]), precision)
    roofline_report.run(meta, gpu, options["batch_size"], input_len=options["input_len"],
                        output_len=options["output_len"], block_length=options["block_length"], cache=options["cache"],
                        console=Console(width=None if sys.stdout.isatty() else WIDE_TABLE_WIDTH),
                        measured_on=measured_on, output_json=output_json)


def run_and_show(scenario: Scenario, wide: bool, gated: bool = False) -> dict:
    """`dlmrt.bench.scenario_run.run_scenario` with its progress on stderr, then its table printed (`wide`: with
    every column); its results returned."""
    from rich.console import Console

    from dlmrt.bench.scenario_run import run_scenario

    backends = parse_backends(",".join(scenario.backends))
    if any(name == "ort" for name, _ in backends):
        require_onnx_extra()
    run = run_scenario(scenario, backends, Console(stderr=True), gated)
    Console(width=None if sys.stdout.isatty() else WIDE_TABLE_WIDTH if wide else TABLE_WIDTH).print(
        results_table(run.result["cases"], f"{scenario.name}: {run.result['model']}", scenario.batch_size,
                      scenario.input_len, run.settings, run.result["exact_match"], wide))
    return run.result


def results_table(rows: list[dict], title: str, batch: int, input_len: int, settings, exact_match: dict | None,
                  wide: bool = False):
    """What comparing cases needs first (speed, its ratio, steps, time a step, the same tokens), in
    100 columns; `wide` adds the ranges and p90s, latency, host share, peak memory and token digest."""
    from rich.table import Table

    from dlmrt.core.limits import size

    same = {None: "-", True: "yes", False: "NO"}
    columns = [("case", lambda row: row["setting"]),
               ("tokens/s", lambda row: f"{row['tokens_per_s']:.1f}"),
               (f"vs {rows[0]['setting']}", lambda row: f"{row['speedup']:.2f}x"),
               ("TPF", lambda row: f"{row['tpf']:.2f}"),
               ("NFE", lambda row: str(row["nfe"])),
               ("ms/step", lambda row: f"{row['step_p50_s'] * 1e3:.2f}"),
               ("same tokens", lambda row: same[row["same_tokens"]])]
    if wide:
        columns += [("tokens/s range", lambda row: "{:.1f}-{:.1f}".format(*row["tokens_per_s_range"])),
                    ("ms/step p90", lambda row: f"{row['step_p90_s'] * 1e3:.2f}"),
                    ("latency p50 / p90 (ms)",
                     lambda row: f"{row['latency_p50_s'] * 1e3:.1f} / {row['latency_p90_s'] * 1e3:.1f}"),
                    ("host", lambda row: f"{row['host_fraction']:.1%}"),
                    ("peak memory", lambda row: size(row["peak_memory_bytes"]) if row["peak_memory_bytes"] else "-"),
                    ("tokens", lambda row: row["tokens_sha256"][:12])]
    exact = f", exact match {exact_match['correct']}/{exact_match['total']}" if exact_match is not None else ""
    table = Table(title=f"{title}: batch {batch}, input {input_len}, output {settings.gen_length} in blocks of "
                        f"{settings.block_length}, {settings.policy.name}, cache {settings.cache}{exact}",
                  caption=None if wide else "medians of the timed runs; --wide adds ranges, p90s, latency, memory")
    for header, _ in columns:
        table.add_column(header, justify="left" if header in ("case", "tokens") else "right")
    for row in rows:
        table.add_row(*(cell(row) for _, cell in columns))
    return table
