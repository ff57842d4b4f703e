"""`dlmrt build` and `dlmrt inspect`: TensorRT engines from an export, and what the store holds."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click

from dlmrt.cli.errors import print_line, reports_errors, require_onnx_extra
from dlmrt.core.errors import ArgumentError

DIMENSION_HELP = "{dim} range MIN:OPT:MAX (or one size) for the optimization profile [default: {default}]."
PRECISION_CHOICES = ("bf16", "fp16", "fp8", "nvfp4")
TARGET_CHOICES = ("auto", "sm_89", "sm_90", "sm_100", "sm_120")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


def parse_size(text: str | None) -> int | None:
    """Bytes from `8GiB`, `512MiB`, `4G` or a plain number of bytes."""
    if text is None:
        return None
    match = _SIZE.match(text)
    if match is None:
        raise ArgumentError(f"--workspace {text!r}: expected a size like 8GiB, 512MiB or a number of bytes")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    power = "BKMGT".index(unit[0])
    return int(number * (1 << (10 * power)))


def dimension_options(command):
    for dim, default in reversed((("batch", "1:1:max-batch of the export"),
                                  ("window", "1:block length:max-length"), ("block", "as --window"),
                                  ("prefix", "1:max-length/2:max-length"))):
        command = click.option(f"--{dim}", default=None, metavar="MIN:OPT:MAX",
                               help=DIMENSION_HELP.format(dim=dim.capitalize(), default=default))(command)
    return command


@click.command("build")
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option("--target", type=click.Choice(TARGET_CHOICES), default="auto", show_default=True,
              help="GPU target; auto takes the running GPU's.")
@click.option("--precision", type=click.Choice(PRECISION_CHOICES), default=None,
              help="Engine precision [default: the target's first, bf16]. fp8 needs sm_89+, nvfp4 sm_100+.")
@click.option("--graph", "graphs", multiple=True, default=(),
              help="Step graphs to build (repeat) [default: full and cached; a uniform-noise export's encode, "
                   "decode and soft_tokens]; add full_guided / cached_guided for --cfg-scale.")
@dimension_options
@click.option("--workspace", default=None, help="Workspace memory pool limit, e.g. 8GiB [default: the target's].")
@click.option("--optimization-level", type=int, default=None,
              help="TensorRT builder optimization level 0-5 [default: 3].")
@click.option("--no-timing-cache", is_flag=True, help="Neither read nor update the store's timing cache.")
@click.option("--calibration", "calibration_file", type=click.Path(path_type=Path), default=None,
              help="fp8 / nvfp4: prompts to calibrate on, one per line or JSONL with a 'prompt' field "
                   "[default: the task suite].")
@click.option("--calibration-samples", type=int, default=32, show_default=True,
              help="fp8 / nvfp4: step-graph inputs recorded for calibration.")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="Engine store [default: $DLMRT_HOME/engines].")
@click.option("--tensorrt", "tensorrt_version", default=None,
              help="Plan for this TensorRT version (e.g. 10.13 or 11.4) [default: the installed one; "
                   "11 when none is installed]. Only --dry-run may differ from the installed version.")
@click.option("--dry-run", is_flag=True, help="Print the build plan and the preflight of the export; build nothing.")
@click.option("--json", "as_json", is_flag=True, help="With --dry-run: the plan as JSON on stdout.")
@reports_errors
def build_command(export_dir, target, precision, graphs, batch, window, block, prefix, workspace,
                  optimization_level, no_timing_cache, calibration_file, calibration_samples, output,
                  tensorrt_version, dry_run, as_json):
    """Build TensorRT engines of the step graphs in EXPORT_DIR (made by `dlmrt export`) into the store."""
    require_onnx_extra()
    from rich.console import Console

    from dlmrt.engines import build, builder, profiles, targets
    from dlmrt.engines.plan import make_plan
    from dlmrt.engines.store import EngineStore

    console = Console(stderr=True)
    installed = builder.installed_tensorrt()
    if not dry_run:
        builder.require_tensorrt()
    if tensorrt_version and installed and tensorrt_version != installed and not dry_run:
        raise ArgumentError(f"--tensorrt {tensorrt_version} differs from the installed TensorRT {installed}: "
                            f"an engine is built by the installed one (use --tensorrt with --dry-run only)")
    planned_for = tensorrt_version or installed or "11"
    chosen_target = targets.resolve(target)
    ranges = {dim: profiles.parse_range(value, dim)
              for dim, value in (("batch", batch), ("window", window), ("block", block), ("prefix", prefix))
              if value is not None}
    if calibration_samples <= 0:
        raise ArgumentError(f"--calibration-samples must be positive, got {calibration_samples}")
    store = EngineStore(output)
    plan = make_plan(export_dir, chosen_target, precision or chosen_target.default_precision,
                     tensorrt=planned_for, store=store.root, ranges=ranges, graphs=tuple(graphs) or None,
                     workspace_bytes=parse_size(workspace), optimization_level=optimization_level,
                     timing_cache=not no_timing_cache,
                     calibration=str(calibration_file) if calibration_file else "task suite",
                     calibration_samples=calibration_samples)
    if dry_run:
        problems = build.dry_run_problems(plan)
        if as_json:
            click.echo(json.dumps({"plan": plan.to_dict(), "preflight": [str(p) for p in problems]}, indent=2))
        else:
            print_plan(plan, problems, installed)
        if problems:
            raise click.exceptions.Exit(1)
        return
    device = build.check_running_gpu(plan)
    quantize = build.quantizer(plan, calibration_file)
    with step_status(console) as show:
        entry = build.run(plan, store, device=device, tensorrt_version=installed, quantize=quantize, on_step=show)
    from dlmrt.engines import manifest

    print_manifest(entry, manifest.read(entry), [])


def step_status(console):
    """A spinner naming the build's current step, on a terminal; the steps as lines elsewhere."""
    from contextlib import contextmanager

    @contextmanager
    def status():
        if not console.is_terminal:
            yield lambda step: console.print(step)
            return
        with console.status("") as spinner:
            yield lambda step: spinner.update(f"{step}…")
    return status()


def key_value_table(title: str):
    """A two-column table of names and values, values folded rather than cut off."""
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_column("", style="bold", no_wrap=True)
    table.add_column("", overflow="fold")
    return table


def print_plan(plan, problems, installed: str | None) -> None:
    from rich.console import Console

    from dlmrt.engines.profiles import trtexec_flags
    from dlmrt.engines.targets import GiB

    console = Console()
    table = key_value_table(f"build plan: {plan.model} for {plan.target} {plan.precision}")
    rows = [
        ("export", plan.export_dir),
        ("TensorRT", f"{plan.tensorrt} ({plan.typing}){'' if installed else ', not installed here'}"),
        ("builder flags", ", ".join(plan.builder_flags) or "none (precision from the graph)"),
        ("export dtype", plan.export_dtype),
        ("quantization", f"{plan.quantization['method']}, calibrated on {plan.quantization['samples']} step "
                         f"inputs from {plan.quantization['calibration']}" if plan.quantization else "none"),
        ("profile", ", ".join(f"{dim} {value}" for dim, value in plan.ranges.items())),
        ("workspace", f"{plan.options.workspace_bytes / GiB:g} GiB"),
        ("optimization level", str(plan.options.optimization_level)),
        ("timing cache", "reused and updated" if plan.options.timing_cache else "off"),
        ("plugins", ", ".join(f"{p['namespace']}::{p['name']} v{p['version']}" for p in plan.plugins)),
        ("output", plan.output),
        *(("note", note) for note in plan.notes),
    ]
    rows += [(f"graph {graph.name}", f"{graph.onnx} (sha256 {graph.sha256[:16]}…)") for graph in plan.graphs]
    for row in rows:
        table.add_row(*row)
    console.print(table)
    click.echo("each graph's profile as trtexec's flags, one line a graph to paste:")
    for graph in plan.graphs:  # plain lines: a table would wrap them inside its borders
        click.echo(f"  --onnx={Path(plan.export_dir) / graph.onnx} {' '.join(trtexec_flags(graph.shapes))}")
    if problems:
        print_line(console, f"preflight: {len(problems)} problem{'s' * (len(problems) > 1)}", style="red")
        for problem in problems:
            print_line(console, f"  {problem}")
    else:
        print_line(console, "preflight: the export's graphs pass (operators, opset, plugins, Q/DQ, profiles)")


def print_manifest(entry: Path, record: dict, problems: list[str]) -> None:
    from rich.console import Console

    console = Console()
    table = key_value_table(str(entry))
    for key in ("model", "target", "compute_capability", "device", "precision", "tensorrt_version", "typing",
                "built_at", "build_s"):
        table.add_row(key, str(record.get(key)))
    table.add_row("profile", ", ".join(f"{dim} {value}" for dim, value in record["ranges"].items()))
    table.add_row("plugins", ", ".join(f"{p['namespace']}::{p['name']} v{p['version']}" for p in record["plugins"]))
    for name, info in record["graphs"].items():
        table.add_row(f"graph {name}", f"{info['engine']} (sha256 {info['engine_sha256'][:16]}…)\n"
                                       f"from {info['onnx']} (sha256 {info['onnx_sha256'][:16]}…)")
    console.print(table)
    if problems:
        print_line(console, "hashes: " + "; ".join(problems), style="red")
    else:
        print_line(console, "hashes: every engine and the timing cache match the manifest")


@click.command("inspect")
@click.argument("path", type=click.Path(path_type=Path, exists=True))
@click.option("--json", "as_json", is_flag=True, help="The manifest and the hash check as JSON.")
@click.option("--for", "export_dir", type=click.Path(path_type=Path), default=None,
              help="Pick, from the store PATH, the engine the runtime would run for this export on this GPU "
                   "and TensorRT (or --target / --tensorrt), or say why none fits.")
@click.option("--target", type=click.Choice(TARGET_CHOICES), default="auto", show_default=True,
              help="With --for: the GPU target to select for.")
@click.option("--precision", type=click.Choice(PRECISION_CHOICES), default=None,
              help="With --for: the precision [default: the target's first].")
@click.option("--tensorrt", "tensorrt_version", default=None,
              help="With --for: the TensorRT version to select for [default: the installed one].")
@reports_errors
def inspect_command(path, as_json, export_dir, target, precision, tensorrt_version):
    """Show the manifest of an engine directory (or every engine under a store or model directory) and
    check its sha256 hashes; exits with status 1 when a file is missing or differs."""
    from rich.console import Console

    from dlmrt.engines import manifest
    from dlmrt.engines.store import MANIFEST, EngineStore

    broken: dict[Path, str] = {}
    if export_dir is not None:
        entries = [selected_entry(EngineStore(path), export_dir, target, precision, tensorrt_version)]
    elif (path / MANIFEST).is_file():
        entries = [path]
    else:
        store = EngineStore(path)
        entries, broken = store.entries(), store.broken_entries()
        if not entries and not broken:  # a model directory of the store: its entries
            entries = [entry for entry in sorted(path.iterdir()) if (entry / MANIFEST).is_file()]
    if not entries and not broken:
        raise ArgumentError(f"{path} holds no engine (no {MANIFEST}): pass an engine directory "
                            f"(<store>/<model>/<target>-<precision>) or a store")
    failed = bool(broken)
    reports = [{"entry": str(entry), "manifest": None, "problems": [f"{entry} {why}"]} for entry, why in broken.items()]
    for entry in entries:
        try:
            record = manifest.read(entry)
            problems = manifest.problems(entry, record)
        except manifest.ManifestError as error:
            record, problems = None, [str(error)]
        failed |= bool(problems)
        reports.append({"entry": str(entry), "manifest": record, "problems": problems})
    for report in reports if not as_json else ():
        if report["manifest"] is None:
            print_line(Console(stderr=True), report["problems"][0], style="red")
        else:
            print_manifest(Path(report["entry"]), report["manifest"], report["problems"])
    if as_json:
        click.echo(json.dumps(reports, indent=2))
    if failed:
        raise click.exceptions.Exit(1)


def selected_entry(store, export_dir: Path, target: str, precision: str | None,
                   tensorrt_version: str | None) -> Path:
    """The store's engine entry for the export on the target and TensorRT (EngineMismatch if none fits)."""
    from dlmrt.engines import builder, targets
    from dlmrt.engines.select import select

    tensorrt_version = tensorrt_version or builder.installed_tensorrt()
    if tensorrt_version is None:
        raise ArgumentError("TensorRT is not installed: pass --tensorrt VERSION to select for one")
    capability = targets.resolve(target).compute_capability
    return select(store, export_dir, capability=capability, tensorrt_version=tensorrt_version,
                  precision=precision).entry
