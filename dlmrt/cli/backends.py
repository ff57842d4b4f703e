"""Opening the backend that `--backend`, `--model`, `--mode` and `--device` name, for every command
that decodes (generate, eval, bench, serve)."""

from __future__ import annotations

from pathlib import Path

import click

from dlmrt import TINY_MODEL_DIR
from dlmrt.cli.errors import require_onnx_extra, require_trt_extra

# What --backend opens: the torch step loop, the exported graphs in ONNX Runtime, TensorRT's engines.
BACKENDS = ("torch", "ort", "trt")


def resolve_device(backend: str, device: str) -> str:
    """--device for --backend: auto is the GPU where the backend can run on one."""
    import torch

    if backend == "trt":
        if device == "cpu":
            raise click.UsageError("--backend trt runs on the GPU: drop --device cpu, or use --backend torch or ort")
        return "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise click.UsageError(f"--device cuda: torch {torch.__version__} sees no CUDA GPU here; use --device cpu")
    if device != "auto":
        return device
    if not torch.cuda.is_available():
        return "cpu"
    if backend == "ort":
        import onnxruntime

        return "cuda" if "CUDAExecutionProvider" in onnxruntime.get_available_providers() else "cpu"
    return "cuda"


def open_backend(backend: str, model_dir: Path | None, *, dtype: str, mode: str, max_batch: int,
                 device: str, engines: Path | None, precision: str | None, console, parallel=None, work=None,
                 on_compile=None):
    """(model, backend) for --backend: the model is what text in and out needs (a Denoiser, or an
    export's ExportedModel); the backend is None for the reference loop, which runs the model itself.
    `parallel`: on a rank of a parallel run, its (ParallelPlan, Ranks): the model is cut into its part.
    `work(model)`: the command's `cpu_mode.Work`, from which `--mode auto` on a CPU picks eager or compile
    (without it, auto is TorchBackend's: eager on a CPU). `on_compile(note)`: the torch backend's executor tells
    it what it compiles or captures, before it does."""
    if backend != "torch" and mode != "auto":
        raise click.UsageError(f"--mode applies to --backend torch; --backend {backend} runs its own way")
    check_precision(backend, precision, engines, parallel=parallel is not None)
    if backend == "ort":
        require_onnx_extra()
        from dlmrt.core.home import home
        from dlmrt.runtime.exported_model import ExportedModel
        from dlmrt.runtime.ort_backend import OrtBackend

        export_dir = ensure_exported(Path(model_dir or TINY_MODEL_DIR), dtype, console)
        exported = ExportedModel.load(export_dir)
        if exported.noise == "uniform":  # DiffusionGemma's encoder and decoder graphs, on the CPU
            return exported, OrtBackend(export_dir, device="cpu" if device == "auto" else
                                        resolve_device(backend, device))
        # optimized graphs are kept, for faster starts after the first
        return exported, OrtBackend(export_dir, device=resolve_device(backend, device),
                                    optimized_model_dir=home() / "ort")
    device = resolve_device(backend, device)
    if backend == "trt":
        require_trt_extra()
        from dlmrt.runtime.exported_model import ExportedModel
        from dlmrt.runtime.trt_backend import TrtBackend

        if model_dir is None:
            raise click.UsageError("--backend trt needs --model EXPORT_DIR, the export the engines were built from")
        trt_backend = TrtBackend(model_dir, engines, precision=precision)
        return ExportedModel.load(model_dir), trt_backend
    import dlmrt
    from dlmrt.runtime.torch_backend import TorchBackend

    # A rank of a split model loads it into host memory and moves only its part to the device, so that on GPUs
    # the whole model need not fit in one
    model = dlmrt.load(model_dir or TINY_MODEL_DIR, dtype=dtype, device="cpu" if parallel else device)
    if parallel is not None:
        plan, ranks = parallel
        plan.apply(model, ranks).to(device)
    if precision == "fp8":  # on the device it runs on: the kernel and its output dtype depend on it
        from dlmrt.runtime import fp8_linear

        fp8_linear.quantize_model(model)
    if backend == "torch" and mode == "auto" and device == "cpu" and work is not None:
        from dlmrt.runtime import cpu_mode

        mode = cpu_mode.auto_mode(model, work(model))
    if backend != "torch":
        return model, None
    return model, TorchBackend(model, mode=mode, max_batch=max_batch, on_compile=on_compile)


def once(function):
    """`function(model)` computed at its first call and returned again after: a command's settings, which
    `open_backend` may need first (for `--mode auto`'s work), and which warn only once."""
    results = []

    def first_result(model):
        if not results:
            results.append(function(model))
        return results[0]
    return first_result


def check_precision(backend: str, precision: str | None, engines: Path | None, *, parallel: bool) -> None:
    """--precision picks a stored engine for trt, and for torch runs the blocks' linears in fp8."""
    if backend == "torch" and precision not in (None, "fp8"):
        raise click.UsageError(f"--precision {precision} with --backend torch: torch runs fp8 (the blocks' linear "
                               f"layers), or the model's --dtype without --precision (--dtype bfloat16 for bf16)")
    if backend == "torch" and precision == "fp8" and parallel:
        raise click.UsageError("--precision fp8 runs the model on one device: drop --tp/--ep, or --precision")
    if backend == "ort" and precision is not None:
        raise click.UsageError("--precision applies to --backend trt and torch; for ONNX Runtime quantize the "
                               "export: dlmrt export --precision int8")
    if backend != "trt" and engines is not None:
        raise click.UsageError("--engines applies to --backend trt")


def ensure_exported(model_dir: Path, dtype: str, console) -> Path:
    """`model_dir` if it is an export, else its export in the cache (made on first use)."""
    from dlmrt.export.export_manifest import ExportManifest
    from dlmrt.export.onnx_export import cached_export_dir, export

    if ExportManifest.present(model_dir):
        return model_dir
    target = cached_export_dir(model_dir, dtype)
    if not ExportManifest.present(target):
        import dlmrt

        with console.status(f"exporting {model_dir} to {target} (once)"):
            export(dlmrt.load(model_dir, dtype=dtype), target)
    return target
