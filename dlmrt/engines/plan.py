"""The build plan: everything a build will do, as plain data, before it does any of it.

`dlmrt build --dry-run` prints it; a real build follows it and records it in the engine's manifest.
It names the ONNX files (with the sha256 the export recorded), the target and precision, how the
precision reaches TensorRT (builder flags on 10.x, the graph's own types on 11.x, which is always
strongly typed), the quantization step, the optimization profile of every graph, the plugins the
graphs need, and the builder options.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx

from dlmrt.engines import plugin_specs, profiles
from dlmrt.engines.targets import Target, check_precision
from dlmrt.core.errors import DlmrtError
from dlmrt.models import generation_config
from dlmrt.export.cpu_quantized import is_cpu_quantized
from dlmrt.export.export_manifest import ExportManifest, ExportManifestError

PLAN_VERSION = 1
DEFAULT_GRAPHS = ("full", "cached")
# Builder flags per precision on TensorRT 10.x; 11.x has none (precision comes from the graph). The
# 16-bit flag lets the layers that are not quantized run in reduced precision too.
PRECISION_FLAGS = {"bf16": ("BF16",), "fp16": ("FP16",), "fp8": ("FP8", "BF16"), "nvfp4": ("FP4", "FP8", "BF16")}
# The export dtypes that carry a 16-bit precision in the graph itself (needed by strongly typed builds).
GRAPH_DTYPE = {"bf16": "bfloat16", "fp16": "float16"}
QUANTIZERS = {"fp8": "nvidia-modelopt ONNX PTQ (fp8, per-tensor E4M3 Q/DQ)",
              "nvfp4": "dlmrt NVFP4 (E2M1 in 16-element blocks, E4M3 block scales, TensorRT FP4 Q/DQ)"}


class PlanError(DlmrtError):
    """The export, the options or the TensorRT version cannot make the requested engine."""


@dataclass(frozen=True)
class GraphPlan:
    name: str  # "full", "cached", ...
    onnx: str  # file name inside the export directory
    sha256: str
    shapes: dict[str, list[list[int]]]  # input -> [min, opt, max] shapes


@dataclass(frozen=True)
class BuildOptions:
    workspace_bytes: int
    optimization_level: int
    timing_cache: bool = True  # reuse and update the store's timing cache


@dataclass(frozen=True)
class BuildPlan:
    model: str
    export_dir: str
    target: str
    compute_capability: list[int]
    precision: str
    tensorrt: str  # the installed version, or the major version planned for ("11.x")
    typing: str  # "strongly-typed" or "precision-flags"
    builder_flags: list[str]
    export_dtype: str
    quantization: dict | None  # {"method", "calibration", "samples"} for fp8 / nvfp4
    ranges: dict[str, str]  # dimension -> "min:opt:max"
    graphs: list[GraphPlan]
    plugins: list[dict]
    options: BuildOptions
    output: str  # the engine directory in the store
    plan_version: int = PLAN_VERSION
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @property
    def key(self) -> str:
        return f"{self.target}-{self.precision}"


def _block_length(export_dir: Path) -> int:
    """The model's default block length (the window most steps run over), from its generation config."""
    return generation_config.read(export_dir, ExportManifestError).get("block_length", 32)


def typing_for(tensorrt_version: str) -> str:
    major = int(tensorrt_version.split(".")[0])
    if major < 10:
        raise PlanError(f"TensorRT {tensorrt_version} is too old: dlmrt builds with TensorRT 10.9 or newer "
                        f"(pip install 'dlmrt[tensorrt]')")
    return "strongly-typed" if major >= 11 else "precision-flags"


def graph_plugins(export_dir: Path, files: list[str]) -> list[dict]:
    """The plugins the graphs' custom nodes need (read from the graphs, weights left on disk)."""
    return plugin_specs.used_by(onnx.load(str(export_dir / name), load_external_data=False) for name in files)


def make_plan(export_dir: str | Path, target: Target, precision: str, *, tensorrt: str, store: Path,
              ranges: dict[str, profiles.DimRange] | None = None, graphs: tuple[str, ...] | None = None,
              workspace_bytes: int | None = None, optimization_level: int | None = None,
              timing_cache: bool = True, calibration: str = "task suite", calibration_samples: int = 32,
              opt_window: int | None = None) -> BuildPlan:
    """The plan for building `graphs` of the export in `export_dir` (by default its step graphs: full and
    cached, or a uniform-noise model's encode, decode and soft_tokens); profile dimensions not in `ranges`
    cover the export's limits, tuned for the target's batch and the model's block length (its canvas,
    for a uniform-noise model, whose prompt runs the encoder over an empty prefix)."""
    export_dir = Path(export_dir)
    export = ExportManifest.read(export_dir)
    if is_cpu_quantized(export):
        quantization = export.quantization
        raise PlanError(f"{export_dir} is an {quantization['precision']} export ({quantization['operator']}, an "
                        f"ONNX Runtime CPU operator TensorRT does not build): build engines from a float32 or "
                        f"bfloat16 export, and run this one with --backend ort on a CPU")
    uniform = export.model.noise == "uniform"
    if graphs is None:
        graphs = tuple(export.graphs) if uniform else DEFAULT_GRAPHS
    if opt_window is None:
        opt_window = export.model.canvas_length if uniform else _block_length(export_dir)
    check_precision(target, precision)
    typing = typing_for(tensorrt)
    export_dtype = export.model.dtype
    notes = []
    if typing == "strongly-typed" and precision in GRAPH_DTYPE and export_dtype != GRAPH_DTYPE[precision]:
        raise PlanError(
            f"TensorRT {tensorrt} builds strongly typed networks (precision comes from the graph), and this "
            f"export is {export_dtype}: export in {GRAPH_DTYPE[precision]} for a {precision} engine "
            f"(`dlmrt export MODEL_DIR --dtype {GRAPH_DTYPE[precision]} -o DIR`)")
    if typing == "strongly-typed" and precision in QUANTIZERS and export_dtype == "float32":
        notes.append(f"strongly typed: layers outside the {precision} Q/DQ pairs run in float32, as the export "
                     f"is; export in bfloat16 to run them in bf16")
    missing = [graph for graph in graphs if graph not in export.graphs]
    if missing:
        hint = " (export with --guidance)" if any(g.endswith("_guided") for g in missing) else ""
        raise PlanError(f"{export_dir} has no {', '.join(missing)} graph{'s' * (len(missing) > 1)}{hint}: "
                        f"it has {', '.join(export.graphs)}")
    chosen = profiles.default_ranges(export.limits, target.opt_batch, opt_window, min_prefix=0 if uniform else 1)
    chosen.update(ranges or {})
    profiles.check_within_limits(chosen, export.limits)
    graph_plans = [GraphPlan(graph, export.graphs[graph].file, export.graph_sha256(graph),
                             profiles.input_shapes(export.graphs[graph].inputs, chosen))
                   for graph in graphs]
    options = BuildOptions(workspace_bytes if workspace_bytes is not None else target.workspace_bytes,
                           optimization_level if optimization_level is not None else target.optimization_level,
                           timing_cache)
    if not 0 <= options.optimization_level <= 5:
        raise PlanError(f"--optimization-level must lie in [0, 5], got {options.optimization_level}")
    if options.workspace_bytes <= 0:
        raise PlanError(f"--workspace must be positive, got {options.workspace_bytes} bytes")
    quantization = ({"method": QUANTIZERS[precision], "calibration": calibration, "samples": calibration_samples}
                    if precision in QUANTIZERS else None)
    model = export.model.name
    return BuildPlan(
        model=model, export_dir=str(export_dir.resolve()), target=target.name,
        compute_capability=list(target.compute_capability), precision=precision, tensorrt=tensorrt,
        typing=typing, builder_flags=list(PRECISION_FLAGS[precision]) if typing == "precision-flags" else [],
        export_dtype=export_dtype, quantization=quantization, ranges={k: str(v) for k, v in chosen.items()},
        graphs=graph_plans, plugins=graph_plugins(export_dir, [graph.onnx for graph in graph_plans]),
        options=options,
        output=str(Path(store) / model / f"{target.name}-{precision}"), notes=notes)
