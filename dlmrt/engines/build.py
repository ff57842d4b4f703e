"""`dlmrt build`: from an export to engines in the store, following a build plan.

    check the GPU and the export -> quantize (fp8, nvfp4) -> preflight -> build each graph -> store

Everything lands in a new version of the store entry, which replaces the old one in one atomic
step after the manifest is written (see `store`): a build that fails or is killed leaves the
previous engines, timing cache and manifest as they were.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import onnx

from dlmrt.core import atomic
from dlmrt.engines import builder, manifest, preflight, targets
from dlmrt.engines.plan import BuildPlan, GraphPlan, PlanError
from dlmrt.engines.store import MANIFEST, TIMING_CACHE, EngineStore, engine_file
from dlmrt.export.export_manifest import ExportManifest
from dlmrt.core.hashing import sha256_of

QUANTIZED_DIR = "quantized"  # inside the entry: the exact graphs fp8 / nvfp4 engines were built from
EngineBuilder = Callable[[BuildPlan, GraphPlan, Path, "bytes | None"], "tuple[bytes, bytes]"]


def check_running_gpu(plan: BuildPlan) -> str:
    """TensorRT builds for the GPU it runs on: refuse a plan for another target. Returns the GPU's name."""
    gpu = targets.running_gpu()
    if gpu is None:
        raise targets.TargetError(f"building a {plan.target} engine needs that GPU, and this machine has no "
                                  f"CUDA GPU: build on a {plan.target} machine, or print the plan with --dry-run")
    capability, name = gpu
    if list(capability) != plan.compute_capability:
        found = targets.target_for_capability(capability, name).name
        raise targets.TargetError(f"TensorRT builds engines for the GPU it runs on: this is {name} ({found}), "
                                  f"the plan is for {plan.target}; use --target {found} (or auto) here, or build "
                                  f"on a {plan.target} machine")
    return name


def check_export(plan: BuildPlan) -> None:
    """The export's graphs still have the sha256 the plan was made from, and each is the graph its
    manifest describes (a foreign graph given the manifest's hashes is refused here)."""
    export_dir = Path(plan.export_dir)
    export = ExportManifest.read(export_dir)
    for graph in plan.graphs:
        found = sha256_of(export_dir / graph.onnx)
        if found != graph.sha256:
            raise PlanError(f"{export_dir / graph.onnx} changed since it was exported (sha256 {found[:16]}…, "
                            f"the export's manifest records {graph.sha256[:16]}…): export again")
        export.check_graph(graph.name, onnx.load(str(export_dir / graph.onnx), load_external_data=False),
                           export_dir / graph.onnx)


def graphs_to_parse(plan: BuildPlan, staging: Path, quantize: Callable[[GraphPlan, Path], None] | None,
                    on_step: Callable[[str], None]) -> dict[str, Path]:
    """The ONNX file each graph's engine is built from: the export's, or its quantized form."""
    paths = {}
    for graph in plan.graphs:
        source = Path(plan.export_dir) / graph.onnx
        if quantize is None:
            paths[graph.name] = source
            continue
        on_step(f"quantizing {graph.name} ({plan.precision})")
        target = staging / QUANTIZED_DIR / graph.onnx
        target.parent.mkdir(parents=True, exist_ok=True)
        quantize(graph, target)
        paths[graph.name] = target
    return paths


def load_for_checks(paths: dict[str, Path]) -> dict[str, onnx.ModelProto]:
    return {name: onnx.load(str(path), load_external_data=False) for name, path in paths.items()}


def reusable_timing_cache(plan: BuildPlan, store: EngineStore, tensorrt_version: str) -> bytes | None:
    """The entry's timing cache, if the last build ran the same TensorRT (a cache from another version
    does not load)."""
    entry = store.entry(plan.model, plan.key)
    try:
        previous = manifest.read(entry)
    except manifest.ManifestError:
        return None
    if previous.get("tensorrt_version") != tensorrt_version:
        return None
    return store.read_timing_cache(plan.model, plan.key)


def run(plan: BuildPlan, store: EngineStore, *, device: str, tensorrt_version: str,
        quantize: Callable[[GraphPlan, Path], None] | None = None,
        engine_builder: EngineBuilder = builder.build_graph,
        on_step: Callable[[str], None] = lambda _: None) -> Path:
    """Build every graph of `plan` into a new version of its store entry; returns the entry."""
    check_export(plan)
    started = time.perf_counter()
    cache = reusable_timing_cache(plan, store, tensorrt_version) if plan.options.timing_cache else None
    with store.writing(plan.model, plan.key) as staging:
        paths = graphs_to_parse(plan, staging, quantize, on_step)
        on_step("preflight")
        preflight.require_clean(plan, load_for_checks(paths))
        for graph in plan.graphs:
            on_step(f"building {graph.name}")
            engine, cache = engine_builder(plan, graph, paths[graph.name], cache)
            atomic.write_bytes(staging / engine_file(graph.name), engine)
        if cache and plan.options.timing_cache:
            atomic.write_bytes(staging / TIMING_CACHE, cache)
        # the export's own graphs were hashed by check_export; only quantized ones are new
        built_from = {graph.name: sha256_of(paths[graph.name]) if quantize else graph.sha256
                      for graph in plan.graphs}
        record = manifest.make(plan, staging, tensorrt_version=tensorrt_version, device=device,
                               build_s=time.perf_counter() - started, built_graphs=built_from)
        atomic.write_text(staging / MANIFEST, manifest.to_json(record))
    return store.entry(plan.model, plan.key)


def quantizer(plan: BuildPlan, prompts: Path | None) -> Callable[[GraphPlan, Path], None] | None:
    """How fp8 / nvfp4 builds quantize each graph: calibration inputs recorded from the real step loop
    on `prompts` (None: the task suite), then modelopt's FP8 PTQ or dlmrt's NVFP4 writer."""
    if plan.quantization is None:
        return None
    from dlmrt.quant import calibration

    if plan.precision == "fp8":
        from dlmrt.quant.fp8 import quantize_onnx
    else:
        from dlmrt.quant.nvfp4_onnx import quantize_onnx

    def quantize(graph: GraphPlan, target: Path) -> None:
        feeds = calibration.calibration_feeds(plan.export_dir, graph.name, prompts=prompts,
                                              count=plan.quantization["samples"])
        quantize_onnx(Path(plan.export_dir) / graph.onnx, target, feeds)
    return quantize


def dry_run_problems(plan: BuildPlan) -> Sequence[preflight.Problem]:
    """Preflight of the export's own graphs; a quantized precision's Q/DQ check waits for quantization."""
    check_export(plan)
    paths = {graph.name: Path(plan.export_dir) / graph.onnx for graph in plan.graphs}
    return preflight.check(plan, load_for_checks(paths), quantized=False)
