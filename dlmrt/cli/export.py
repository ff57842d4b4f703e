"""`dlmrt export`: the step graphs of a model to ONNX with their manifest (quantized for a CPU on request),
verified against the torch step on request; it prints the files written and the checks."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import click

from dlmrt import TINY_MODEL_DIR
from dlmrt.cli.errors import UserError, reports_errors, require_onnx_extra
from dlmrt.cli.options import DTYPE_CHOICES
from dlmrt.cli.progress import step_progress
from dlmrt.export.cpu_quantized import PRECISIONS as CPU_INT_PRECISIONS
from dlmrt.quant.cpu_int import BLOCK_SIZES as CPU_INT_BLOCK_SIZES


@click.command("export")
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
